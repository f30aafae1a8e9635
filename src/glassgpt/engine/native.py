"""glassgpt's own CPU kernels (kernels/*.cpp): built once per machine, then loaded.

    ops = native.load()        # torch.ops.glassgpt, or None where they cannot be had
    lib = native.library()     # the same build as a ctypes library (gg_step: kernels/step.cpp; gg_family_step: family_step.cpp), or None
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
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ..device import cpu_flags
from ..errors import KernelWarning

SOURCES = Path(__file__).parent / "kernels"
REQUIRED = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "fma")  # the ISA every kernel is written for
OPTIONAL = {"avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}  # used where present
BUILD_SECONDS = 300

_status = "not loaded yet"
_library: list[ctypes.CDLL] = []  # the library this process loaded (one per process)


def cache_dir() -> Path:
    """Where glassgpt keeps what it builds, measures and tokenizes once per machine:
    $XDG_CACHE_HOME/glassgpt, by default ~/.cache/glassgpt (the one cache root)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "glassgpt"


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
        _status = f"this CPU lacks {missing}; PyTorch's own operators run instead"
        return None
    try:
        path = build(isa, directory or cache_dir() / "kernels")
        if not hasattr(torch.ops.glassgpt, "gemv"):  # else registered already: one library per process
            _library.append(ctypes.CDLL(str(path)))  # its error names what is wrong (torch's says only "could not load")
            torch.ops.load_library(str(path))
        _register_fakes()
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__  # one line
        _status = f"{reason}; PyTorch's own operators run instead"
        return None
    _status = f"built for {' '.join(f.removeprefix('-m') for f in isa)}, in {path}"
    return torch.ops.glassgpt


def library() -> ctypes.CDLL | None:
    """The loaded kernels as a ctypes library, for the calls that pass raw addresses (engine/step.py); None without them."""
    if _load_once() is None or not _library:
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


def build(isa: list[str], directory: Path) -> Path:
    """Compile and link the kernels for `isa` into `directory` (once: the file name holds the inputs' hash)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) found: install one, e.g. apt-get install g++")
    torch_lib = str(Path(torch.__file__).parent / "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    kernel_cmd = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", *isa]
    key = hashlib.sha256()
    for part in sorted(SOURCES.iterdir()):
        key.update(part.name.encode() + part.read_bytes())
    key.update(" ".join([*kernel_cmd, abi, torch.__version__, sys.version]).encode())
    path = directory / f"glassgpt_kernels-{key.hexdigest()[:16]}.so"
    if path.exists():
        return path
    from torch.utils import cpp_extension  # (setuptools: only a build needs it)
    ops_cmd = ["-O2", "-std=c++20", "-fPIC", abi, *[f"-I{p}" for p in cpp_extension.include_paths()]]
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        objects = [[compiler, *kernel_cmd, "-c", str(SOURCES / "gemv.cpp"), "-o", f"{tmp}/gemv.o"],
                   [compiler, *kernel_cmd, "-c", str(SOURCES / "step.cpp"), "-o", f"{tmp}/step.o"],
                   [compiler, *kernel_cmd, "-c", str(SOURCES / "family_step.cpp"), "-o", f"{tmp}/family_step.o"],
                   [compiler, *ops_cmd, "-c", str(SOURCES / "ops.cpp"), "-o", f"{tmp}/ops.o"]]
        link = [compiler, "-shared", f"{tmp}/gemv.o", f"{tmp}/step.o", f"{tmp}/family_step.o", f"{tmp}/ops.o",
                "-o", f"{tmp}/lib.so", "-fopenmp", f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        # The objects compile side by side, one a core (on 2 cores: 28 s one after the other, 15 s so).
        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(objects), len(os.sched_getaffinity(0))))) as pool:
            done = list(pool.map(_compile, objects))
        for cmd, result in zip(objects, done):
            _raise_if_failed(cmd, result)
        _raise_if_failed(link, _compile(link))
        os.replace(f"{tmp}/lib.so", path)  # atomic: a process that loads it sees all of it or none
    return path


def _compile(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_SECONDS)


def _raise_if_failed(cmd: list[str], result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line] or result.stderr.splitlines()
        raise OSError(f"building the kernels failed ({Path(cmd[0]).name}): "
                      f"{errors[0].strip() if errors else 'exit ' + str(result.returncode)}")


@functools.lru_cache(maxsize=1)
def _register_fakes() -> None:
    """The output shapes of the operators, for torch.compile, which traces them without running them."""
    @torch.library.register_fake("glassgpt::gemv")
    def _(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("glassgpt::gemv_q8")
    def _(x, weight, scales, bias):
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("glassgpt::gemv_q4")
    def _(x, packed, scales_mins, bias, out_features, group_size):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("glassgpt::gelu_tanh")
    def _(x):
        return torch.empty_like(x)
