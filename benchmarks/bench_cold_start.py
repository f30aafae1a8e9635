"""The time a user waits: one `generate` of 100 tokens from a cold process, and where its start-up goes.

Every row is a fresh Python process, timed from its start: to the first generated token on its
stdout (the start-up, the prompt's prefill included), and to its exit. The model is a random
GPT-2 of the chosen shape, exported once to a Hugging Face-layout directory on disk, so that
the weights are read as a user's checkpoint is:

    glassgpt      glassgpt generate PROMPT --model DIR --max-new-tokens 100   (the default path)
    glassgpt      the same with --compile, the first process over an empty glassgpt cache (it
                  compiles, or says why it does not), then the next processes
    transformers  python -c "pipeline('text-generation', model=DIR)(PROMPT, max_new_tokens=100,
                  do_sample=False)"   (total only: it prints nothing until it is done)

Runs are interleaved (glassgpt, transformers, glassgpt, ...) and the median is reported. Then one
more glassgpt process runs under a driver that stamps the time at each phase of the same command
(imports, opening and loading the weights, the tokenizer, the kernels' choice and load, the first
token, the rest), which is the breakdown; `python -X importtime -m glassgpt generate ...` names the
modules behind the first phase.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_cold_start.py [--model gpt2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import glass_model, machine_info  # noqa: E402

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.formats import export_hf  # noqa: E402

PROMPT = "Every effort moves you"
NEW_TOKENS = 100
PIPELINE = ("from transformers import pipeline; import sys; "
            "p = pipeline('text-generation', model=sys.argv[1], device='cpu'); "
            f"p(sys.argv[2], max_new_tokens={NEW_TOKENS}, min_new_tokens={NEW_TOKENS}, do_sample=False)")

# The same command in a process that stamps each phase: the CLI's own functions, wrapped.
DRIVER = r"""
import sys, time, json
stamps = [("start", time.perf_counter())]
def stamp(name): stamps.append((name, time.perf_counter()))
import glassgpt.cli as cli, glassgpt.cli.core as core
from glassgpt.formats.source import Source
from glassgpt.engine import autotune, native
stamp("imports")
def wrap(owner, name, label):
    f = getattr(owner, name)
    def wrapped(*a, **k):
        out = f(*a, **k)
        stamp(label)
        return out
    setattr(owner, name, wrapped)
wrap(Source, "load", "weights")
wrap(Source, "tokenizer", "tokenizer")
wrap(core, "report_kernels", "kernels chosen and loaded")
stream = core.stream
def first_token(*a, **k):
    it = stream(*a, **k)
    first = True
    for i in it:
        if first:
            stamp("first token")
            first = False
        yield i
    stamp("the other tokens")
core.stream = first_token
code = cli.main(sys.argv[1:])
stamp("exit")
print(json.dumps(stamps), file=sys.stderr)
sys.exit(code)
"""


def timed(cmd: list[str], env: dict[str, str], first_after: str | None) -> tuple[float | None, float]:
    """(seconds to the first byte after `first_after` on stdout, or None; seconds to exit)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first, seen = None, b""
    while first_after is not None and first is None:
        chunk = proc.stdout.read1(4096)
        if not chunk:
            break
        seen += chunk
        if len(seen) > len(first_after.encode()):
            first = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}")
    return first, time.perf_counter() - start


def breakdown(cmd: list[str], env: dict[str, str]) -> list[tuple[str, float]]:
    """[(phase, seconds)] of one process: the interpreter's start, then each phase of the command
    (perf_counter is the system's monotonic clock on Linux, the same in both processes)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", DRIVER, *cmd], env=env, capture_output=True, text=True, check=True)
    stamps = json.loads(done.stderr.strip().splitlines()[-1])
    phases, last = [], start
    for name, t in stamps:
        phases.append(("python starts" if name == "start" else name, t - last))
        last = t
    return phases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=list(PRESETS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the --compile rows")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    args = p.parse_args()
    print(machine_info(torch.device("cpu")))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = export_hf(glass_model(PRESETS[args.model], torch.device("cpu")), Path(tmp) / "model")
        env = {**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        generate = ["generate", PROMPT, "--model", str(model_dir), "--max-new-tokens", str(NEW_TOKENS)]
        ours = [sys.executable, "-m", "glassgpt", *generate]
        theirs = [sys.executable, "-c", PIPELINE, str(model_dir), PROMPT]
        rows: dict[str, list[tuple[float | None, float]]] = {"glassgpt generate (default)": []}
        if not args.no_hf:
            rows["transformers pipeline"] = []
        timed(ours, env, PROMPT)  # the kernels built and the autotune measured, once, before timing
        for _ in range(args.repeats):
            rows["glassgpt generate (default)"].append(timed(ours, env, PROMPT))
            if not args.no_hf:
                rows["transformers pipeline"].append(timed(theirs, env, None))
        if not args.no_compile:
            # An empty cache root: no inductor cache and no compile measured yet for this model.
            cold = {**env, "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
            rows["glassgpt generate --compile, first process (empty cache)"] = [timed(ours + ["--compile"], cold, PROMPT)]
            rows["glassgpt generate --compile, next processes"] = [
                timed(ours + ["--compile"], cold, PROMPT) for _ in range(args.repeats)]
        phases = breakdown(generate, env)

    print(f"\n{args.model}: a cold process loads the model and generates {NEW_TOKENS} tokens greedily "
          f"(median of {args.repeats}; 'first process' is one run)")
    print("| command | to the first token (s) | to exit (s) |")
    print("|---|---:|---:|")
    for name, runs in rows.items():
        firsts = [f for f, _ in runs if f is not None]
        first = f"{statistics.median(firsts):.2f}" if firsts else "-"
        print(f"| {name} | {first} | {statistics.median(t for _, t in runs):.2f} |")
    print("\nwhere one default process's time goes (one run):")
    print("| phase | seconds |")
    print("|---|---:|")
    for name, seconds in phases:
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
