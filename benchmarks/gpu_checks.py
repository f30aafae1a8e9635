"""The GPU's correctness checks, run by gpu_check.sh before its timings (each was a test no CPU can run).

1. A random gpt2 on CUDA against the same weights on the CPU: float32 logits within 1e-4.
2. The CUDA graph of the decoding step (engine/graphs.py) against the eager engine on the same GPU, for
   gpt2 in float32 and bfloat16 at batch 1 and 4, 64 greedy tokens: the same tokens in float32 (every
   step's logits within 1e-4 of the row's largest), and in bfloat16 the tokens before the first
   difference and the largest logit difference are printed; then the same with compile_for_generation
   (the graph records inductor's kernels).
3. A quick timing of both (new tokens/s), so that a figure exists even where a later benchmark is cut.

    python benchmarks/gpu_checks.py        # prints OK or FAIL per line; exit 1 on a FAIL
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import median_seconds  # noqa: E402

import glassgpt  # noqa: E402
from glassgpt.engine import as_engine, compile_for_generation  # noqa: E402
from glassgpt.formats import random_model  # noqa: E402
from glassgpt.generate import stream  # noqa: E402

failed = []
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a CPU runs the flow, for its own tests


def say(line: str, ok: bool | None = None) -> None:
    if ok is False:
        failed.append(line)
    print(line + ("" if ok is None else "  OK" if ok else "  FAIL"), flush=True)


def run(engine, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    logits = []
    tokens = list(stream(engine, ids, n, on_pick=lambda lg, _: logits.append(lg.float().clone())))
    return torch.stack(tokens, 1), logits


def tokens_per_s(engine, ids: torch.Tensor, n: int, repeats: int = 5) -> float:
    return ids.shape[0] * n / median_seconds(lambda: list(stream(engine, ids, n)), DEVICE, repeats=repeats)


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as float32: the comparisons below are exact-ish
    cfg = glassgpt.PRESETS["gpt2"]
    cpu = random_model(cfg, torch.device("cpu"), torch.float32)
    gpu = random_model(cfg, torch.device("cpu"), torch.float32).to(DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (gpu(ids.to(DEVICE)).cpu() - cpu(ids)).abs().max().item()
    say(f"cuda float32 logits vs the CPU: max abs difference {err:.2e} (< 1e-4)", err < 1e-4)
    del cpu

    n = 64
    for dtype in (torch.float32, torch.bfloat16):
        model = gpu.to(dtype)
        for b in (1, 4):
            prompt = torch.randint(0, cfg.vocab_size, (b, 16), generator=torch.Generator().manual_seed(b)).to(DEVICE)
            eager = as_engine(model)
            eager.use_graphs = False
            graphed = as_engine(model)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                want, want_logits = run(eager, prompt, n)
                got, got_logits = run(graphed, prompt, n)
            recorded = any(g is not None for g in graphed.graphs.values())
            for w in said:
                say(f"  warning: {w.message}")
            same = int((got == want).int().cumprod(1).sum(1).min())
            diff = max(((g - w).abs().amax(-1) / w.abs().amax(-1)).max().item()
                       for g, w in zip(got_logits[:same + 1], want_logits[:same + 1]))
            name = f"graph vs eager, gpt2 {str(dtype)[6:]} batch {b}: graph recorded {recorded}, {same}/{n} tokens equal, " \
                   f"logits within {diff:.1e} of the row's largest"
            say(name, recorded and (same == n and diff < 1e-4 if dtype == torch.float32 else diff < 5e-2))
            if b == 1:
                fast, slow = tokens_per_s(graphed, prompt, n), tokens_per_s(eager, prompt, n)
                say(f"  gpt2 {str(dtype)[6:]} batch 1, {n} tokens: graph {fast:,.0f} tokens/s, eager {slow:,.0f} "
                    f"({fast / slow:.2f}x)")
        if dtype == torch.bfloat16:
            prompt = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
            eager = as_engine(model)
            eager.use_graphs = False
            start = time.perf_counter()
            compiled = compile_for_generation(model)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                got, got_logits = run(compiled, prompt, n)
            for w in said:
                say(f"  warning: {w.message}")
            want, want_logits = run(eager, prompt, n)
            recorded = any(g is not None for g in compiled.graphs.values())
            same = int((got == want).int().cumprod(1).sum(1).min())
            say(f"compiled graph vs eager, gpt2 bfloat16 batch 1: graph recorded {recorded} (first call "
                f"{time.perf_counter() - start:.0f} s), {same}/{n} tokens equal", recorded)
            fast = tokens_per_s(compiled, prompt, n)
            say(f"  compiled + graph: {fast:,.0f} tokens/s")
    if failed:
        print(f"{len(failed)} check(s) failed", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
