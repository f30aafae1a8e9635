"""Prefill speed: one forward over a 1 x 512 prompt that fills the KV cache, glassgpt vs transformers.

Both sides do what generation's first step does: run every prompt token, keep the
keys/values, and apply the LM head to the last position only (Hugging Face:
`logits_to_keep=1`; glassgpt: `last_only=True`). Same random weights, same process.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_prefill.py [--compile]
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import best_reference, common_args, glass_model, hf_model, print_table, setup, time_rows  # noqa: E402

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import KVCache, as_engine, compile_for_generation, quantize_int8  # noqa: E402


def main() -> None:
    p = common_args(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()
    device = setup(args)
    cfg = PRESETS[args.model]
    b, t = args.batch, args.tokens
    print(f"{args.model}: prefill {b} x {t} tokens (KV cache kept, head on the last position); "
          f"median of {args.repeats}; device {device}")

    fp32 = glass_model(cfg, device, torch.float32)
    models = {"glassgpt float32": fp32, "glassgpt bfloat16": glass_model(cfg, device, torch.bfloat16),
              "glassgpt int8": quantize_int8(glass_model(cfg, device, torch.float32))}
    if args.compile:
        models["glassgpt bfloat16 + compile"] = compile_for_generation(models["glassgpt bfloat16"])
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0)).to(device)

    def ours(m):
        engine = as_engine(m)
        dtype = engine.model.tok_emb.weight.dtype
        return lambda: engine(ids, KVCache(cfg, b, max_len=t, device=device, dtype=dtype), last_only=True)

    fns = {name: ours(m) for name, m in models.items()}
    if not args.no_hf:
        for dtype, name in ((torch.float32, "HF float32"), (torch.bfloat16, "HF bfloat16")):
            hf = hf_model(fp32, dtype)
            keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}
            fns[name] = lambda hf=hf, keep=keep: hf(ids, use_cache=True, **keep)
    with torch.inference_mode():
        seconds = time_rows(fns, device, args.repeats)
    rows = [(name, b * t / s) for name, s in seconds.items()]
    print_table(f"prefill {b} x {t}", "tokens/s", rows, best_reference(rows))


if __name__ == "__main__":
    main()
