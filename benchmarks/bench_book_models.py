"""Greedy generation speed of Qwen3 and Llama 3.2 at batch 1: glassgpt against the book's own KV-cache
code and transformers, on the same random weights, in the same process and thread count.

Rows, for each dtype (float32, bfloat16):
  - glassgpt: `glassgpt.generate` on the glass model (families/), with its grouped KV cache
    (engine/cache.py: the g key/value heads written in place, RoPE's rows sliced, not recomputed):
    the prompt through engine/decode.py's twin (the gemv kernel on the layers where autotune
    measured it faster), then each new token by the native step (kernels/family_step.cpp, one C++
    call per token) where it measured faster than the twin on this machine;
  - the book: `llms_from_scratch.kv_cache.generate.generate_text_simple` on the book's KV-cache
    `Qwen3Model` / `Llama3Model` (`kv_cache/qwen3.py`, `kv_cache/llama3.py`), its cache of
    concatenated tensors;
  - transformers: `Qwen3ForCausalLM` / `LlamaForCausalLM` `.generate(do_sample=False)`, SDPA, its
    dynamic cache.
Two tables per model, each printed in both views (harness.print_views): against the book's code
and against transformers, like for like (same dtype) and best against best. Each row says how many
of its greedy tokens equal glassgpt float32's. The shapes are Qwen3 0.6B's and Llama 3.2 1B's;
--small keeps their widths but 2 layers, a 4,096-token vocabulary and 8 new tokens (a quick check
that the script runs, not a measurement).

    flock /tmp/glassgpt-bench.lock python benchmarks/bench_book_models.py
    python benchmarks/bench_book_models.py --small --threads 2 --repeats 1
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import CopyMeter, Row, machine_info, print_views, time_rows, weight_bytes_per_token  # noqa: E402

from glassgpt.engine.decode import twin_steps  # noqa: E402
from glassgpt.engine.step import RopeStep  # noqa: E402
from glassgpt.families import family_config, random_family_model  # noqa: E402
from glassgpt.formats.families import config_to_hf, hf_names  # noqa: E402
from glassgpt.generate import generate  # noqa: E402

PRESETS = ("qwen3-0.6b", "llama3.2-1b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def book_model(glass: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The book's KV-cache class of glass's family holding glass's weights (its names are the book's)."""
    import llms_from_scratch.kv_cache.llama3 as book_llama
    import llms_from_scratch.kv_cache.qwen3 as book_qwen
    cls = book_qwen.Qwen3Model if glass.cfg.family == "qwen3" else book_llama.Llama3Model
    book = cls(glass.cfg.to_book_dict(dtype))
    if glass.cfg.tie_embeddings:
        book.out_head.weight = book.tok_emb.weight  # the published models' tie, as glass holds it
    book.load_state_dict(glass.state_dict())
    return book.eval()


def hf_model(glass: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    raw = config_to_hf(glass.cfg)
    raw.pop("architectures"), raw.pop("torch_dtype")
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    own = glass.state_dict()
    missing = hf.load_state_dict({h: own[b] for b, h in hf_names(glass.cfg)}, strict=False).missing_keys
    assert missing in ([], ["lm_head.weight"]) and (not missing or hf.lm_head.weight is hf.model.embed_tokens.weight)
    return hf.eval()


def hf_generate(model, ids, n: int):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)


def agreement(tokens: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> str:
    new, ref = tokens[:, prompt_len:], reference[:, prompt_len:]
    same = (new == ref).int().cumprod(dim=1).sum(dim=1)
    return f"{int(same.min())}/{new.shape[1]} tokens = glassgpt float32's"


def bench(name: str, args: argparse.Namespace, copy: CopyMeter) -> None:
    import llms_from_scratch.kv_cache.generate as book_generate
    overrides = dict(n_layers=2, vocab_size=4096) if args.small else {}
    cfg = family_config(name, **overrides)
    n = args.new_tokens or (8 if args.small else 64)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    print(f"\n{name}{' (--small: 2 layers, vocab 4,096)' if args.small else ''}: {args.prompt_len}-token prompt + "
          f"{n} new tokens, greedy, batch 1; median of {args.repeats}")
    rows, reference = [], None
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        glass = random_family_model(cfg, dtype=dtype)
        models = {"glassgpt": glass, "book kv_cache": book_model(glass, dtype)}
        fns = {f"glassgpt {dtype_name}": lambda: generate(glass, ids, n),
               f"book kv_cache {dtype_name}": lambda: book_generate.generate_text_simple(models["book kv_cache"], ids, n)}
        if not args.no_hf:
            models["transformers"] = hf_model(glass, dtype)
            fns[f"transformers {dtype_name}"] = lambda: hf_generate(models["transformers"], ids, n)
        with torch.inference_mode():
            seconds = time_rows(fns, torch.device("cpu"), args.repeats, copy=copy)
            if reference is None:
                reference = generate(glass, ids, n)
            for label, s in seconds.items():
                note = agreement(fns[label](), reference, args.prompt_len)
                if label.startswith("glassgpt"):
                    path = "native step" if isinstance(twin_steps(glass).step, RopeStep) else "twin"
                    note += f"; decoded by the {path}; {copy.note(label, weight_bytes_per_token(glass), n)} (prompt included)"
                rows.append(Row(label, n / s, dtype_name, reference=not label.startswith("glassgpt"), note=note))
        del glass, models, fns
        gc.collect()
    for against in ("book kv_cache", "transformers"):
        chosen = [r for r in rows if not r.reference or r.name.startswith(against)]
        if any(r.reference for r in chosen):
            print_views(f"{name}: glassgpt against {against}, batch 1", "new tokens/s", chosen)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (8 with --small)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per row (the median is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads, the same for every row")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' rows")
    p.add_argument("--small", action="store_true", help="2 layers and a 4,096-token vocabulary: a quick run")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_info(torch.device("cpu")))
    copy = CopyMeter(torch.device("cpu"))
    print(f"copy rate now: {copy.rate() / 1e9:.1f} GB/s (256 MB tensor copy, read + write; measured again "
          "before and after every timed run)")
    for name in args.models:
        bench(name, args, copy)


if __name__ == "__main__":
    main()
