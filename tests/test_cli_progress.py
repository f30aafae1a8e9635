"""Long work says how it goes when its output is not a terminal too: a line at least every 10 s of
work, with its rate and an estimate of what is left (training, finetune's responses, explain's passes,
generate); generate says up front how long a long generation will take and ends with its tokens/s;
a resumed run keeps its thread count, or says that it changed and what that does to exactness.
The clock of cli/progress.py is faked, so no test waits."""

from __future__ import annotations

import json

import pytest

from glassgpt.cli import progress
from glassgpt.formats import load_meta

from helpers import SMALL, run


class FakeTime:
    """progress.time whose monotonic() moves `step` seconds at each reading."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def monotonic(self) -> float:
        self.now += self.step
        return self.now


@pytest.fixture
def clock(monkeypatch):
    def install(step: float) -> FakeTime:
        fake = FakeTime(step)
        monkeypatch.setattr(progress, "time", fake)
        return fake
    return install


def test_a_heartbeat_says_the_work_done_its_rate_and_what_is_left_every_10_s(clock, capsys):
    clock(3.0)  # each call is 3 s of work
    beat = progress.Heartbeat("generate", "token", total=100)
    for done in range(1, 21):
        beat(done)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 5  # after 12, 24, 36, 48 and 60 s of work: never more than 10 s without a line
    assert lines[0] == "generate: 4/100 tokens, 0.3 tokens/s, eta 4m48s"  # 96 tokens left at 1/3 token/s


def test_a_step_bar_off_a_terminal_prints_progress_lines_instead(clock, capsys):
    clock(4.0)
    with progress.StepBar("responses", unit="record") as bar:  # capsys: stderr is not a terminal
        for k in range(1, 11):
            bar(f"record {k}", k, 10)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("responses: ") and " records, " in line for line in lines)
    assert "eta" in lines[0]


def test_training_progress_off_a_terminal_is_a_line_at_least_every_10_s(clock, capsys):
    clock(5.5)  # each step's record is read 5.5 s after the one before
    printer = progress.Printer(progress=True)
    printer({"event": "start", "step": 0, "max_steps": 1000})
    for step in range(1, 7):
        printer({"event": "step", "step": step, "train_loss": 5.0, "lr": 1e-3, "tokens_per_s": 100.0})
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[2] for line in lines] == ["2/1,000", "4/1,000", "6/1,000"]  # not every 100th step
    assert all("eta" in line for line in lines)


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


def test_generate_ends_with_its_tokens_per_second_on_stderr(small, capsys):
    code, out, err = run(["generate", "Hi", "--model", small, "--max-new-tokens", "5", "--json"], capsys)
    assert code == 0
    assert len(json.loads(out)["new_ids"]) == 5
    assert err.splitlines()[-1].startswith("generated 5 tokens in ") and "tokens/s" in err.splitlines()[-1]


def test_a_long_generation_says_up_front_how_long_and_reports_while_it_runs(small, capsys, clock):
    clock(0.5)  # each token read 0.5 s after the one before
    code, out, err = run(["generate", "Hi", "--model", small, "--max-new-tokens", "1000", "--json"], capsys)
    assert code == 0
    lines = err.splitlines()
    estimate = next(i for i, line in enumerate(lines) if "1,000 new tokens will take about" in line)
    assert "past context_length 16" in lines[estimate]
    beats = [i for i, line in enumerate(lines) if line.startswith("generate: ")]
    assert len(beats) >= 40 and estimate < beats[0]  # (500 s of faked work, a line every 10 s)
    assert "/1,000 tokens" in lines[beats[0]] and "eta" in lines[beats[0]]


def _train(tmp_path, capsys, *flags):
    data = tmp_path / "data.txt"
    data.write_text("a few words of text to train on. " * 200)
    return run(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--n-layers", "1", "--emb-dim", "16",
                "--n-heads", "2", "--context-length", "16", "--sample-tokens", "0", "--no-plot", *flags], capsys)


def test_a_resumed_run_keeps_its_thread_count_or_says_what_changing_it_does(tmp_path, capsys):
    code, out, err = _train(tmp_path, capsys, "--max-steps", "1", "--threads", "2")
    assert code == 0, err
    assert load_meta(tmp_path / "run" / "latest")["threads"] == 2  # recorded in the run directory
    code, out, err = run(["train", "--resume", str(tmp_path / "run"), "--max-steps", "2"], capsys)
    assert code == 0, err
    assert "threads: 2 (the run's own, kept on resume" in out and "last bits" not in err
    code, out, err = run(["train", "--resume", str(tmp_path / "run"), "--max-steps", "3", "--threads", "1"], capsys)
    assert code == 0, err
    assert "the run trained with 2 threads and resumes with 1" in err and "last bits" in err
    assert load_meta(tmp_path / "run" / "latest")["threads"] == 1
