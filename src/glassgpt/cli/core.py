"""`glassgpt generate`, `glassgpt info`, `glassgpt download`."""

from __future__ import annotations

import argparse
import json
import sys

from ..formats.book import model_notes
from ..device import resolve_device, resolve_dtype
from ..engine.int4 import check_group_size
from ..engine import autotune, compile_for_generation, quantize_int4, quantize_int8
from ..generate import decode_stream, stream
from ..memory import memory_needs, parameter_table
from ..formats import checkpoint_dir, download, read_config
from .common import (add_model_args, check_prompt, encode_prompt, load, nonneg_float, nonneg_int, positive_int,
                     probability, require_language_model)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt, streaming the new text")
    p.add_argument("prompt")
    add_model_args(p, quantized=True)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model: the first run on a machine compiles for tens of seconds; later "
                        "processes reuse inductor's cache (TORCHINDUCTOR_CACHE_DIR) and start in seconds; pays off "
                        "for long outputs, mostly with --dtype int8 (default: off)")
    p.add_argument("--max-new-tokens", type=nonneg_int, default=50, help="tokens to add to the prompt (default: 50)")
    p.add_argument("--temperature", type=nonneg_float, default=0.0,
                   help="divide the logits by this before sampling; 0 takes the most likely token, greedy (default: 0)")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="sample among the K most likely tokens only (default: all of them)")
    p.add_argument("--top-p", type=probability, default=None,
                   help="sample among the fewest tokens whose probabilities add up to P (default: 1, all of them)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at <|endoftext|>")
    p.add_argument("--json", action="store_true", help='print {"prompt_ids", "new_ids", "text"} instead of streaming')
    p.set_defaults(run=run_generate)

    p = sub.add_parser("info", help="the config, a parameter table, and the memory a model needs")
    add_model_args(p, quantized=True)
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="sequences at once, for the KV cache and activation estimates (default: 1)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: context_length)")
    p.add_argument("--json", action="store_true", help="print the config, parameter table and memory as one JSON object")
    p.set_defaults(run=run_info)

    p = sub.add_parser("download", help="fetch a Hugging Face GPT-2 checkpoint into the local cache")
    p.add_argument("repo_id", help="e.g. openai-community/gpt2")
    p.set_defaults(run=run_download)


QUANTIZE = {"int8": quantize_int8, "int4": quantize_int4}


def load_quantized_or_float(args: argparse.Namespace):
    """`load(args)`, where `--dtype int8` or `int4` loads bfloat16 (both keep their activations in
    bfloat16). Returns (model, tokenizer, "int8"/"int4"/None): the caller quantizes if it runs the model."""
    quantized = args.dtype if args.dtype in QUANTIZE else None
    if quantized:
        args.dtype = "bfloat16"
    model, tok = load(args)
    return model, tok, quantized


def report_kernels(cfg, precision: str, device) -> autotune.Choices | None:
    """Say on stderr which kernels this machine runs for the model (measured once, then cached); CPU only."""
    if device.type != "cpu":
        return None
    choices = autotune.choose(cfg, precision)
    print(autotune.describe(choices, cfg), file=sys.stderr)
    return choices


def run_generate(args: argparse.Namespace) -> int:
    check_prompt(args.prompt)
    model, tok, quantized = load_quantized_or_float(args)
    require_language_model(model, args.model)
    if quantized:
        model = QUANTIZE[quantized](model)
    report_kernels(model.cfg, autotune.precision_of(model), model.tok_emb.weight.device)
    if args.compile:
        model = compile_for_generation(model)
    prompt_ids = encode_prompt(tok, args.prompt)
    steps = stream(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   eos_id=tok.eot_id if args.stop_at_eos else None, seed=args.seed)
    new_ids = []
    if args.json:
        new_ids = [int(i[0]) for i in steps]
        print(json.dumps({"prompt_ids": prompt_ids, "new_ids": new_ids, "text": tok.decode(prompt_ids + new_ids)}))
        return 0

    def ids():
        for i in steps:
            new_ids.append(int(i[0]))
            yield new_ids[-1]

    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    for text in decode_stream(tok, ids()):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def run_info(args: argparse.Namespace) -> int:
    # From the config alone: gpt2-xl's table needs no 6 GB of weights (a hub id is fetched, not loaded).
    cfg = read_config(args.model, args.n_heads) or read_config(checkpoint_dir(args.model))
    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype in QUANTIZE else resolve_dtype(args.dtype, device)
    precision = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if precision == "int4":
        check_group_size(cfg)
    choices = autotune.choose(cfg, precision) if device.type == "cpu" and precision in autotune.PRECISIONS else None
    rows = parameter_table(cfg)
    mem = memory_needs(cfg, dtype, args.batch_size, args.seq_len,
                       prompt_attention=choices.winners.get("attention prompt", "sdpa") if choices else "sdpa")
    notes = model_notes(args.model, cfg)
    if args.json:
        kernels = {"machine": choices.machine, "chosen": choices.winners, "ms": choices.ms} if choices else None
        print(json.dumps({"config": cfg.to_dict(), "notes": notes, "parameters": rows, "memory": mem,
                          "kernels": kernels}, indent=2))
        return 0
    print("config")
    for key, value in cfg.to_dict().items():
        print(f"  {key:<16} {value}")
    for note in notes:
        print(f"  {note}")
    print("\nparameters")
    for row in rows["modules"]:
        print(f"  {row['name']:<30} {row['shape']:<22} {row['params']:>15,}  {row['note']}")
    print(f"  {'total (as stored)':<53} {rows['total']:>15,}")
    print(f"  {'total if out_head were untied':<53} {rows['total_untied']:>15,}")
    print(f"  out_head.weight is tok_emb.weight: {rows['tied']}")
    print(f"\nmemory ({mem['dtype']}, batch {mem['batch_size']} x {mem['seq_len']} tokens)")
    for key in ("weights", "kv_cache", "inference", "gradients", "adamw_state", "activations", "training"):
        print(f"  {key:<14} {mem[key] / 2**30:>9.2f} GiB   {mem['notes'][key]}")
    if choices:
        print(f"\n{autotune.describe(choices, cfg)}")
    return 0


def run_download(args: argparse.Namespace) -> int:
    path = download(args.repo_id, progress=True)
    print(path)
    return 0
