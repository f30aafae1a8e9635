"""The package installs whole: a wheel built from this tree runs glassgpt's native kernels.

The wheel is built from a copy of the tree (`pip wheel --no-deps --no-build-isolation`) and
installed into a fresh virtual environment that sees this environment's packages (torch and
the rest) through a .pth file, so nothing is downloaded. There, with the working directory
outside the repository and no PYTHONPATH, the installed glassgpt builds its kernels from the
files the wheel carries, into an empty cache, and decodes with the native step. On a machine
without g++ the same install prints the one note that says so and generates on PyTorch's
operators, never a traceback. And the tests that need the kernels cannot pass for nothing:
where the kernels cannot be had they skip, or fail under GLASSGPT_REQUIRE_KERNELS=1 (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap
import warnings
import zipfile
from pathlib import Path

import pytest

from glassgpt.device import cpu_flags
from glassgpt.engine import native

from conftest import needs_kernels

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "glassgpt"

# Run inside the fresh environment: the installed package's native step, forced on, against the glass model.
NATIVE_STEP = textwrap.dedent("""
    import dataclasses, json, sys
    import torch
    import glassgpt
    from glassgpt.engine import Engine, native
    from glassgpt.generate import generate

    cfg = glassgpt.GPTConfig(vocab_size=97, context_length=24, emb_dim=64, n_heads=4, n_layers=2)
    model = glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=0, config=cfg).eval()
    engine = Engine(model)
    engine.choices = dataclasses.replace(engine.choices, winners={**engine.choices.winners, "step": "native"}, path=None)
    prompt = torch.tensor([[5, 17, 42, 3, 60, 0]])
    ours = generate(engine, prompt, 20)
    print(json.dumps({"glassgpt": glassgpt.__file__, "sources": str(native.SOURCES), "status": native.status(),
                      "stepped": engine.step is not None,
                      "same": ours.tolist() == generate(model, prompt, 20, use_cache=False).tolist()}))
""")


def clean_env() -> dict[str, str]:
    """This process's environment without PYTHONPATH: a source tree on it would count as installed."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def run_in(venv: Path, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`args` in the fresh environment: no PYTHONPATH, its own bin/ first on PATH, `env` on top."""
    environ = clean_env()
    environ.update({"PATH": f"{venv / 'bin'}{os.pathsep}{environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv), **env})
    return subprocess.run(args, cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree (so the build writes nothing into the repository)."""
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    shutil.copytree(PACKAGE, tree / "src" / "glassgpt", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(work / "dist")], env=clean_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (work / "dist").glob("glassgpt-*.whl")
    return path


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed, seeing this environment's packages."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=clean_env(), check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "-q", str(wheel)], env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # After the install: this environment's packages, behind the venv's own site-packages.
    theirs = run_in(venv, [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], venv)
    ours = dict.fromkeys([*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    Path(theirs.stdout.strip(), "outer-environment.pth").write_text("\n".join(ours) + "\n")
    return venv


def test_the_wheel_carries_every_file_of_the_package_and_the_license(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {f"glassgpt/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert tree - names == set()  # the kernels' header gemv.h among them: gemv.cpp and step.cpp include it
    assert "glassgpt/engine/kernels/gemv.h" in names
    (license,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(wheel).read(license).decode()


def test_the_installed_package_builds_its_kernels_and_decodes_with_the_native_step(installed, tmp_path):
    needs_kernels()  # this machine can build them at all (else skip, or fail where they are required)
    done = run_in(installed, [str(installed / "bin" / "python"), "-c", NATIVE_STEP], tmp_path,
                  XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["glassgpt"]).is_relative_to(installed)  # the installed copy, not the source tree
    assert Path(result["sources"]).is_relative_to(installed)
    assert result["status"].startswith("built for") and str(tmp_path / "cache") in result["status"], result["status"]
    assert result["stepped"] and result["same"]
    assert "kernels are not used" not in done.stderr


def test_the_installed_package_without_a_compiler_says_so_in_one_note_and_generates(installed, tmp_path):
    python = installed / "bin" / "python"
    save = ("import glassgpt; cfg = glassgpt.GPTConfig(vocab_size=50257, context_length=32, emb_dim=32, n_heads=2, "
            "n_layers=1); glassgpt.save_model(glassgpt.load_model('gpt2', config=cfg, seed=0), 'ckpt')")
    assert run_in(installed, [str(python), "-W", "ignore", "-c", save], tmp_path).returncode == 0
    # PATH holds the environment's bin/ and nothing else: no g++, no c++.
    done = run_in(installed, [str(installed / "bin" / "glassgpt"), "generate", "Every effort", "--model", "ckpt",
                              "--dtype", "int8", "--max-new-tokens", "2"], tmp_path,
                  PATH=str(installed / "bin"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    notes = [line for line in done.stderr.splitlines() if "kernels are not used" in line]
    assert len(notes) == 1 and notes[0].startswith("note: glassgpt's CPU kernels are not used: "), done.stderr
    if native.isa_flags(cpu_flags()) is not None:  # a CPU the kernels are written for: the compiler is what lacks
        assert "no C++ compiler (g++) found" in notes[0]


def test_a_kernel_test_skips_where_kernels_cannot_be_had_and_fails_where_they_are_required(monkeypatch):
    monkeypatch.setattr(native, "_load", lambda flags, directory: None)
    monkeypatch.setattr(native, "_status", "no C++ compiler (g++) found: install one, e.g. apt-get install g++")
    native._load_once.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            monkeypatch.delenv("GLASSGPT_REQUIRE_KERNELS", raising=False)
            with pytest.raises(pytest.skip.Exception, match="kernels are not available here: no C\\+\\+ compiler"):
                needs_kernels()
            monkeypatch.setenv("GLASSGPT_REQUIRE_KERNELS", "1")
            with pytest.raises(pytest.fail.Exception, match="GLASSGPT_REQUIRE_KERNELS=1 but .*no C\\+\\+ compiler"):
                needs_kernels()
    finally:
        native._load_once.cache_clear()
