"""The time a user waits: one `generate` of 50 tokens from a cold process, glassgpt vs transformers.

Both load the same random GPT-2 from the same Hugging Face-layout directory on disk and
generate greedily from the same prompt, each in a fresh Python process, timed from the
process start to its exit:

    glassgpt      glassgpt generate PROMPT --model DIR --max-new-tokens 50   (the default path)
    glassgpt      the same with --compile, twice in a row over one inductor cache directory:
                  the first run compiles, the second shows what a later process reuses
    transformers  python -c "pipeline('text-generation', model=DIR)(PROMPT, max_new_tokens=50,
                  do_sample=False)"

Runs are interleaved (glassgpt, transformers, glassgpt, ...) and the median is reported.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_cold_start.py
"""

from __future__ import annotations

import argparse
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
PIPELINE = ("from transformers import pipeline; import sys; "
            "p = pipeline('text-generation', model=sys.argv[1], device='cpu'); "
            "p(sys.argv[2], max_new_tokens=50, min_new_tokens=50, do_sample=False)")


def timed(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2", choices=list(PRESETS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the --compile rows")
    args = p.parse_args()
    print(machine_info(torch.device("cpu")))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = export_hf(glass_model(PRESETS[args.model], torch.device("cpu")), Path(tmp) / "model")
        env = {**os.environ, "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        ours = [sys.executable, "-m", "glassgpt", "generate", PROMPT, "--model", str(model_dir),
                "--max-new-tokens", "50"]
        theirs = [sys.executable, "-c", PIPELINE, str(model_dir), PROMPT]
        times: dict[str, list[float]] = {"glassgpt generate (default)": [], "transformers pipeline": []}
        for _ in range(args.repeats):
            times["glassgpt generate (default)"].append(timed(ours, env))
            times["transformers pipeline"].append(timed(theirs, env))
        if not args.no_compile:
            cache = {**env, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
            times["glassgpt generate --compile, first process"] = [timed(ours + ["--compile"], cache)]
            times["glassgpt generate --compile, next processes"] = [timed(ours + ["--compile"], cache)
                                                                   for _ in range(args.repeats)]
    ref = statistics.median(times["transformers pipeline"])
    print(f"\n{args.model}: a cold process loads the model and generates 50 tokens greedily "
          f"(median of {args.repeats}; 'first process' is one run)")
    print("| command | seconds | speed vs transformers pipeline (its seconds / these) |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"| {name} | {s:.2f} | {ref / s:.2f}x |")


if __name__ == "__main__":
    main()
