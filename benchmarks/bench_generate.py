"""Greedy generation speed: glassgpt vs Hugging Face transformers, same random weights, same process.

New tokens per second for a 16-token prompt + 64 new tokens (greedy, KV cache), at
batch 1 and batch 8. Hugging Face runs `generate(use_cache=True, do_sample=False)` with
SDPA attention in float32 and bfloat16; glassgpt runs `glassgpt.generate` in float32,
bfloat16, int8 weight-only (quantize.py) and, with --compile, torch.compile'd.

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_generate.py
    flock /tmp/glassgpt-bench.lock python benchmarks/bench_generate.py --model gpt2-xl --batch 1 --compile
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import best_reference, common_args, glass_model, hf_model, print_table, setup, time_rows  # noqa: E402

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import compile_for_generation, quantize_int8  # noqa: E402
from glassgpt.generate import generate  # noqa: E402


def main() -> None:
    p = common_args(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    device = setup(args)
    cfg = PRESETS[args.model]
    n = args.new_tokens
    print(f"{args.model}: {args.prompt_len}-token prompt + {n} new tokens, greedy; "
          f"median of {args.repeats}; device {device}")

    fp32 = glass_model(cfg, device, torch.float32)
    models = {"glassgpt float32": fp32, "glassgpt bfloat16": glass_model(cfg, device, torch.bfloat16)}
    try:
        models["glassgpt int8"] = quantize_int8(glass_model(cfg, device, torch.float32))
    except RuntimeError as e:  # a device without the int8 kernel
        print(f"(int8 skipped: {e})")
    hf = {}
    if not args.no_hf:
        hf = {"HF float32": hf_model(fp32, torch.float32), "HF bfloat16": hf_model(fp32, torch.bfloat16)}

    gen = torch.Generator().manual_seed(0)
    for b in args.batch:
        ids = torch.randint(0, cfg.vocab_size, (b, args.prompt_len), generator=gen).to(device)
        fns = {name: (lambda m=m: generate(m, ids, n)) for name, m in models.items()}
        if args.compile:
            # Fresh graphs per batch size, as in a process that serves one batch size: a second
            # size would get dynamic-shape graphs, which inductor runs slower on a CPU.
            torch._dynamo.reset()
            for name in ("glassgpt bfloat16", "glassgpt int8"):
                if name in models:
                    fns[name + " + compile"] = lambda m=compile_for_generation(models[name]): generate(m, ids, n)
        for name, m in hf.items():
            fns[name] = lambda m=m: m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                               use_cache=True, pad_token_id=0)
        with torch.inference_mode():
            seconds = time_rows(fns, device, args.repeats)
        rows = [(name, b * n / s) for name, s in seconds.items()]
        print_table(f"generation, batch {b} ({args.prompt_len} + {n} tokens)", "new tokens/s", rows,
                    best_reference(rows))
        if "HF float32" in hf:
            with torch.inference_mode():
                same = torch.equal(generate(fp32, ids, n), fns["HF float32"]())
            print(f"glassgpt float32 greedy tokens identical to HF float32: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
