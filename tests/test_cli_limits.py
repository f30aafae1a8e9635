"""Every number flag of every command at its limits: 0, -1, huge, nan and inf are each a one-line
error naming the flag (exit code 2) or a value the command takes, and then it is listed below with
the reason. The flags are found from the argparse parser itself, so a new flag is covered as soon
as it exists; one made with a bare `type=int` or `type=float` fails `test_every_number_flag_...`.
Sizes that only the model and the machine can bound are refused before anything is allocated,
against a faked amount of available memory (the reader, memory.available_memory, is monkeypatched).
"""

from __future__ import annotations

import argparse
import json

import pytest

from glassgpt import memory
from glassgpt.cli import build_parser, main, parse

from helpers import SMALL, assert_one_line_error, run

GiB = 2**30
HUGE = {int: str(2**64), float: "1e300"}
LIMITS = ("0", "-1", "huge", "nan", "inf")

# (flag, value) -> why the command takes it (all commands with the flag, unless ONLY names some).
# Everything not listed must be refused.
ONLY = {("--temperature", "0"): {"generate", "chat"}}
TAKEN = {
    ("--seed", "0"): "0 is a seed like any other in [0, 2**64)",
    ("--max-new-tokens", "0"): "generate and chat give the prompt back: nothing new is asked for",
    ("--temperature", "0"): "generate and chat: 0 is greedy, the most likely token",
    ("--port", "0"): "serve: the system picks a free port, and the page's address says which",
    ("--warmup-steps", "0"): "no warm-up: the learning rate starts at its peak",
    ("--sample-tokens", "0"): "no sample at the evaluations",
    ("--block", "0"): "explain: the first of the trf_blocks",
    ("--layer", "0"): "explain: the first block's attention",
    ("--grad-clip", "0"): "0 turns clipping off",
    ("--grad-clip", "huge"): "a norm no gradient reaches: no clipping, as 0",
    ("--weight-decay", "0"): "AdamW without decay",
    ("--min-lr", "0"): "the cosine ends at 0",
    ("--beta1", "0"): "AdamW without momentum",
    ("--beta2", "0"): "AdamW with the last squared gradient only",
    ("--val-fraction", "0"): "no validation split",
    ("--drop-rate", "0"): "no dropout",
}
# Taken by the parser, and refused by the command once it sees the others flags: (flag, value) -> words.
REFUSED_WHEN_RUN = {
    ("--weight-decay", "huge"): ["weight_decay", "lr", "below 1"],
    ("--min-lr", "huge"): ["min_lr", "above lr"],
    ("--lr", "huge"): ["diverged", "Lower --lr"],  # the loop's own check, at the first step
}


PARSER = build_parser()  # built once: every case below parses through it (main() as well, by the fixture)


@pytest.fixture(autouse=True)
def one_parser(monkeypatch):
    monkeypatch.setattr("glassgpt.cli.build_parser", lambda command=None: PARSER)


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of every (sub)command: ("generate",), ("finetune", "classify"), ..."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, sub in action.choices.items():
            yield from _commands(sub, path + (name,))


def _required_args(parser: argparse.ArgumentParser) -> list[str]:
    """Placeholders for a command's required arguments, so that only the flag under test can fail."""
    argv = []
    for a in parser._actions:
        value = a.choices[0] if a.choices else "1" if getattr(a.type, "kind", None) else "x"
        if not a.option_strings and a.nargs not in ("?", "*", argparse.REMAINDER):
            argv.append(str(value))
        elif a.option_strings and a.required:
            argv += [a.option_strings[0], str(value)]
    return argv


def number_flags():
    for path, parser in _commands(PARSER):
        for action in parser._actions:
            kind = getattr(action.type, "kind", None)
            if kind in (int, float) and action.option_strings:
                yield path, parser, action, kind


CASES = [(path, action.option_strings[0], kind, limit)
         for path, _, action, kind in number_flags() for limit in LIMITS]


def test_every_number_flag_parses_through_the_limits_layer():
    """No flag takes a bare int or float (which lets nan, inf and 2**64 through)."""
    bare = [(" ".join(path), a.option_strings[0]) for path, parser in _commands(PARSER)
            for a in parser._actions if a.type in (int, float)]
    assert bare == []
    flags = {(p[0], a.option_strings[0]) for p, _, a, _ in number_flags()}
    # Spot checks that discovery reaches every kind of declaration: common.py, TrainConfig, options.py, serve.
    assert {("generate", "--seed"), ("train", "--eval-batches"), ("explain", "--temperature"),
            ("serve", "--port"), ("finetune", "--lora-alpha"), ("tokenizer", "--vocab-size")} <= flags


@pytest.mark.parametrize("path, flag, kind, limit", CASES,
                         ids=[f"{' '.join(p)} {f} {v}" for p, f, _, v in CASES])
def test_a_number_flag_at_its_limits_is_refused_in_one_line_or_taken_for_a_stated_reason(
        path, flag, kind, limit, capsys):
    value = HUGE[kind] if limit == "huge" else limit
    parser = dict(_commands(PARSER))[path]
    argv = [*path, *_required_args(parser), flag, value]
    taken = (flag, limit) in TAKEN and path[0] in ONLY.get((flag, limit), {path[0]})
    if taken or (flag, limit) in REFUSED_WHEN_RUN:
        args = parse(PARSER, argv)
        dest = next(a.dest for a in parser._actions if flag in a.option_strings)
        assert getattr(args, dest) == kind(value)
        return
    code, out, err = run(argv, capsys)
    assert_one_line_error(code, err, flag)
    assert out == ""


@pytest.mark.parametrize("flag, limit", sorted(REFUSED_WHEN_RUN))
def test_a_value_the_parser_takes_is_refused_by_the_command_in_one_line(flag, limit, tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("a few words of text to train on. " * 200)
    value = HUGE[float] if limit == "huge" else limit
    code, _, err = run(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--n-layers", "1",
                        "--emb-dim", "16", "--n-heads", "2", "--context-length", "16", "--max-steps", "1",
                        flag, value], capsys)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and "Traceback" not in err
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err  # after notes, one error line
    assert all(word in errors[0] for word in REFUSED_WHEN_RUN[flag, limit]), errors[0]
    assert not (tmp_path / "run" / "latest").exists()


# --- seeds: [0, 2**64) on every command ----------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "explain", "serve", "chat", "classify", "diff", "check", "train",
                                     "eval"])
@pytest.mark.parametrize("value", [str(2**64), "-1", str(-2**63 - 1)])
def test_a_seed_outside_0_to_2_64_is_a_one_line_error_on_every_command(command, value, capsys):
    parser = dict(_commands(PARSER))[(command,)]
    code, _, err = run([command, *_required_args(parser), "--seed", value], capsys)
    assert_one_line_error(code, err, "--seed", "2**64")


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


def test_the_largest_seed_generates(small, capsys):
    code, out, err = run(["generate", "Hi", "--model", small, "--max-new-tokens", "3", "--temperature", "1",
                          "--seed", str(2**64 - 1), "--json"], capsys)
    assert code == 0, err
    assert len(json.loads(out)["new_ids"]) == 3


def test_the_largest_seed_trains(tmp_path, capsys):
    data = tmp_path / "data.txt"
    data.write_text("a few words of text to train on. " * 200)
    code, _, err = run(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--n-layers", "1",
                        "--emb-dim", "16", "--n-heads", "2", "--context-length", "16", "--max-steps", "1",
                        "--sample-tokens", "0", "--no-plot", "--seed", str(2**64 - 1)], capsys)
    assert code == 0, err


def test_the_largest_seed_shuffles_finetuning_data():
    from glassgpt.training.tasks.examples import sample_indices
    assert sorted(sample_indices(10, 10, 0, 2**64 - 1)) == list(range(10))


# --- ports and temperatures ----------------------------------------------------------------------

@pytest.mark.parametrize("value", ["65536", "70000", "-1"])
def test_a_port_past_65535_is_refused_not_wrapped(value, capsys):
    code, _, err = run(["serve", "--port", value], capsys)
    assert_one_line_error(code, err, "--port", "65535")


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("value", ["1e-45", "5e-324", "1e-31"])
def test_a_temperature_too_small_to_divide_by_is_refused_as_a_temperature(command, value, capsys):
    code, _, err = run([command, "Hi", "--model", "gpt2", "--temperature", value], capsys)
    assert_one_line_error(code, err, "--temperature", "1e-30", "greedy")
    assert "weights" not in err


def test_the_smallest_temperature_taken_samples_as_greedy_does(small, capsys):
    argv = ["generate", "Every effort moves you", "--model", small, "--max-new-tokens", "4", "--json", "--seed", "3"]
    greedy = json.loads(run(argv, capsys)[1])["new_ids"]
    code, out, err = run(argv + ["--temperature", "1e-30"], capsys)
    assert code == 0, err
    assert json.loads(out)["new_ids"] == greedy


# --- sizes that the model and the machine bound, refused before anything is allocated ------------

def fake_memory(monkeypatch, ram_gib: float, swap_gib: float = 0.0):
    free = memory.Free(int(ram_gib * GiB), int(swap_gib * GiB), "MemAvailable (faked)")
    monkeypatch.setattr(memory, "available_memory", lambda device=None: free)


def test_max_new_tokens_that_the_memory_cannot_hold_is_refused_with_what_fits(small, capsys, monkeypatch):
    fake_memory(monkeypatch, 16)
    allocated = []
    monkeypatch.setattr("glassgpt.formats.source.Source.load", lambda *a, **k: allocated.append(1))
    code, out, err = run(["generate", "Hi", "--model", small, "--max-new-tokens", str(10**12)], capsys)
    assert_one_line_error(code, err, "1,000,000,000,002 tokens", "16.0 GiB available", "--max-new-tokens")
    assert allocated == [] and out == ""


@pytest.mark.parametrize("flag, words", [
    ("--eval-batches", ["--eval-batches 1,000,000,000,000", "fits"]),
    ("--sample-tokens", ["--sample-tokens 1,000,000,000,000", "fits"]),
])
def test_evaluation_sizes_that_the_memory_cannot_hold_are_refused_before_the_run_starts(
        flag, words, tmp_path, capsys, monkeypatch):
    fake_memory(monkeypatch, 16)
    data = tmp_path / "data.txt"
    data.write_text("a few words of text to train on. " * 200)
    code, _, err = run(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--n-layers", "1",
                        "--emb-dim", "16", "--n-heads", "2", "--context-length", "16", flag, str(10**12)], capsys)
    assert_one_line_error(code, err, *words)
    assert not (tmp_path / "run").exists()


def test_eval_batches_that_the_memory_cannot_hold_are_refused_before_the_model_is_loaded(small, tmp_path, capsys,
                                                                                        monkeypatch):
    fake_memory(monkeypatch, 16)
    loaded = []
    monkeypatch.setattr("glassgpt.formats.source.Source.load", lambda *a, **k: loaded.append(1))
    data = tmp_path / "data.txt"
    data.write_text("a few words of text to evaluate. " * 200)
    code, _, err = run(["eval", "--model", small, "--data", str(data), "--eval-batches", str(10**12)], capsys)
    assert_one_line_error(code, err, "--eval-batches 1,000,000,000,000", "fits")
    assert loaded == []
