"""Faults that need a real process: a file-size limit, a read-only disk, two processes on one
run directory, signals. Each ends in one line and a non-zero exit (no traceback), and leaves
every complete checkpoint usable. Tiny char-level models, a few steps each."""

from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glassgpt.formats.glassgpt import verify_checkpoint
from glassgpt.cli import main

WORDS = "the quick brown fox jumps over lazy dog and cat sat on mat".split()
TINY = ["--tokenizer", "char", "--n-layers", "2", "--n-heads", "2", "--emb-dim", "32", "--context-length", "16",
        "--batch-size", "4", "--lr", "3e-3", "--warmup-steps", "2", "--eval-batches", "2", "--no-progress",
        "--no-plot"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300)) + "\n")
    return path


@pytest.fixture
def saved_run(tmp_path, corpus) -> Path:
    """A run stopped at step 4 with latest/ and best/, meant to go to 8."""
    run = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--out", str(run), *TINY, "--max-steps", "4",
                 "--eval-every", "4"]) == 0
    return run


def glassgpt(*args: str, preexec=None, prefix=(), **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "glassgpt", *args], capture_output=True, text=True,
                          env=ENV, timeout=240, preexec_fn=preexec, **kwargs)


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "glassgpt", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def one_line_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith(("note:", "threads:"))]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} did not happen: {proc.communicate()[1][-2000:]}")
        time.sleep(0.005)


def metrics_lines(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


# --- disks that refuse a write -----------------------------------------------------------------

def test_a_file_size_limit_during_a_checkpoint_write_is_one_line_and_keeps_the_previous(saved_run):
    limit = (saved_run / "latest" / "model.safetensors").stat().st_size // 2

    def small_files():  # SIGXFSZ is left at its default: glassgpt itself must ignore it to see EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = glassgpt("train", "--resume", str(saved_run), "--max-steps", "8", "--no-progress", preexec=small_files)
    assert proc.returncode == 2, proc.stderr
    line = one_line_error(proc.stderr)
    assert f"could not write the checkpoint {saved_run}/latest (" in line and "File too large" in line
    assert "the previous latest/ (step 4) is unchanged" in line
    assert verify_checkpoint(saved_run / "latest")["step"] == 4 and verify_checkpoint(saved_run / "best")["step"] == 4
    assert not list(saved_run.glob(".*.tmp-*"))  # no half-written checkpoint left behind
    assert main(["train", "--resume", str(saved_run), "--max-steps", "8", "--no-progress"]) == 0  # and it goes on


def read_only(path: Path):
    """(command prefix, preexec, how) that make `path` read-only for a child process.

    Not root: chmod. Root (whom chmod does not stop): a read-only tmpfs mounted over `path` in
    the child's own mount namespace (unshare -m), where the kernel allows it; else a file-size
    limit of 0, which refuses every write as a full disk would.
    """
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        return (), None, "chmod 555"
    if shutil.which("unshare") and subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0:
        return ("unshare", "-m", "sh", "-c", 'mount -t tmpfs -o ro,size=1m tmpfs "$0" && exec "$@"', str(path)), \
            None, "read-only tmpfs"
    return (), lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)), "RLIMIT_FSIZE=0"


def test_out_on_a_read_only_disk_is_one_line(tmp_path, corpus):
    prefix, preexec, how = read_only(tmp_path / "ro")
    proc = glassgpt("train", "--data", str(corpus), "--out", str(tmp_path / "ro" / "run"), *TINY,
                    "--max-steps", "2", prefix=prefix, preexec=preexec)
    assert proc.returncode == 2, (how, proc.stderr)
    line = one_line_error(proc.stderr)
    assert line.startswith(f"error: cannot write to {tmp_path}/ro/run (") and "writable disk" in line, (how, line)


# --- one process per run directory ----------------------------------------------------------------

def test_a_second_process_on_a_run_directory_is_refused_naming_the_holder(saved_run, corpus, tmp_path):
    holder = start("train", "--resume", str(saved_run), "--max-steps", "100000", "--eval-every", "100000",
                   "--no-progress")
    try:
        wait_for(lambda: metrics_lines(saved_run) >= 6, holder, "training")
        refused = glassgpt("train", "--resume", str(saved_run), "--max-steps", "100000", "--no-progress")
        assert refused.returncode == 2
        line = one_line_error(refused.stderr)
        assert (f"{saved_run} is in use by another glassgpt process (pid {holder.pid} on {socket.gethostname()}, "
                "since ") in line
        # A new run and a finetuning run on the same directory are refused the same way.
        assert main(["train", "--data", str(corpus), "--out", str(saved_run), *TINY]) == 2
        assert main(["finetune", "classify", "--model", str(saved_run), "--data", str(corpus),
                     "--out", str(saved_run)]) == 2
        steps = metrics_lines(saved_run)
        time.sleep(0.2)
        assert metrics_lines(saved_run) > steps  # the holder trains on, alone
    finally:
        holder.kill()  # SIGKILL: no handler runs, the OS drops the lock
        holder.wait()
    assert main(["train", "--resume", str(saved_run), "--max-steps", "10", "--no-progress"]) == 0


def test_a_refused_run_leaves_its_directory_as_it_found_it(tmp_path, corpus, capsys):
    """The issue's two cases: a new directory is not created, an empty one gets no .lock."""
    import torch
    from glassgpt import GPTModel, get_config
    pth = tmp_path / "model.pth"
    torch.save(GPTModel(get_config("gpt2-book", n_layers=1, emb_dim=64, n_heads=1, context_length=32)).state_dict(), pth)
    new = tmp_path / "new"
    assert main(["train", "--init", str(pth), "--context-length", "1024", "--data", str(corpus), "--out", str(new),
                 "--no-progress"]) == 2
    assert "--context-length 1024 is longer" in capsys.readouterr().err and not new.exists()
    data = tmp_path / "d.csv"
    data.write_text("text,label\na fine day,pos\nwhat,\nbad day,neg\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["finetune", "classify", "--model", str(pth), "--data", str(data), "--out", str(empty),
                 "--no-progress"]) == 2
    assert f"{data}:3 has no usable label" in capsys.readouterr().err and list(empty.iterdir()) == []


# --- signals -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_training_saves_latest_and_exits_with_128_plus_the_signal(tmp_path, corpus, sig, code):
    run = tmp_path / "run"
    proc = start("train", "--data", str(corpus), "--out", str(run), *TINY, "--max-steps", "100000",
                 "--eval-every", "100000")
    wait_for(lambda: metrics_lines(run) >= 3, proc, "training")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    step = verify_checkpoint(run / "latest")["step"]
    assert err.strip().splitlines()[-1] == (f"interrupted at step {step:,}: saved {run}/latest; continue with: "
                                            f"glassgpt train --resume {run}")
    assert "Traceback" not in err


def test_sigterm_while_tokenizing_leaves_no_temporary_file_and_exits_143(tmp_path):
    rng = random.Random(0)
    line = " ".join(rng.choice(WORDS) for _ in range(2000)) + "\n"
    data = tmp_path / "big.txt"
    data.write_text(line * 1000)  # 9 MB: about 2 s of GPT-2 tokenizing, time to be caught at it
    run = tmp_path / "run"
    proc = start("train", "--data", str(data), "--out", str(run), "--n-layers", "1", "--n-heads", "2",
                 "--emb-dim", "16", "--context-length", "16", "--no-progress")
    temporary = lambda: list((run / "cache").glob(".tokens-*.tmp")) if (run / "cache").is_dir() else []  # noqa: E731
    wait_for(lambda: bool(temporary()), proc, "tokenizing")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "terminated (SIGTERM)" and "Traceback" not in err
    assert temporary() == [] and not list((run / "cache").glob("tokens-*"))


def test_generate_with_stderr_closed_keeps_its_json_whole(tmp_path):
    """`2>&-`: Python's sys.stderr is None, and print(file=None) writes to stdout; the notes must not land in the JSON."""
    import json
    import glassgpt
    model = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(vocab_size=50257, context_length=32, emb_dim=32,
                                                                  n_heads=2, n_layers=1), seed=0)
    ckpt = glassgpt.save_model(model, tmp_path / "ckpt", tokenizer=glassgpt.get_tokenizer("gpt2"))
    done = subprocess.run([sys.executable, "-m", "glassgpt", "generate", "Every effort", "--model", str(ckpt),
                           "--max-new-tokens", "3", "--json"], stdout=subprocess.PIPE, preexec_fn=lambda: os.close(2),
                          env={**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}, timeout=240, text=True)
    assert done.returncode == 0
    assert len(json.loads(done.stdout)["new_ids"]) == 3, done.stdout[:300]
