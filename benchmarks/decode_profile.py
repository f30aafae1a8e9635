"""Where the time goes: a 512-token prefill (float32, bfloat16) and a batch-1 decoding step at each precision.

Prefill and the PyTorch engine's step: torch.profiler's self time per operator (glassgpt's kernels
are `glassgpt::gemv*`). The native step (engine/step.py, one C++ call per token): its own clock,
per phase of the step, on the first thread (its share of each phase, and its waits for the other
thread); the products' phases are the matrix-vector kernels. gpt2 shapes, random weights, 2 threads:
the measured profile behind RESULTS.md's "where the time goes".

`--bonus` profiles the bonus models' decoding step instead (bench_book_models.py's real shapes: Gemma 3 270M,
Qwen3.5 0.8B, the small Qwen3 MoE with 16 of its 128 experts built, since a token reads only its 8 routed ones):
generate's own step (TwinSteps.decode_one) at batch 1, in float32 and bfloat16, its operators' self time, and
the rate it reads its weights at against the copy rate measured beside it.

    flock /tmp/glassgpt-bench.lock python benchmarks/decode_profile.py
    python benchmarks/decode_profile.py --bonus gemma3-270m qwen3.5-0.8b qwen3-moe-small
"""

from __future__ import annotations

import gc
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
def bonus_table(name: str, dtype: torch.dtype, steps: int = 8) -> None:
    """The bonus model `name`'s decoding step through generate's TwinSteps: wall time, weights' rate, operators."""
    import dataclasses
    from bench_book_models import bonus_config, read_bytes_per_token
    from harness import CopyMeter
    from glassgpt.engine.decode import twin_steps
    from glassgpt.engine.hybrid_cache import cache_for
    from glassgpt.families import random_family_model
    cfg = bonus_config(name, small=False)
    if getattr(cfg, "num_experts", 0):
        cfg = dataclasses.replace(cfg, num_experts=16)
    model = random_family_model(cfg, dtype=dtype)
    twin = twin_steps(model)
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = cache_for(cfg, 1, 64, dtype=dtype)
    twin.prefill(ids, cache)
    for _ in range(3):
        twin.decode_one(ids[:, -1], cache)
    copy = CopyMeter(torch.device("cpu"), mb=128)
    before = copy.rate()
    start = time.perf_counter()
    for _ in range(steps):
        twin.decode_one(ids[:, -1], cache)
    wall = (time.perf_counter() - start) / steps
    rate = (before + copy.rate()) / 2
    moved = read_bytes_per_token(model) / wall
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            twin.decode_one(ids[:, -1], cache)
    print(f"\n{name}, {str(dtype).removeprefix('torch.')}: {wall * 1e3:.1f} ms per token; weights "
          f"{read_bytes_per_token(model) / 1e6:,.0f} MB a token read at {moved / 1e9:.1f} GB/s = {moved / rate:.0%} of "
          f"the copy rate beside it ({rate / 1e9:.1f} GB/s)")
    table(prof, "  operators", steps)
    head = model.out_head.weight
    x = torch.randn(1, 1, head.shape[1], dtype=dtype)
    start = time.perf_counter()
    for _ in range(steps):
        model.out_head(x)
    alone = (time.perf_counter() - start) / steps
    print(f"  the head alone ({head.shape[0]:,} x {head.shape[1]:,}): {alone * 1e3:.1f} ms, "
          f"{head.nbytes / alone / 1e9:.1f} GB/s; {alone / wall:.0%} of the step")


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    if "--bonus" in sys.argv:
        for name in sys.argv[sys.argv.index("--bonus") + 1:]:
            for dtype in (torch.float32, torch.bfloat16):
                bonus_table(name, dtype)
                gc.collect()
        return
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
