"""Greedy generation speed: glassgpt vs Hugging Face transformers, same random weights, same process.

New tokens per second for a 16-token prompt + 64 new tokens (greedy, KV cache), at
batch 1 and batch 8, printed in two views (harness.print_views): like for like (each
glassgpt row against transformers' row of the same precision and compile setting) and
best against best (each side's fastest row, overall and per precision).

Rows. glassgpt: `glassgpt.generate` in float32, bfloat16 and int8 weight-only
(engine/int8.py), and with --compile the same through `compile_for_generation`.
transformers: `generate(do_sample=False)` with SDPA attention and its dynamic KV cache in
float32 and bfloat16; with --compile, bfloat16 with its static cache and a torch.compile'd
forward (transformers' documented fast path); and, when torchao is installed, its int8
weight-only route (`torchao.quantization.quantize_(model, Int8WeightOnlyConfig())`, what
transformers' TorchAoConfig applies), eager and (with --compile) compiled.
Each row also reports how many of its greedy tokens equal glassgpt float32's, and each
batch-1 glassgpt row the memory-bandwidth view: the bytes of weights a step reads x new
tokens/s, against the copy bandwidth measured here first (a 256 MB tensor copy, read plus
write). glassgpt's rows run the kernels that engine/autotune.py chose; the chosen ones are
printed before the table. --int4 adds glassgpt's 4-bit row (transformers has no CPU int4
route to pair it with).

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_generate.py --compile
    flock /tmp/glassgpt-bench.lock python benchmarks/bench_generate.py --model gpt2-xl --batch 1 --compile
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (CopyMeter, Row, common_args, models_at_each_precision, weight_bytes_per_token,  # noqa: E402
                     print_views, setup, time_rows)

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import as_engine, autotune, compile_for_generation  # noqa: E402
from glassgpt.generate import generate  # noqa: E402


def hf_generate(model, ids, n: int, static: bool = False):
    extra = {"cache_implementation": "static"} if static else {}
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                          pad_token_id=0, **extra)


def agreement(tokens: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> str:
    """'k/n': new greedy tokens equal to the reference's before the first difference, per row (min)."""
    new, ref = tokens[:, prompt_len:], reference[:, prompt_len:]
    same = (new == ref).int().cumprod(dim=1).sum(dim=1)
    return f"{int(same.min())}/{new.shape[1]} tokens = glassgpt float32's"


def main() -> None:
    p = common_args(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--int4", action="store_true", help="add glassgpt's 4-bit row")
    args = p.parse_args()
    device = setup(args)
    cfg = PRESETS[args.model]
    n = args.new_tokens
    print(f"{args.model}: {args.prompt_len}-token prompt + {n} new tokens, greedy; "
          f"median of {args.repeats}; device {device}")
    copy = CopyMeter(device)
    print(f"copy rate now: {copy.rate() / 1e9:.1f} GB/s (256 MB tensor copy, read + write; at batch 1 measured "
          "again before and after every timed run)")

    ours, theirs = models_at_each_precision(cfg, device, reference=not args.no_hf, int4=args.int4)
    fp32 = ours[("glassgpt float32", "float32")]
    for m in ours.values():
        choices = as_engine(m).choices
        if choices is not None:
            print(autotune.describe(choices, cfg))

    # One Engine per model, made once, as `glassgpt generate` makes it: on a GPU it keeps the CUDA graph of the
    # decoding step (engine/graphs.py) from one call to the next. On a GPU each glassgpt row also runs without
    # the graph ("eager"), the reference that its tokens are compared with, to show what the graph gives.
    eager = {}
    if device.type == "cuda":
        for (name, precision), m in ours.items():
            engine = eager[(name + " eager (no CUDA graph)", precision)] = as_engine(m)
            engine.use_graphs = False
    reference_model = eager.get(("glassgpt float32 eager (no CUDA graph)", "float32"), fp32)
    engines = {key: as_engine(m) for key, m in ours.items()}

    gen = torch.Generator().manual_seed(0)
    for b in args.batch:
        ids = torch.randint(0, cfg.vocab_size, (b, args.prompt_len), generator=gen).to(device)
        fns, meta = {}, {}
        for (name, precision), m in [*engines.items(), *eager.items()]:
            fns[name] = lambda m=m: generate(m, ids, n)
            meta[name] = (precision, False, False)
        for (name, precision), m in theirs.items():
            fns[name] = lambda m=m: hf_generate(m, ids, n)
            meta[name] = (precision, False, True)
        if args.compile:
            # Fresh graphs per batch size, as in a process that serves one batch size: a second
            # size would get dynamic-shape graphs, which inductor runs slower on a CPU.
            torch._dynamo.reset()
            for (name, precision), m in ours.items():
                if precision != "float32":
                    fns[name + " + compile"] = lambda c=compile_for_generation(m): generate(c, ids, n)
                    meta[name + " + compile"] = (precision, True, False)
            for (name, precision), m in theirs.items():
                if precision != "float32":
                    m.forward = torch.compile(m.forward)  # the static cache keeps every step's shapes fixed
                    label = f"{name} + static cache + compile"
                    fns[label] = lambda m=m: hf_generate(m, ids, n, static=True)
                    meta[label] = (precision, True, True)
        with torch.inference_mode():
            seconds = time_rows(fns, device, args.repeats, copy=copy if b == 1 else None)
            reference = generate(reference_model, ids, n)
            notes = {name: agreement(fn(), reference, args.prompt_len) for name, fn in fns.items()}
        if b == 1:  # glassgpt's rows (transformers' Conv1D blocks are not counted by weight_bytes_per_token)
            models = {name: getattr(m, "model", m) for (name, _), m in [*ours.items(), *eager.items()]}
            for name in seconds:
                if name.removesuffix(" + compile") in models:
                    model = models[name.removesuffix(" + compile")]
                    notes[name] += "; " + copy.note(name, weight_bytes_per_token(model), n)
        rows = [Row(name, b * n / s, *meta[name], note=notes[name]) for name, s in seconds.items()]
        print_views(f"generation, batch {b} ({args.prompt_len} + {n} tokens)", "new tokens/s", rows)
        for m in theirs.values():  # back to the eager forward for the next batch size
            m.__dict__.pop("forward", None)


if __name__ == "__main__":
    main()
