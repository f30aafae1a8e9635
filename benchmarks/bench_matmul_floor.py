"""How fast a chapter's fast side can be on this CPU, from its matrix products alone.

A training step and an evaluation of GPT-2 124M are mostly matrix products: per block four [d, d]
and two [d, 4d] Linears, and the [d, V] head, each run forward (x W^T) and, in training, twice
backward (the input's gradient g W and the weight's g^T x). The book runs them in float32; the fast
side in bfloat16. Where both sides do the same products (chapter 5: nothing to leave out), the fast
side's time over the book's cannot fall below

    floor = (time of those products in bfloat16) / (time of the same products in float32)

on this CPU, whatever else is made faster: the other work (LayerNorm, GELU, attention, the loss,
the optimizer) only adds to it. This script times each product of one step at a chapter's shape,
in both precisions, with torch's matmul (oneDNN/MKL, what both sides run), and prints the floor.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_matmul_floor.py --threads 1 --tokens 512    # chapter 5
    flock /tmp/glassgpt-bench.lock python benchmarks/bench_matmul_floor.py --threads 2 --tokens 576    # chapter 7
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def products(tokens: int, d: int = 768, vocab: int = 50257, layers: int = 12) -> list[tuple[str, int, int, int, int]]:
    """(name, M, K, N, count) of every matrix product of one training step: forward, input gradient,
    weight gradient."""
    out = []
    for name, n_out, n_in, per_block in (("attention [d, d]", d, d, 4), ("ff up [4d, d]", 4 * d, d, 1),
                                         ("ff down [d, 4d]", d, 4 * d, 1)):
        count = per_block * layers
        out += [(f"{name} forward", tokens, n_in, n_out, count),
                (f"{name} input grad", tokens, n_out, n_in, count),
                (f"{name} weight grad", n_out, tokens, n_in, count)]
    out += [("head forward", tokens, d, vocab, 1), ("head input grad", tokens, vocab, d, 1),
            ("head weight grad", vocab, tokens, d, 1)]
    return out


def operands(name: str, m: int, k: int, n: int, dtype: torch.dtype):
    """The call as autograd makes it: F.linear with a [out, in] weight forward, g @ W for the input's
    gradient, g^T @ x (a transposed view) for the weight's."""
    if name.endswith("forward"):
        x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        return lambda: torch.nn.functional.linear(x, w)
    if name.endswith("input grad"):
        g, w = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        return lambda: g @ w
    g, x = torch.randn(k, m).to(dtype), torch.randn(k, n).to(dtype)  # [tokens, out], [tokens, in]
    return lambda: g.t() @ x


def seconds(name: str, m: int, k: int, n: int, dtype: torch.dtype, budget: float) -> float:
    run = operands(name, m, k, n, dtype)
    for _ in range(2):
        run()
    times = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(times) < 3:
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512, help="positions per batch (chapter 5: 2 x 256)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timing per product and precision")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.tokens} positions")
    print("| product | count | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 / f32 speed |\n|---|---:|---:|---:|---:|")
    total = {torch.float32: 0.0, torch.bfloat16: 0.0}
    forward = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for name, m, k, n, count in products(args.tokens):
        s = {dt: seconds(name, m, k, n, dt, args.budget) for dt in total}
        for dt in total:
            total[dt] += count * s[dt]
            if name.endswith("forward"):
                forward[dt] += count * s[dt]
        flops = 2 * m * k * n
        print(f"| {name} | {count} | {flops / s[torch.float32] / 1e9:.0f} | {flops / s[torch.bfloat16] / 1e9:.0f} | "
              f"{s[torch.float32] / s[torch.bfloat16]:.2f}x |")
    print(f"\none training step's products: float32 {total[torch.float32]:.2f} s, bfloat16 {total[torch.bfloat16]:.2f} s; "
          f"one evaluation batch (forward): {forward[torch.float32]:.2f} s, {forward[torch.bfloat16]:.2f} s")
    print(f"floor of fast / book where both do the same products: {total[torch.bfloat16] / total[torch.float32]:.2f}")


if __name__ == "__main__":
    main()
