"""Where the time goes: a 512-token prefill (float32, bfloat16) and a batch-1 decoding step at each precision.

torch.profiler's self time per operator (glassgpt's kernels are `glassgpt::gemv*`), gpt2 shapes,
random weights, 2 threads: the measured profile behind RESULTS.md's "where the misses come from".

    flock /tmp/glassgpt-bench.lock python benchmarks/decode_profile.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import glass_model  # noqa: E402

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import Engine, KVCache, quantize_int4, quantize_int8  # noqa: E402

MATMULS = ("aten::addmm", "aten::mm", "aten::bmm", "aten::linear")


def table(prof, title: str, calls: int) -> None:
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS or e.key.startswith("glassgpt::"))
    print(f"\n{title}: {total / 1e3 / calls:.2f} ms per call; matrix products {mm / total:.0%} of operator time")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:6]:
        print(f"  {e.key:<50} {e.self_cpu_time_total / total:6.1%}  {e.count // calls:4d} calls")


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    cfg = PRESETS["gpt2"]
    ids = torch.randint(0, cfg.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
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
            engine(ids[:, :1], cache, last_only=True)
        with torch.profiler.profile() as prof:
            for _ in range(20):
                engine(ids[:, :1], cache, last_only=True)
        table(prof, f"decoding step, batch 1, {name}", 20)


if __name__ == "__main__":
    main()
