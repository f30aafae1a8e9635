"""glassgpt's own CPU kernels (kernels/*.cpp): built once per machine, then loaded.

    ops = native.load()        # torch.ops.glassgpt, or None where they cannot be had
    ops = native.gemv_ops()    # the same; without AVX-512, on AVX2 and FMA, the float32/bfloat16 `gemv` alone
    lib = native.library()     # the same build as a ctypes library (gg_step: kernels/step.cpp; gg_family_step: family_step.cpp), or None
    lib = native.described_library()  # either build as a ctypes library with gg_described_step (described_step.cpp)
    native.status()            # one line: what was built and where, or why there is none

The kernels are matrix-vector products for decoding (float32, bfloat16, int8 and 4-bit
weights) written for AVX-512, and a whole decoding step over them (step.cpp). The first call
compiles them with the system's C++ compiler
(g++, as Debian ships it) against the installed torch's headers, in about 10 seconds, into
`cache_dir()/kernels/` under a name that holds a hash of the sources, the compiler flags and
the torch version; later processes load that file in milliseconds. A CPU without AVX-512, a
machine without a compiler or torch headers, or a build that fails: `load()` returns None,
`status()` says why in one line, a `KernelWarning` says it once per process, and every
caller runs PyTorch's own operators instead (the pure-PyTorch path, which the tests cover).

On a CPU with AVX2 and FMA but no AVX-512, `gemv_ops()` builds the float products alone
(kernels/gemv_avx2.cpp, 8 lanes wide, with ops.cpp's `gemv` operator), the one kernel decoding
there is made of: PyTorch's one-row float32 product streams a weight on one core at about half
the memory's rate on such a CPU (benchmarks/RESULTS.md), and the described step (described_step.cpp,
written for AVX2, in both builds). int8, 4-bit, GPT-2's step and RopeStep need the AVX-512 build.

A library in the cache is executed only once it is known whole. A build runs under a lock
(`kernels/build.lock`: a second process waits, then finds the library built), in a temporary
folder; the library is loaded once in a child process, its size and sha256 are written beside
it (`<library>.sha256`), and then it is renamed into place, so that no process ever sees half
of one. Before loading, `check_built` reads its ELF header (the file holds every segment the
header names) and compares it with that record: a library cut short (an interrupted build, a
full disk), changed, or without a record is never loaded (a cut one kills the process that
maps it with SIGBUS) but built again, with one `CacheWarning` naming the file. A cache folder
that cannot be written: a whole library there is still loaded; else PyTorch's operators run,
and the `KernelWarning` names the folder.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..device import cpu_flags
from ..errors import CacheWarning, KernelWarning

SOURCES = Path(__file__).parent / "kernels"
REQUIRED = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")  # the ISA every kernel is written for
OPTIONAL = {"avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}  # used where present
AVX2 = ("avx2", "fma")  # the ISA of the AVX2 build (gemv_avx2.cpp): the float products alone
BUILD_SECONDS = 300
RECORD = ".sha256"  # beside each library: {"bytes": its size, "sha256": its digest}, written by its build
MISSING = "is not built yet"

_status = "not loaded yet"
_gemv_status = "not loaded yet"
_library: list[ctypes.CDLL] = []  # the library this process loaded (one per process)


@dataclass(frozen=True)
class Build:
    """One library of kernels: the sources compiled with the CPU's ISA flags, and ops.cpp's defines."""
    name: str  # its file name's start in the cache
    kernels: tuple[str, ...]
    defines: tuple[str, ...] = ()


WHOLE = Build("glassgpt_kernels", ("gemv.cpp", "step.cpp", "family_step.cpp", "described_step.cpp"))
GEMV_AVX2 = Build("glassgpt_gemv_avx2", ("gemv_avx2.cpp", "described_step.cpp"), ("-DGG_GEMV_ONLY",))


def cache_dir() -> Path:
    """Where glassgpt keeps what it builds, measures and tokenizes once per machine:
    $XDG_CACHE_HOME/glassgpt, by default ~/.cache/glassgpt (the one cache root). A relative
    XDG_CACHE_HOME is ignored, as the XDG specification asks (it would move with the working
    folder); so is a HOME that is unset, empty or relative: the home folder is then the password
    database's."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(root):
        return Path(root) / "glassgpt"
    home = os.environ.get("HOME", "")
    if not os.path.isabs(home):
        import pwd
        home = pwd.getpwuid(os.getuid()).pw_dir
    return Path(home) / ".cache" / "glassgpt"


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("Intel(R) Xeon(R) Processor", "AMD EPYC 9R14 ...")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def isa_flags(flags: frozenset[str]) -> list[str] | None:
    """The compiler flags for this CPU's instruction sets, or None where it lacks what the kernels need."""
    if not set(REQUIRED) <= flags:
        return None
    return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"] + [
        flag for name, flag in OPTIONAL.items() if name in flags]


def avx2_flags(flags: frozenset[str]) -> list[str] | None:
    """The compiler flags for the AVX2 build, or None where the CPU lacks AVX2 or FMA."""
    return ["-mavx2", "-mfma"] if set(AVX2) <= flags else None


def status() -> str:
    """What `load()` found: the library it loaded, or why glassgpt runs PyTorch's operators instead."""
    return _status


def load(flags: frozenset[str] | None = None, directory: Path | None = None):
    """`torch.ops.glassgpt` with the kernels registered, building them first if needed; None if they cannot be had.

    `flags` (this CPU's, by default) and `directory` (`cache_dir()/kernels`) are for tests:
    fewer flags build and load a library for a smaller instruction set (one that this CPU
    also runs: a process holds one library, the first it loads).
    """
    if flags is None and directory is None:
        return _load_once()
    return _load(cpu_flags() if flags is None else flags, directory)


def gemv_ops(flags: frozenset[str] | None = None, directory: Path | None = None):
    """`torch.ops.glassgpt` with at least its float32/bfloat16 `gemv`: the whole kernels where `load()` has them,
    else, on a CPU with AVX2 and FMA, the AVX2 build of the float products alone; None where neither can be had
    (`gemv_status()` says why). `flags` and `directory` as for `load` (tests)."""
    if flags is None and directory is None:
        return _load_once() or _gemv_once()
    flags = cpu_flags() if flags is None else flags
    return _load(flags, directory) or _load_gemv(flags, directory)


def gemv_status() -> str:
    """What `gemv_ops()` found, in one line: the library it loaded, or why PyTorch's products run."""
    return _status if _status.startswith("built") else _gemv_status


@functools.lru_cache(maxsize=1)
def _gemv_once():
    ops = _load_gemv(cpu_flags(), None)
    if ops is None and _gemv_status != _status:  # (the same cause, no compiler say, is said once)
        warnings.warn(f"glassgpt's AVX2 matrix-vector kernel is not used: {_gemv_status}", KernelWarning, stacklevel=3)
    return ops


def _load_gemv(flags: frozenset[str], directory: Path | None):
    global _gemv_status
    isa = avx2_flags(flags)
    if isa is None:
        _gemv_status = "this CPU lacks " + ", ".join(f for f in AVX2 if f not in flags) + \
            "; PyTorch's own operators run instead"
        return None
    try:
        path = _open(build(isa, directory or cache_dir() / "kernels", GEMV_AVX2))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _gemv_status = f"{_one_line(e)}; PyTorch's own operators run instead"
        return None
    _gemv_status = f"the AVX2 build of the float products (this CPU has no AVX-512), in {path}"
    return torch.ops.glassgpt


@functools.lru_cache(maxsize=1)
def _load_once():
    ops = _load(cpu_flags(), None)
    if ops is None:
        warnings.warn(f"glassgpt's CPU kernels are not used: {_status}", KernelWarning, stacklevel=3)
    return ops


def _load(flags: frozenset[str], directory: Path | None):
    global _status
    isa = isa_flags(flags)
    if isa is None:
        missing = ", ".join(f for f in REQUIRED if f not in flags)
        _status = f"this CPU lacks {missing}; PyTorch's own operators run instead" + (
            " (for float32 and bfloat16 products, glassgpt's AVX2 gemv where it measured faster, and its described "
            "step for the models it covers)"
            if avx2_flags(flags) else "")
        return None
    try:
        path = _open(build(isa, directory or cache_dir() / "kernels"))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _status = f"{_one_line(e)}; PyTorch's own operators run instead"
        return None
    _status = f"built for {' '.join(f.removeprefix('-m') for f in isa)}, in {path}"
    return torch.ops.glassgpt


def _open(path: Path) -> Path:
    """Load the library at `path` and register its operators (and their shapes for torch.compile), unless a
    library is registered already: one per process."""
    if not hasattr(torch.ops.glassgpt, "gemv"):
        _library.append(ctypes.CDLL(str(path)))  # its error names what is wrong (torch's says only "could not load")
        torch.ops.load_library(str(path))
    _register_fakes()
    return path


def _one_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__


def library() -> ctypes.CDLL | None:
    """The loaded kernels as a ctypes library, for the calls that pass raw addresses (engine/step.py); None without them."""
    if _load_once() is None or not _library:  # (the AVX2 build has no step: load() is None there)
        return None
    lib = _library[0]
    if not hasattr(lib, "_glassgpt_typed"):
        lib.gg_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        lib.gg_step.restype = None
        lib.gg_step_scratch_bytes.argtypes = [ctypes.c_int64] * 3
        lib.gg_step_scratch_bytes.restype = ctypes.c_int64
        lib.gg_family_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        lib.gg_family_step.restype = None
        lib.gg_family_step_scratch_bytes.argtypes = [ctypes.c_int64] * 4
        lib.gg_family_step_scratch_bytes.restype = ctypes.c_int64
        lib._glassgpt_typed = True
    return lib


def described_library() -> ctypes.CDLL | None:
    """The loaded build, whole or AVX2, as a ctypes library with `gg_described_step` (kernels/described_step.cpp,
    written for AVX2: both builds hold it); None without either build (`gemv_status()` says why)."""
    if gemv_ops() is None or not _library:
        return None
    lib = _library[0]
    if not hasattr(lib, "_glassgpt_described"):
        lib.gg_described_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        lib.gg_described_step.restype = None
        lib._glassgpt_described = True
    return lib


def library_path(isa: list[str], directory: Path, what: Build = WHOLE) -> Path:
    """Where the kernels for `isa` are kept in `directory`: a name holding the hash of the sources, the flags,
    torch's version and Python's."""
    key = hashlib.sha256()
    for part in sorted(SOURCES.iterdir()):
        key.update(part.name.encode() + part.read_bytes())
    key.update(" ".join([*_kernel_flags(isa), *what.defines, _abi(), torch.__version__, sys.version]).encode())
    return directory / f"{what.name}-{key.hexdigest()[:16]}.so"


def _kernel_flags(isa: list[str]) -> list[str]:
    return ["-O3", "-std=c++17", "-fPIC", "-fopenmp", *isa]


def _abi() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def build(isa: list[str], directory: Path, what: Build = WHOLE) -> Path:
    """The kernels for `isa` in `directory`, whole (check_built): compiled and linked there first where they are
    not, or where the file there cannot be trusted (then with a CacheWarning naming it)."""
    path = library_path(isa, directory, what)
    problem = check_built(path)
    if problem is None:
        return path
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError(_untrusted(path, problem) + "no C++ compiler (g++) found: install one, e.g. apt-get install g++")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / "build.lock", "a")
    except OSError as e:  # a read-only cache, a file where the folder should be, a full disk
        raise OSError(f"{_untrusted(path, problem)}the kernel cache {directory} cannot be written "
                      f"({e.strerror or e}): set XDG_CACHE_HOME to a folder that can be") from None
    import fcntl  # (POSIX only, as are the kernels' compiler flags)
    with lock:  # (closing it releases the lock; so does the system, if this process dies)
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building here: wait for it
        if check_built(path) is not None:  # else the other process built it while this one waited
            for stale in directory.glob("build-*"):  # no build runs here now: these were stopped part way
                shutil.rmtree(stale, ignore_errors=True)
            _compile_into(path, compiler, isa, what)
    if problem != MISSING:
        warnings.warn(f"{path} {problem}: built it again", CacheWarning, stacklevel=2)
    return path


def _untrusted(path: Path, problem: str) -> str:
    return "" if problem == MISSING else f"{path} {problem}, and "


def _compile_into(path: Path, compiler: str, isa: list[str], what: Build = WHOLE) -> None:
    """Compile, link and load once in a child process; record its size and sha256; then rename it to `path`."""
    from torch.utils import cpp_extension  # (setuptools: only a build needs it)
    torch_lib = str(Path(torch.__file__).parent / "lib")
    kernel_cmd = _kernel_flags(isa)
    ops_cmd = ["-O2", "-std=c++20", "-fPIC", _abi(), *what.defines, *[f"-I{p}" for p in cpp_extension.include_paths()]]
    with tempfile.TemporaryDirectory(prefix="build-", dir=path.parent) as tmp:
        objects = [[compiler, *kernel_cmd, "-c", str(SOURCES / source), "-o", f"{tmp}/{Path(source).stem}.o"]
                   for source in what.kernels]
        objects.append([compiler, *ops_cmd, "-c", str(SOURCES / "ops.cpp"), "-o", f"{tmp}/ops.o"])
        link = [compiler, "-shared", *[cmd[-1] for cmd in objects],
                "-o", f"{tmp}/lib.so", "-fopenmp", f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        # The objects compile side by side, one a core (on 2 cores: 28 s one after the other, 15 s so).
        for cmd, result in zip(objects, _compile_all(objects)):
            _raise_if_failed(cmd, result)
        _raise_if_failed(link, _compile_all([link])[0])
        library = Path(tmp) / "lib.so"
        _load_in_child(library)
        with open(library, "rb+") as f:
            os.fsync(f.fileno())  # on the disk before its name says it is whole
        data = library.read_bytes()
        record = Path(tmp) / "record"
        record.write_text(json.dumps({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
        # Record first, then the library: a process stopped between the two leaves a record that the old
        # file (or none) does not match, which is built again.
        os.replace(record, path.with_name(path.name + RECORD))
        os.replace(library, path)  # atomic: a process that loads it sees all of it or none


def _compile_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Run the compiler commands, one a core; if this process is interrupted (Ctrl-C), the compilers stop too."""
    running: list[subprocess.Popen] = []

    def run(cmd: list[str]) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        running.append(proc)
        try:
            _, err = proc.communicate(timeout=BUILD_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, "", err)

    pool = concurrent.futures.ThreadPoolExecutor(max(1, min(len(commands), len(os.sched_getaffinity(0)))))
    try:
        return list(pool.map(run, commands))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in running:
            proc.kill()
        raise
    finally:
        pool.shutdown(wait=True)


def _load_in_child(library: Path) -> None:
    """Load a library just built in another process, so that one that cannot be loaded is never kept."""
    done = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(library)],
                          capture_output=True, text=True, timeout=BUILD_SECONDS)
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise OSError(f"the kernels just built do not load: {why}")


def check_built(path: Path) -> str | None:
    """None where `path` is a whole library as its build wrote it; else what is wrong with it, in words that
    follow its name (MISSING where there is none): its ELF header, then its size and sha256 against its record."""
    record = path.with_name(path.name + RECORD)
    try:
        size = path.stat().st_size
        problem = elf_problem(path, size)
        if problem:
            return problem
        try:
            built = json.loads(record.read_text())
            want_size, want_sha = int(built["bytes"]), str(built["sha256"])
        except FileNotFoundError:
            return f"has no record of its build (its size and sha256, in {record.name})"
        except (ValueError, KeyError, TypeError):
            return f"has a record of its build that cannot be read ({record.name})"
        if size != want_size:
            return f"is {size:,} bytes where its build wrote {want_size:,}" + (" (cut short)" if size < want_size else "")
        if hashlib.sha256(path.read_bytes()).hexdigest() != want_sha:
            return "does not match the sha256 recorded at its build"
    except (FileNotFoundError, NotADirectoryError):
        return MISSING
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def elf_problem(path: Path, size: int) -> str | None:
    """None where `path` starts with a 64-bit little-endian ELF shared library's header and holds every
    segment and section table that header names; else what is wrong."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF":
            return f"is not a library: its {size:,} bytes hold no ELF header"
        if head[4:6] != b"\x02\x01" or struct.unpack_from("<H", head, 16)[0] != 3:  # ELFCLASS64, little-endian, ET_DYN
            return "is not a 64-bit shared library"
        phoff, shoff = struct.unpack_from("<QQ", head, 32)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 54)
        end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
        f.seek(phoff)
        table = f.read(phnum * phentsize)
        for i in range(len(table) // max(phentsize, 1) if phentsize >= 56 else 0):
            kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            if kind == 1:  # PT_LOAD: mapped from the file
                end = max(end, offset + filesz)
    if end > size:
        return f"is cut short: {size:,} bytes, where its ELF header names {end:,}"
    return None


def _raise_if_failed(cmd: list[str], result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
        raise OSError(f"building the kernels failed ({Path(cmd[0]).name}): "
                      f"{errors[0].strip() if errors else 'exit ' + str(result.returncode)}")


@functools.lru_cache(maxsize=1)
def _register_fakes() -> None:
    """The output shapes of the operators, for torch.compile, which traces them without running them (those the
    loaded build has: the AVX2 build registers `gemv` alone)."""
    def fake(name: str):
        return torch.library.register_fake(f"glassgpt::{name}") if hasattr(torch.ops.glassgpt, name) else (lambda f: f)

    @fake("gemv")
    def _(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    @fake("gemv_q8")
    def _(x, weight, scales, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    @fake("gemv_q4")
    def _(x, packed, scales_mins, bias, out_features, group_size):
        return x.new_empty(x.shape[0], out_features)

    @fake("gelu_tanh")
    def _(x):
        return torch.empty_like(x)
