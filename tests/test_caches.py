"""The caches a command trusts (engine/native.py's kernel library, engine/autotune.py's timings): a file cut
short, changed, garbage, or in a folder that cannot be written is made again, or done without, with one note
naming it: never executed, never a traceback.

The kernel library is compiled once for the session by the real compiler (about 20 s); every rebuild after that
runs a stand-in `g++` that writes that same library, so a case costs a process start, not a build, and the
stand-in's log says how many builds ran. The child processes load the library for AVX-512 (the ISA the kernels
are written for) whatever this CPU runs: loading executes none of it. Where this CPU runs them, `generate` itself
runs after each cut (test_generate_after_...). Every case works in a temporary XDG_CACHE_HOME, never the user's.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import glassgpt
from glassgpt.engine import autotune, native
from glassgpt.errors import CacheWarning

from conftest import needs_kernels, skip_unless_required

SRC = str(Path(__file__).resolve().parents[1] / "src")
ISA = native.isa_flags(frozenset(native.REQUIRED))
CUTS = [0, 1, 16, "half", "size-1"]

# A stand-in compiler: for `-o X.so` it copies the session's library to X.so, for `-o X.o` an empty object;
# each call is logged, and may first sleep (a build to interrupt).
FAKE_GXX = """#!/bin/sh
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo "$out" >> "$GLASSGPT_TEST_BUILDS"
sleep "${GLASSGPT_TEST_COMPILE_SECONDS:-0}"
case "$out" in *.so) cp "$GLASSGPT_TEST_LIBRARY" "$out";; *) : > "$out";; esac
"""

# What a command does first with the kernels (native.load, as autotune calls it), with the notes the command line
# prints; this CPU's flags taken as the kernels' (nothing of the library runs).
LOAD = """
import sys
from glassgpt.cli.common import notes_for_warnings
from glassgpt.engine import native
native.cpu_flags = lambda: frozenset(native.REQUIRED)
with notes_for_warnings():
    native.load()
print(native.status())
"""


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """The kernels for AVX-512, built once by the real compiler with their record beside them."""
    directory = tmp_path_factory.mktemp("kernels")
    try:
        path = native.build(ISA, directory)
    except OSError as e:
        skip_unless_required(f"glassgpt's kernels cannot be built here: {e}", "GLASSGPT_REQUIRE_KERNELS")
    assert native.check_built(path) is None
    return path


@pytest.fixture
def cache(tmp_path, built) -> dict:
    """A cache root holding a copy of the built library and its record, a stand-in compiler, and the env for both."""
    kernels = tmp_path / "cache" / "glassgpt" / "kernels"
    kernels.mkdir(parents=True)
    for f in (built, built.with_name(built.name + native.RECORD)):
        shutil.copy(f, kernels / f.name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "g++").write_text(FAKE_GXX)
    (bin_dir / "g++").chmod(0o755)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": SRC, "GLASSGPT_TEST_LIBRARY": str(built), "GLASSGPT_TEST_BUILDS": str(tmp_path / "builds.log"),
           "OMP_NUM_THREADS": "1"}
    return {"library": kernels / built.name, "kernels": kernels, "env": env, "log": tmp_path / "builds.log",
            "pristine": built.read_bytes()}


def builds(cache: dict) -> int:
    """How many libraries the stand-in compiler linked."""
    return sum(line.endswith(".so") for line in cache["log"].read_text().splitlines()) if cache["log"].exists() else 0


def run_load(cache: dict, prefix=(), **env) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300,
                          env={**cache["env"], **env})


def notes(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("note:")]


def cut(path: Path, length) -> None:
    data = path.read_bytes()
    n = {"half": len(data) // 2, "size-1": len(data) - 1}.get(length, length)
    path.write_bytes(data[:n])


def read_only(path: Path) -> tuple:
    """A command prefix under which `path` (and what it holds) cannot be written: chmod where the tests are not
    root, else a read-only bind mount of it in the child's own mount namespace."""
    if os.geteuid() != 0:
        for p in [path, *path.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        return ()
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.fail("the tests run as root, where only a mount namespace (unshare -m) makes a folder read-only")
    return ("unshare", "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,ro,bind "$0" && exec "$@"',
            str(path))


# --- the kernel library ------------------------------------------------------------------------------

def test_a_whole_kernel_library_is_loaded_without_a_build_or_a_note(cache):
    done = run_load(cache)
    assert done.returncode == 0 and notes(done.stderr) == [], done.stderr
    assert done.stdout.strip().startswith("built for avx512f") and str(cache["library"]) in done.stdout
    assert builds(cache) == 0


@pytest.mark.parametrize("length", CUTS)
def test_a_kernel_library_cut_short_is_built_again_with_one_note_naming_it(cache, length):
    # Before: 0, 1 and 16 bytes were "file too short" and no kernels in every later process; half of it, SIGBUS
    # (exit 135) in every later process; all but its last byte, loaded as it was.
    cut(cache["library"], length)
    done = run_load(cache)
    assert done.returncode == 0, done.stderr
    [note] = notes(done.stderr)
    assert note.startswith(f"note: {cache['library']} ") and note.endswith(": built it again"), note
    assert "cut short" in note or "no ELF header" in note, note
    assert done.stdout.strip().startswith("built for avx512f"), done.stdout
    assert builds(cache) == 1 and cache["library"].read_bytes() == cache["pristine"]
    assert native.check_built(cache["library"]) is None


@pytest.mark.parametrize("fault, words", [("a byte changed", "does not match the sha256 recorded at its build"),
                                          ("no record", "has no record of its build"),
                                          ("a garbage record", "has a record of its build that cannot be read"),
                                          ("a record of another size", "is {size:,} bytes where its build wrote 12")])
def test_a_kernel_library_that_is_not_what_its_build_recorded_is_built_again(cache, fault, words):
    library, record = cache["library"], cache["library"].with_name(cache["library"].name + native.RECORD)
    if fault == "a byte changed":
        data = bytearray(library.read_bytes())
        data[len(data) // 2] ^= 0xFF
        library.write_bytes(bytes(data))
    elif fault == "no record":
        record.unlink()
    elif fault == "a garbage record":
        record.write_bytes(b"\x00{not json")
    else:
        record.write_text(json.dumps({**json.loads(record.read_text()), "bytes": 12}))
    done = run_load(cache)
    assert done.returncode == 0, done.stderr
    [note] = notes(done.stderr)
    assert note.startswith(f"note: {library} {words.format(size=len(cache['pristine']))}") and note.endswith(": built it again"), note
    assert builds(cache) == 1 and library.read_bytes() == cache["pristine"] and native.check_built(library) is None


def test_a_read_only_kernel_cache_loads_its_whole_library_and_never_a_cut_one(cache):
    prefix = read_only(cache["kernels"].parent)
    done = run_load(cache, prefix)
    assert done.returncode == 0 and notes(done.stderr) == [], done.stderr
    assert done.stdout.strip().startswith("built for avx512f")
    if os.geteuid() != 0:
        cache["library"].chmod(0o644)
    cut(cache["library"], "half")
    done = run_load(cache, prefix)
    assert done.returncode == 0, done.stderr  # (before: SIGBUS)
    [note] = notes(done.stderr)
    assert note.startswith(f"note: glassgpt's CPU kernels are not used: {cache['library']} is cut short"), note
    assert f"the kernel cache {cache['kernels']} cannot be written (" in note and "set XDG_CACHE_HOME" in note, note
    assert "PyTorch's own operators run instead" in done.stdout
    assert builds(cache) == 0 and len(cache["library"].read_bytes()) == len(cache["pristine"]) // 2


def test_a_cache_root_that_is_a_file_runs_without_the_kernels_in_one_note(cache, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    done = run_load(cache, XDG_CACHE_HOME=str(tmp_path / "file"))
    assert done.returncode == 0, done.stderr
    [note] = notes(done.stderr)
    assert note.startswith(f"note: glassgpt's CPU kernels are not used: the kernel cache {tmp_path}/file/glassgpt/"
                           "kernels cannot be written ("), note
    assert builds(cache) == 0


def test_two_processes_that_find_no_library_build_it_once(cache):
    cache["library"].unlink()
    env = {**cache["env"], "GLASSGPT_TEST_COMPILE_SECONDS": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and notes(err) == [] and out.strip().startswith("built for"), err
    assert builds(cache) == 1 and cache["library"].read_bytes() == cache["pristine"]


# `glassgpt` itself on a CPU taken for one with AVX-512: `info` builds the kernels first.
AS_AVX512 = """
import sys
from glassgpt.engine import native
native.cpu_flags = lambda: frozenset(native.REQUIRED)
from glassgpt.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_a_build_stopped_by_a_signal_leaves_no_library_and_the_next_process_builds_it(cache, sig, code):
    cache["library"].unlink()
    env = {**cache["env"], "GLASSGPT_TEST_COMPILE_SECONDS": "60"}
    proc = subprocess.Popen([sys.executable, "-c", AS_AVX512, "info", "--model", "gpt2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # until the stand-in compiler runs (its log is written first)
            if cache["log"].exists() and cache["log"].read_text():
                break
            time.sleep(0.1)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, (proc.returncode, err)
    if sig == signal.SIGINT:  # the compilers stopped, their folder removed, and one line
        assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err
        assert not list(cache["kernels"].glob("build-*"))
    assert not cache["library"].exists()  # nothing half-written under the library's name
    done = run_load(cache, GLASSGPT_TEST_COMPILE_SECONDS="0")
    assert done.returncode == 0 and notes(done.stderr) == [] and done.stdout.startswith("built for"), done.stderr
    assert cache["library"].read_bytes() == cache["pristine"] and not list(cache["kernels"].glob("build-*"))


@pytest.mark.parametrize("length", CUTS)
def test_generate_after_its_kernel_library_is_cut_short_builds_it_again_and_generates(tmp_path, length):
    """On a CPU that runs the kernels: the command itself, after each cut, with the user's library as the session's."""
    needs_kernels()
    library = native.library_path(native.isa_flags(native.cpu_flags()), native.cache_dir() / "kernels")
    assert native.check_built(library) is None
    model = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(vocab_size=50257, context_length=32, emb_dim=32,
                                                                  n_heads=2, n_layers=1), seed=0)
    ckpt = glassgpt.save_model(model, tmp_path / "ckpt", tokenizer=glassgpt.get_tokenizer("gpt2"))
    kernels = tmp_path / "cache" / "glassgpt" / "kernels"
    kernels.mkdir(parents=True)
    for f in (library, library.with_name(library.name + native.RECORD)):
        shutil.copy(f, kernels / f.name)
    cut(kernels / library.name, length)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "g++").write_text(FAKE_GXX)
    (bin_dir / "g++").chmod(0o755)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": SRC,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GLASSGPT_TEST_LIBRARY": str(library),
           "GLASSGPT_TEST_BUILDS": str(tmp_path / "builds.log")}
    done = subprocess.run([sys.executable, "-m", "glassgpt", "generate", "Every effort", "--model", str(ckpt),
                           "--max-new-tokens", "3", "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    [note] = [n for n in notes(done.stderr) if str(kernels) in n]
    assert note.startswith(f"note: {kernels / library.name} ") and note.endswith(": built it again"), note
    assert len(json.loads(done.stdout)["new_ids"]) == 3
    assert (kernels / library.name).read_bytes() == library.read_bytes()


def test_the_cache_root_ignores_a_relative_xdg_cache_home_and_finds_home_without_home(monkeypatch):
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    for value in (None, "", "relative/home"):  # (an empty HOME once put the cache under the working folder)
        if value is None:
            monkeypatch.delenv("HOME", raising=False)
        else:
            monkeypatch.setenv("HOME", value)
        assert native.cache_dir() == home / ".cache" / "glassgpt"
    monkeypatch.setenv("HOME", "/elsewhere")
    assert native.cache_dir() == Path("/elsewhere/.cache/glassgpt")
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/absolute")
    assert native.cache_dir() == Path("/somewhere/absolute/glassgpt")


# --- the autotune cache -----------------------------------------------------------------------------

TINY = glassgpt.GPTConfig(vocab_size=96, context_length=16, emb_dim=32, n_heads=2, n_layers=1)


def choose_fresh(path: Path) -> tuple[autotune.Choices, list[str]]:
    """autotune.choose in a state as a new process's (nothing remembered, nothing noted); its CacheWarnings."""
    autotune._memo.clear()
    autotune._noted.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choices = autotune.choose(TINY, "float32", cache=path)
    return choices, [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


def corrupt(path: Path, fault) -> None:
    data = path.read_bytes()
    entries = json.loads(data)
    [key] = entries
    if fault in CUTS:
        cut(path, fault)
    elif fault == "bytes that are not UTF-8":
        path.write_bytes(b"\xff\xfe\x00garbage")
    elif fault == "a JSON list":
        path.write_text("[1, 2, 3]")
    elif fault == "an entry that is a number":
        path.write_text(json.dumps({key: 5}))
    elif fault == "a winner that is no candidate":
        entries[key]["winners"]["attention decode"] = "rm -rf /"
        path.write_text(json.dumps(entries))
    elif fault == "a time that is a string":
        entries[key]["ms"]["attention decode"] = {"sdpa": "fast", "blocks": 1.0}
        path.write_text(json.dumps(entries))
    elif fault == "a time that is NaN":
        entries[key]["ms"]["attention prompt"] = {"sdpa": float("nan"), "blocks": 1.0}
        path.write_text(json.dumps(entries))
    elif fault == "more than a cache holds":
        path.write_bytes(data + b" " * autotune.MAX_CACHE_BYTES)


@pytest.mark.parametrize("fault", [*CUTS, "bytes that are not UTF-8", "a JSON list", "an entry that is a number",
                                   "a winner that is no candidate", "a time that is a string", "a time that is NaN",
                                   "more than a cache holds"])
def test_an_autotune_cache_that_is_not_what_glassgpt_wrote_is_measured_again_with_one_note(tmp_path, fault):
    path = tmp_path / "autotune.json"
    first, noted = choose_fresh(path)
    assert noted == [] and not first.cached
    corrupt(path, fault)
    again, noted = choose_fresh(path)
    assert len(noted) == 1 and noted[0].startswith(f"{path} ") and noted[0].endswith("measuring again what it held"), noted
    assert not again.cached and set(again.winners) == set(first.winners)  # measured again, every decision
    entries = json.loads(path.read_text())  # and written whole again
    assert list(entries) == [again.key] and autotune._entry_problem(entries[again.key]) is None
    assert choose_fresh(path)[0].cached  # which the next process reads without a note


def tiny_checkpoint(tmp_path: Path) -> Path:
    model = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(vocab_size=50257, context_length=32, emb_dim=32,
                                                                  n_heads=2, n_layers=1), seed=0)
    return glassgpt.save_model(model, tmp_path / "ckpt", tokenizer=glassgpt.get_tokenizer("gpt2"))


def generate(ckpt: Path, cache_root: Path, prefix=()) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_root), "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*prefix, sys.executable, "-m", "glassgpt", "generate", "Every effort", "--model", str(ckpt),
                           "--max-new-tokens", "3", "--json", "--seed", "0"], capture_output=True, text=True, env=env,
                          timeout=300)


def test_generate_with_its_autotune_cache_cut_short_measures_again_and_generates_the_same(tmp_path):
    ckpt, root = tiny_checkpoint(tmp_path), tmp_path / "cache"
    first = generate(ckpt, root)
    assert first.returncode == 0, first.stderr
    path = root / "glassgpt" / "autotune.json"
    whole = path.read_bytes()
    for length in CUTS:
        path.write_bytes(whole)
        cut(path, length)
        done = generate(ckpt, root)
        assert done.returncode == 0, (length, done.stderr)
        [note] = [n for n in notes(done.stderr) if "autotune" in n]
        assert note == f"note: {path} is not JSON (cut short?): measuring again what it held", (length, note)
        assert json.loads(done.stdout)["new_ids"] == json.loads(first.stdout)["new_ids"], length
        assert json.loads(path.read_text())  # written whole again


def test_generate_with_a_read_only_cache_generates_and_says_the_timings_are_not_kept(tmp_path):
    ckpt, root = tiny_checkpoint(tmp_path), tmp_path / "cache"
    (root / "glassgpt").mkdir(parents=True)
    done = generate(ckpt, root, read_only(root))
    assert done.returncode == 0, done.stderr
    [note] = [n for n in notes(done.stderr) if "autotune" in n]
    assert note.startswith(f"note: {root}/glassgpt/autotune.json cannot be written (") and \
        note.endswith("each process measures the kernels again; set XDG_CACHE_HOME to a folder that can be"), note
    assert len(json.loads(done.stdout)["new_ids"]) == 3 and not (root / "glassgpt" / "autotune.json").exists()


def test_generate_with_a_file_for_its_cache_root_generates_with_one_note(tmp_path):
    ckpt = tiny_checkpoint(tmp_path)
    (tmp_path / "file").write_text("not a folder")
    done = generate(ckpt, tmp_path / "file")
    assert done.returncode == 0, done.stderr
    [note] = [n for n in notes(done.stderr) if "autotune" in n]  # (before: one for reading, one for writing)
    assert note.startswith(f"note: {tmp_path}/file/glassgpt/autotune.json cannot be written (Not a directory)"), note
    assert len(json.loads(done.stdout)["new_ids"]) == 3
