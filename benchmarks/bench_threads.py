"""How many CPU threads a generation should take, with the machine's load in view.

Times glassgpt's default generation path (the engine, float32, eager) on a GPT-2 124M-sized
preset with 1 and with all of this process's cores, first on a quiet machine, then with
`--busy K` other processes each spinning one core (as other users' jobs would), interleaved
and repeated so that drift in the machine's load hits both sides alike. Prints new tokens/s
for each and the thread count `device.pick_threads` chooses under each load.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_threads.py [--busy 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from glassgpt.device import pick_threads
from glassgpt.formats import random_model
from glassgpt.config import PRESETS
from glassgpt.generate import generate


def tokens_per_s(model, threads: int, new_tokens: int) -> float:
    torch.set_num_threads(threads)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 16))
    generate(model, prompt, 2)  # warm up the kernels for this thread count
    start = time.perf_counter()
    generate(model, prompt, new_tokens)
    return new_tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--busy", type=int, default=1, help="spinning processes in the loaded runs (default: 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    model = random_model(PRESETS[args.model], torch.device("cpu"), torch.float32, seed=0)
    for busy in (0, args.busy):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(3 if busy else 0)  # let the load average see them
            runs = {1: [], cores: []}
            for _ in range(args.repeats):
                for n in runs:
                    runs[n].append(tokens_per_s(model, n, args.new_tokens))
            chosen = pick_threads(model.cfg.emb_dim, cores)
        finally:
            for s in spinners:
                s.kill()
                s.wait()
        line = ", ".join(f"{n} thread{'s' if n > 1 else ''}: {' '.join(f'{v:.1f}' for v in vals)}"
                         for n, vals in runs.items())
        print(f"{busy} busy process(es), load {os.getloadavg()[0]:.2f}: new tokens/s {line}; "
              f"pick_threads -> {chosen[0]} ({chosen[1]})")


if __name__ == "__main__":
    main()
