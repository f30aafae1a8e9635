"""Prefill speed: one forward over a 1 x 512 prompt that fills the KV cache, glassgpt vs transformers.

Both sides do what generation's first step does: run every prompt token, keep the
keys/values, and apply the LM head to the last position only (transformers:
`logits_to_keep=1`; glassgpt: `Engine(model)(ids, cache, last_only=True)`). Same random
weights, same process. Rows: float32, bfloat16 and int8 weight-only on both sides
(transformers' int8 through torchao when installed); with --compile, the bfloat16 and
int8 rows again through torch.compile (glassgpt: `compile_for_generation`; transformers:
a torch.compile'd forward). Printed in two views, like for like and best against best.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_prefill.py [--compile]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Row, common_args, models_at_each_precision, print_views, setup, time_rows  # noqa: E402

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import KVCache, as_engine, compile_for_generation  # noqa: E402


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

    ours, theirs = models_at_each_precision(cfg, device, reference=not args.no_hf)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(0)).to(device)

    def ours_fn(model):
        engine = as_engine(model)
        dtype = engine.model.tok_emb.weight.dtype
        return lambda: engine(ids, KVCache(cfg, b, max_len=t, device=device, dtype=dtype), last_only=True)

    def theirs_fn(model, forward=None):
        forward = forward or model.forward
        return lambda: forward(ids, use_cache=True, logits_to_keep=1)

    fns, meta = {}, {}
    for (name, precision), m in ours.items():
        fns[name], meta[name] = ours_fn(m), (precision, False, False)
        if args.compile and precision != "float32":
            fns[name + " + compile"] = ours_fn(compile_for_generation(m))
            meta[name + " + compile"] = (precision, True, False)
    for (name, precision), m in theirs.items():
        fns[name], meta[name] = theirs_fn(m), (precision, False, True)
        if args.compile and precision != "float32":
            fns[name + " + compile"] = theirs_fn(m, torch.compile(m.forward))
            meta[name + " + compile"] = (precision, True, True)
    with torch.inference_mode():
        seconds = time_rows(fns, device, args.repeats)
    rows = [Row(name, b * t / s, *meta[name]) for name, s in seconds.items()]
    print_views(f"prefill {b} x {t}", "tokens/s", rows)


if __name__ == "__main__":
    main()
