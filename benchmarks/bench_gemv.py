"""One row times a weight, as a decoding step multiplies it: glassgpt's matrix-vector kernel against PyTorch's.

At batch 1 a token multiplies one row by every weight of the model, so a step's time is the time to read
its weights, and the memory's copy rate is the limit. For each weight shape of the book's models (GPT-2
124M's, Gemma 3 270M's, Qwen3.5 0.8B's, their heads) and each of float32 and bfloat16, this times
`F.linear` (MKL/ATen, what the glass models run) and `torch.ops.glassgpt.gemv` (the whole kernels on an
AVX-512 CPU, their AVX2 build, kernels/gemv_avx2.cpp, elsewhere: native.gemv_ops) round-robin on the same
weights, and prints the rate each reads them at against a 256 MB copy timed right beside (harness.CopyMeter).
Enough distinct matrices of a shape are cycled through (~400 MB) that none is read from the cache.

    python benchmarks/bench_gemv.py [--threads 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import CopyMeter, machine_info  # noqa: E402

from glassgpt.engine import native  # noqa: E402

SHAPES = {  # (out, in): where it is read
    (768, 768): "GPT-2 attention, out_proj", (3072, 768): "GPT-2 ff up", (768, 3072): "GPT-2 ff down",
    (50257, 768): "GPT-2 head", (2048, 640): "Gemma 3 270M ff fc1/fc2", (640, 2048): "Gemma 3 270M ff fc3",
    (1024, 640): "Gemma 3 270M W_query", (262144, 640): "Gemma 3 270M head (tied)",
    (3584, 1024): "Qwen3.5 0.8B ff fc1/fc2", (1024, 3584): "Qwen3.5 0.8B ff fc3",
    (248320, 1024): "Qwen3.5 0.8B head (tied)",
}
POOL_BYTES = 400 * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ops = native.gemv_ops()
    print(machine_info(torch.device("cpu")))
    print(f"glassgpt's gemv: {native.gemv_status()}")
    if ops is None:
        return
    copy = CopyMeter(torch.device("cpu"))
    print(f"copy rate now: {copy.rate() / 1e9:.1f} GB/s (256 MB, read + write)\n")
    print(f"{'shape':>16} {'dtype':>9}  {'PyTorch GB/s':>12} {'glassgpt GB/s':>13} {'speed-up':>8}  "
          f"{'glassgpt / copy rate':>20}  where")
    for (out, inp), where in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            size = out * inp * dtype.itemsize
            pool = [torch.randn(out, inp).to(dtype) for _ in range(max(1, POOL_BYTES // size))]
            x = torch.randn(1, inp).to(dtype)
            calls = {"torch": lambda: [F.linear(x, w) for w in pool], "glassgpt": lambda: [ops.gemv(x, w, None) for w in pool]}
            for call in calls.values():
                call()
            seconds: dict[str, list[float]] = {name: [] for name in calls}
            shares = []
            for _ in range(args.repeats):
                for name, call in calls.items():
                    before = copy.rate()
                    start = time.perf_counter()
                    call()
                    seconds[name].append(time.perf_counter() - start)
                    if name == "glassgpt":
                        shares.append(size * len(pool) / seconds[name][-1] / ((before + copy.rate()) / 2))
            rate = {name: size * len(pool) / min(s) / 1e9 for name, s in seconds.items()}
            print(f"{out:>7} x {inp:<6} {str(dtype).removeprefix('torch.'):>9}  {rate['torch']:>12.1f} "
                  f"{rate['glassgpt']:>13.1f} {rate['glassgpt'] / rate['torch']:>7.2f}x  "
                  f"{statistics.median(shares):>19.0%}  {where}")
            del pool


if __name__ == "__main__":
    main()
