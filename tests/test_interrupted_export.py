"""An export killed mid-write (kill -9) leaves nothing under the name it was writing; the next export
cleans what it left, and `--model` on what it left says what that is.

The kill is real: a child process runs `glassgpt export` and is sent SIGKILL at its first fsync, when
the weights are written to a temporary name and not yet renamed into place.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt.config import GPTConfig
from glassgpt.formats import export_hf, random_model, save_model
from glassgpt.formats.files import clean_leftovers, leftover_of

from helpers import assert_one_line_error, run

CFG = GPTConfig(vocab_size=50257, context_length=16, emb_dim=32, n_heads=2, n_layers=1)
SRC = Path(__file__).resolve().parents[1] / "src"
OUT_NAMES = {"hf": "out", "gguf": "model.gguf", "pth": "model.pth"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return save_model(random_model(CFG, torch.device("cpu"), torch.float32, seed=0),
                      tmp_path_factory.mktemp("export") / "ckpt")


def killed_export(ckpt: Path, fmt: str, out: Path) -> None:
    """`glassgpt export CKPT --format FMT --out OUT` in a child process, killed with SIGKILL at its first fsync."""
    script = textwrap.dedent(f"""
        import os, signal
        import glassgpt.cli
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        glassgpt.cli.main(["export", {str(ckpt)!r}, "--format", {fmt!r}, "--out", {str(out)!r}])
    """)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]


@pytest.mark.parametrize("fmt", ["hf", "gguf", "pth"])
def test_a_killed_export_leaves_no_half_model_and_the_rerun_cleans_up(ckpt, tmp_path, capsys, fmt):
    out = tmp_path / OUT_NAMES[fmt]
    killed_export(ckpt, fmt, out)
    assert not out.exists()  # nothing under the real name: not a half model a reader could load
    left = [p for p in tmp_path.iterdir() if leftover_of(p) is not None]
    assert len(left) == 1 and leftover_of(left[0])[0] == out.name

    code, _, err = run(["generate", "hi", "--model", str(left[0])], capsys)
    assert_one_line_error(code, err, "a temporary", f"a write of {out.name} left when it was interrupted",
                          "run that export again")
    if fmt == "hf":  # a directory: the name alone is "no model", and says what is beside it
        code, _, err = run(["generate", "hi", "--model", str(out)], capsys)
        assert_one_line_error(code, err, f"beside it is only {left[0].name}", "interrupted", "run that export again")

    code, stdout, _ = run(["export", str(ckpt), "--format", fmt, "--out", str(out)], capsys)  # no --force needed
    assert code == 0
    assert f"note: removed what an interrupted export left: {left[0]}" in stdout
    assert not left[0].exists() and [p for p in tmp_path.iterdir() if leftover_of(p) is not None] == []
    if fmt != "pth":
        code, _, _ = run(["generate", "hi", "--model", str(out), "--max-new-tokens", "2"], capsys)
        assert code == 0


def test_an_hf_directory_that_holds_only_an_old_exports_temporary_files_is_named_and_replaced(ckpt, tmp_path, capsys):
    """What an export killed before exports were whole left: OUT/ holding only hidden temporary files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".model.safetensors.k2j3h4a9.tmp").write_bytes(b"\0" * 100)
    code, _, err = run(["generate", "hi", "--model", str(out)], capsys)
    assert_one_line_error(code, err, "holds no config.json, only .model.safetensors.k2j3h4a9.tmp",
                          "interrupted", "run the export again")
    code, _, _ = run(["export", str(ckpt), "--format", "hf", "--out", str(out)], capsys)
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_a_write_under_way_in_a_live_process_is_not_cleaned(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = tmp_path / f".model.gguf.{live.pid}.abcd1234.tmp"
        dead = tmp_path / ".model.gguf.abcd1234.tmp"  # no process id: an older glassgpt's, whose process is gone
        theirs.write_bytes(b"x")
        dead.write_bytes(b"x")
        assert clean_leftovers(tmp_path / "model.gguf") == [dead]
        assert theirs.exists()
        assert clean_leftovers(tmp_path / "model") == []  # another name's temporary files are not its own
    finally:
        live.kill()
        live.wait()


def test_export_hf_into_an_existing_directory_keeps_its_other_files(tmp_path):
    model = random_model(CFG, torch.device("cpu"), torch.float32, seed=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    export_hf(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert torch.equal(glassgpt.load_model(str(out)).tok_emb.weight, model.tok_emb.weight)


def test_an_export_that_fails_mid_write_leaves_nothing(tmp_path, monkeypatch):
    import glassgpt.formats.hf as hf

    def fail(state, path, metadata=None):
        Path(path).write_bytes(b"\0" * 10)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf, "save_file", fail)
    with pytest.raises(OSError):
        export_hf(random_model(CFG, torch.device("cpu"), torch.float32, seed=0), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
