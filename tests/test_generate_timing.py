"""`generate` reports its set-up apart from its decoding rate, and the first-step measurement is kept across
processes (generate.py's Timing, engine/autotune.py's cache, engine/decode.py's `prepare` seam).

Tried as a new user would on a small Qwen3, the CLI said 108-143 tokens/s where the same model decodes at
about 640 in a warm process, with nothing saying why: the figure folded the load, the first-step
measurement and the prompt into the rate. No test here reads the wall clock: a fake clock counts, or the
fields' relationships are asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glassgpt import GPTConfig
from glassgpt.engine.decode import Engine, TwinSteps
from glassgpt.families import build_model
from glassgpt.formats import random_model
from glassgpt.generate import Timing, generate, stream

from helpers import SMALL, TINY, V, randomize_, run

TESTS = Path(__file__).resolve().parent
GPT2 = GPTConfig(vocab_size=V, context_length=24, emb_dim=32, n_heads=4, n_layers=2)


class Ticks:
    """A clock that moves one second per read, and `jump` seconds more at the next read."""

    def __init__(self):
        self.now, self.jump = 0.0, 0.0

    def __call__(self) -> float:
        self.now += 1.0 + self.jump
        self.jump = 0.0
        return self.now


def model_of(kind: str) -> torch.nn.Module:
    if kind == "gpt2":
        return random_model(GPT2, torch.device("cpu"), torch.float32).eval()
    return randomize_(build_model(TINY[kind]))


@pytest.mark.parametrize("kind", ["gpt2", "qwen3", "llama3"])
def test_each_segment_is_timed_apart_and_the_rate_counts_the_decoding_steps_only(kind):
    # Each timed segment reads the clock twice: with a clock of one second per read, a segment is one second.
    timing = Timing(clock=Ticks())
    ids = generate(model_of(kind), torch.tensor([[1, 2, 3]]), 6, timing=timing)
    assert ids.shape == (1, 9)
    assert timing.decoded == 5  # the first new token comes from the prompt's logits
    assert timing.prefill_s == 1.0 and timing.decode_s == 5.0 and timing.decode_rate == 1.0
    assert timing.tune_s == 2.0  # the engine made, then the decoding step planned
    assert timing.setup_s == timing.load_s + timing.tune_s + timing.prefill_s == 3.0


@pytest.mark.parametrize("kind, seam", [("gpt2", Engine), ("qwen3", TwinSteps)])
def test_a_slow_first_step_measurement_lengthens_the_set_up_and_leaves_the_rate(kind, seam, monkeypatch):
    clock, calls = Ticks(), []
    real = seam.prepare

    def measuring(self, cache):  # as a cold machine does: ten seconds of measuring before the first step (only)
        if not calls:
            clock.jump = 10.0
        calls.append(cache)
        return real(self, cache)
    monkeypatch.setattr(seam, "prepare", measuring)
    timing = Timing(clock=clock)
    generate(model_of(kind), torch.tensor([[1, 2, 3]]), 6, timing=timing)
    assert timing.tune_s == 12.0 and timing.setup_s == 13.0
    assert timing.decode_rate == 1.0  # 5 tokens in 5 s, whatever the set-up took


def test_a_reply_of_one_token_has_no_decoding_rate_and_an_eos_stops_the_count():
    timing = Timing(clock=Ticks())
    generate(model_of("gpt2"), torch.tensor([[1, 2, 3]]), 1, timing=timing)
    assert timing.decoded == 0 and timing.decode_rate is None and timing.prefill_s == 1.0
    model, prompt = model_of("qwen3"), torch.tensor([[1, 2, 3]])
    new = generate(model, prompt, 4)[0, 3:].tolist()
    eos = new[2]  # the third new token, or an earlier one equal to it
    timing = Timing(clock=Ticks())
    assert generate(model, prompt, 10, eos_id=eos, timing=timing)[0, 3:].tolist() == new[:new.index(eos) + 1]
    assert timing.decoded == new.index(eos) and timing.decode_s == timing.decoded


def test_the_caller_can_time_the_load_and_the_time_between_ids_is_not_the_models():
    clock = Ticks()
    timing = Timing(load_s=4.0, clock=clock)
    for _ in stream(model_of("llama3"), [1, 2, 3], 4, timing=timing):
        clock.jump = 100.0  # the caller prints slowly: not decoding time
    assert timing.setup_s == 4.0 + 2.0 + 1.0
    assert timing.decoded == 3 and timing.decode_s == 3.0  # the caller's 100 s between ids are not counted
    reported = timing.to_dict()["decode_tokens_per_s"]  # arithmetic on the fake clock's ticks, not a speed
    assert reported == timing.decode_rate == 1.0


def test_the_cli_says_the_set_up_and_the_decoding_rate_in_one_line(tmp_path, capsys, monkeypatch):
    import glassgpt.cli.core as core
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    monkeypatch.setattr(core, "Timing", lambda: Timing(clock=Ticks()))
    code, out, err = run(["generate", "Every effort moves you", "--model", str(path), "--max-new-tokens", "5"], capsys)
    assert code == 0
    line = err.splitlines()[-1]
    # load 1 s, the CLI's kernel report 1 s + the engine 1 s + the plan 1 s, the prompt 1 s; 4 steps of 1 s each
    assert "loading 1.00 s" in line and "prompt 1.00 s" in line and "set-up 5.00 s" in line
    assert line.endswith("decoding 4 tokens at 1.0 tokens/s")
    assert ("measuring this machine 3.00 s" in line) or ("engine and plan 3.00 s (measurements read from the cache)" in line)


# --- the first-step measurement, kept across processes --------------------------------------------------

# Each process: glassgpt's C++ step stood in for by the glass model's own forward (this test's subject is the
# cache, not the kernels, so it runs on any CPU), and every measurement settled at once (a stand-in and its
# twin time alike, which autotune would otherwise measure again at the next start: SETTLED_LEAD).
PROCESS = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from helpers import TINY, randomize_
from glassgpt import GPTConfig
from glassgpt.engine import autotune, native, step as plans
from glassgpt.families import build_model
from glassgpt.formats import random_model
from glassgpt.generate import Timing, generate

native.load = native.library = lambda: None
autotune.SETTLED_LEAD, autotune.STEADY = 1.0, float("inf")


class StandIn:
    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    def stale(self):
        return False

    def takes(self, cache):
        return False

    def greedy(self, logits):
        return None

    def __call__(self, ids):
        return self.model(ids[:, None], self.cache, last_only=True)[:, -1]


plans.why_not = lambda model, cache: None
plans.native_step = lambda model, cache: StandIn(model, cache)
if {kind!r} == "gpt2":
    model = random_model(GPTConfig(vocab_size=97, context_length=24, emb_dim=32, n_heads=4, n_layers=2),
                         torch.device("cpu"), torch.float32).eval()
else:
    model = randomize_(build_model(TINY[{kind!r}]))
timing = Timing()
ids = generate(model, torch.tensor([[1, 2, 3]]), 6, timing=timing)
choices = autotune._memo[next(key for key in autotune._memo if key.split(" | ")[1] == "float32")]
print(json.dumps({{"measured": list(timing.measured), "cached": choices.cached, "step": choices.winners.get("step"),
                  "ids": ids[0].tolist()}}))
"""


@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
def test_a_second_process_reads_the_first_step_measurement_and_does_not_measure_again(kind, tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")]))

    def process() -> dict:
        done = subprocess.run([sys.executable, "-c", PROCESS.format(tests=str(TESTS), kind=kind)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    first = process()
    assert "step" in first["measured"] and not first["cached"] and first["step"] in ("native", "engine")
    saved = json.loads((tmp_path / "glassgpt" / "autotune.json").read_text())
    assert [entry["winners"]["step"] for entry in saved.values() if "step" in entry["winners"]] == [first["step"]]
    second = process()
    assert second["measured"] == [] and second["cached"]  # read back: nothing measured again
    assert second["step"] == first["step"] and second["ids"] == first["ids"]
