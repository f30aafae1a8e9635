"""Where the time goes: a 512-token prefill (float32, bfloat16) and a batch-1 decoding step at each precision.

Prefill and the PyTorch engine's step: torch.profiler's self time per operator (glassgpt's kernels
are `glassgpt::gemv*`). The native step (engine/step.py, one C++ call per token): its own clock,
per phase of the step, on the first thread (its share of each phase, and its waits for the other
thread); the products' phases are the matrix-vector kernels. gpt2 shapes, random weights, 2 threads:
the measured profile behind RESULTS.md's "where the time goes".

    flock /tmp/glassgpt-bench.lock python benchmarks/decode_profile.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import glass_model, weight_bytes_per_token  # noqa: E402

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import Engine, KVCache, quantize_int4, quantize_int8  # noqa: E402
from glassgpt.engine.step import PHASES, NativeStep, why_not  # noqa: E402

MATMULS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear")
PRODUCTS = ("q/k/v products and cache write", "output projection", "feed-forward up + GELU", "feed-forward down", "head")


def table(prof, title: str, calls: int) -> None:
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS or e.key.startswith("glassgpt::"))
    print(f"\n{title}: {total / 1e3 / calls:.2f} ms per call; matrix products {mm / total:.0%} of operator time")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]:
        print(f"  {e.key:<50} {e.self_cpu_time_total / total:6.1%}  {e.count // calls:4d} calls")


def native_table(model, cfg, ids, name: str, steps: int = 40) -> None:
    cache = KVCache(cfg, 1, 128, dtype=model.tok_emb.weight.dtype)
    reason = why_not(model, cache)
    if reason is not None:
        print(f"\nnative step, batch 1, {name}: not run ({reason})")
        return
    Engine(model).prefill(ids[:, :16], cache)
    step = NativeStep(model, cache)
    for _ in range(5):
        step(ids[0, :1])
    phases = step.profile()
    start = time.perf_counter()
    for _ in range(steps):
        step(ids[0, :1])
    wall = (time.perf_counter() - start) / steps
    ms = phases / steps * 1e3
    products = sum(float(ms[PHASES.index(p)]) for p in PRODUCTS)
    moved = weight_bytes_per_token(model) / wall
    print(f"\nnative step, batch 1, {name}: {wall * 1e3:.2f} ms per token ({1 / wall:.1f} tokens/s, weights "
          f"{moved / 1e9:.1f} GB/s); the products {products / (wall * 1e3):.0%} of it, the call from Python "
          f"{1 - float(ms.sum()) / (wall * 1e3):.1%}")
    for phase, t in sorted(zip(PHASES, ms.tolist()), key=lambda p: -p[1]):
        print(f"  {phase:<50} {t / (wall * 1e3):6.1%}  {t:6.3f} ms")


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    cfg = PRESETS["gpt2"]
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    if "--decode-only" not in sys.argv:
        for dtype in (torch.float32, torch.bfloat16):
            engine = Engine(glass_model(cfg, torch.device("cpu"), dtype))
            run = lambda: engine(ids, KVCache(cfg, 1, 512, dtype=dtype), last_only=True)  # noqa: E731
            run()
            with torch.profiler.profile() as prof:
                for _ in range(3):
                    run()
            table(prof, f"prefill 1 x 512, {dtype}", 3)
    for name in ("float32", "bfloat16", "int8", "int4"):
        model = glass_model(cfg, torch.device("cpu"), torch.bfloat16 if name == "bfloat16" else torch.float32)
        model = {"int8": quantize_int8, "int4": quantize_int4}.get(name, lambda m: m)(model)
        engine = Engine(model)
        cache = KVCache(cfg, 1, 128, dtype=model.tok_emb.weight.dtype)
        engine(ids[:, :16], cache, last_only=True)
        for _ in range(5):
            engine.run(ids[:, :1], cache, True)
        with torch.profiler.profile() as prof:
            for _ in range(20):
                engine.run(ids[:, :1], cache, True)
        table(prof, f"PyTorch engine's decoding step, batch 1, {name}", 20)
        native_table(model, cfg, ids, name)


if __name__ == "__main__":
    main()
