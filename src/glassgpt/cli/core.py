"""`glassgpt generate`, `glassgpt info`, `glassgpt download`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..formats.book import layout_note
from ..device import cpu_flags, resolve_device, resolve_dtype
from ..engine.int4 import check_group_size
from ..engine import KVCache, as_engine, autotune, compile_for_generation, compiling, native
from ..engine.advice import advise
from ..errors import ConfigError, GlassError
from ..recall import MIN_TOKENS, copied_spans
from ..generate import Timing, decode_stream, glass_model, keeps_own_cache, sampling_probs, stream
from ..prompt import fit_prompt
from .. import memory
from ..memory import architecture_notes, described, engine_runs, kv_beside_gpt2, memory_needs, parameter_table
from ..formats import download
from ..kinds import describe
from ..formats.gguf import gguf_dtype_note
from ..formats.source import QUANTIZED
from ..model import INIT_SCHEMES
from .common import (add_model_args, add_special_arg, check_prompt, encode_prompt, load, nonneg_int, open_model,
                     positive_int, probability, require_language_model, special_reading, temperature)
from .limits import MAX_TEMPERATURE, MIN_TEMPERATURE
from .progress import Heartbeat, duration


def runs_kernels(cfg) -> bool:
    """Whether the engine's kernels run a model of `cfg` (memory.engine_runs, from its description): GPT-2's
    block; a rotary model (Qwen3, Llama 3.2, Gemma 3, OLMo 3, Tiny Aya, ...) or a chapter-4 variant runs its
    glass code only, with no kernels to choose."""
    return engine_runs(described(cfg)[0])


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt, streaming the new text")
    p.add_argument("prompt")
    add_model_args(p, quantized=True)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model where it pays for this command's length: skipped, with a note "
                        "saying why, where the native step decodes or where compiling (measured the first time it "
                        "runs here, kept with the autotune's choices) costs more than it saves over "
                        "--max-new-tokens; the compiled code is kept in ~/.cache/glassgpt/inductor for later "
                        "processes (default: off)")
    p.add_argument("--max-new-tokens", type=nonneg_int, default=50, help="tokens to add to the prompt (default: 50)")
    p.add_argument("--temperature", type=temperature, default=0.0,
                   help="divide the logits by this before sampling; 0 takes the most likely token, greedy; else "
                        f"from {MIN_TEMPERATURE:g} (below it float32 logits overflow) to {MAX_TEMPERATURE:g} (default: 0)")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="sample among the K most likely tokens only (default: all of them)")
    p.add_argument("--top-p", type=probability, default=None,
                   help="sample among the fewest tokens whose probabilities add up to P (default: 1, all of them)")
    p.add_argument("--stop-at-eos", action="store_true", help="stop at <|endoftext|>")
    add_special_arg(p)
    p.add_argument("--json", action="store_true",
                   help='print {"prompt_ids", "new_ids", "text"} instead of streaming (and "seen" and "note" when '
                        'the prompt is longer than context_length: what the model saw of it)')
    p.add_argument("--show-choices", type=positive_int, nargs="?", const=5, default=None, metavar="K",
                   help="at each new token, the K most likely candidates after the temperature and the top-k/top-p "
                        "cuts, with their probabilities, and the one drawn (default K: 5; off unless given)")
    p.add_argument("--check-against", metavar="DATA",
                   help="a text file (the training data): list the longest spans of the output found in it word for "
                        "word, to see what the model recites (default: off)")
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


def report_kernels(cfg, precision: str, device) -> autotune.Choices | None:
    """Say on stderr which kernels this machine runs for the model (measured once, then cached); CPU only."""
    if device.type != "cpu":
        return None
    choices = autotune.choose(cfg, precision)
    print(autotune.describe(choices, cfg), file=sys.stderr)
    return choices


def run_generate(args: argparse.Namespace) -> int:
    check_prompt(args.prompt)
    data = _read_data(args.check_against) if args.check_against else None
    timing = Timing()
    # The prompt's UTF-8 bytes bound its tokens: memory is checked before the tokenizer or model is loaded.
    # int8 and int4: loaded in bfloat16 and quantized by Source.load.
    start = timing.clock()
    model, tok = load(args, tokens=len(args.prompt.encode("utf-8")) + args.max_new_tokens,
                      new_tokens=args.max_new_tokens)
    timing.load_s = timing.clock() - start
    require_language_model(model, args.model)
    start = timing.clock()
    if runs_kernels(model.cfg):  # Qwen3, Llama, Gemma, OLMo, Aya and the variants run their glass code: no kernels
        report_kernels(model.cfg, autotune.precision_of(model), model.tok_emb.weight.device)
    measure = None  # where a compile runs: what it costs and saves is measured, for the next command
    if args.compile:
        model, measure = compile_if_it_pays(model, args.max_new_tokens)
    timing.tune_s = timing.clock() - start
    allowed, special_note = special_reading(tok, args.prompt, args.allow_special)
    if special_note:
        print(f"note: {special_note}", file=sys.stderr)
    prompt_ids = encode_prompt(tok, args.prompt, allowed)
    seen = fit_prompt(prompt_ids, model.cfg.context_length)  # what the model sees of it at the first step
    if seen.note:
        print(f"note: {seen.note}; then the window slides along with each new token", file=sys.stderr)
    choices: list[dict] = []
    on_pick = _choice_recorder(choices, tok, args) if args.show_choices else None
    if args.max_new_tokens >= LONG_GENERATION and not args.compile:
        print(f"note: {estimate_line(model, len(prompt_ids), args.max_new_tokens)}", file=sys.stderr)
    steps = stream(model, prompt_ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   eos_id=tok.eot_id if args.stop_at_eos else None, seed=args.seed, on_pick=on_pick, timing=timing)
    arrivals: list[float] = []  # perf_counter at each new token, for a compile's measurement
    if measure is not None:
        steps = _clocked(steps, arrivals)
    # Streamed to a terminal, the text is its own progress; anywhere else a line at least every 10 s.
    beat = None if not (args.json or args.show_choices) and sys.stdout.isatty() else \
        Heartbeat("generate", "token", args.max_new_tokens)
    t0 = time.perf_counter()
    if args.json or args.show_choices:
        new_ids = []
        for i in steps:
            new_ids.append(int(i[0]))
            if beat:
                beat(len(new_ids))
    else:
        new_ids = []
        _stream_text(args.prompt, tok, steps, new_ids, beat)
    seconds = time.perf_counter() - t0
    if measure is not None and len(arrivals) >= 2:
        measure(arrivals[1] - t0, min(model.cfg.context_length, len(prompt_ids) + args.max_new_tokens))
    if new_ids:
        print(timing_line(timing, len(new_ids), seconds), file=sys.stderr)
    spans = copied_spans([tok.decode([i]) for i in prompt_ids + new_ids], data, len(prompt_ids)) \
        if data is not None else None
    if args.json:
        out = {"prompt_ids": prompt_ids, "new_ids": new_ids, "text": tok.decode(prompt_ids + new_ids)}
        if seen.note:
            out.update(seen={"from": seen.start, "tokens": len(seen.ids)}, note=seen.note)
        if choices:
            out["choices"] = choices
        if spans is not None:
            out["check_against"] = {"data": args.check_against, "spans": [sp.to_dict() for sp in spans]}
        print(json.dumps(out, ensure_ascii=False))
        return 0
    if args.show_choices:
        _print_choices(args, tok, prompt_ids, new_ids, choices)
    if spans is not None:
        _print_spans(args.check_against, spans, len(prompt_ids) + len(new_ids))
    return 0


def timing_line(timing: Timing, new: int, seconds: float) -> str:
    """One line: the set-up (load, this machine's measurements or their cache, the prompt) apart from the decoding
    rate, so that a cold command's figure is not read as the model's speed."""
    tune = (f"measuring this machine {timing.tune_s:.2f} s ({len(timing.measured)} choices, kept for the next "
            "command)") if timing.measured else f"engine and plan {timing.tune_s:.2f} s (measurements read from the cache)"
    setup = (f"set-up {timing.setup_s:.2f} s: loading {timing.load_s:.2f} s, {tune}, prompt {timing.prefill_s:.2f} s")
    rate = timing.decode_rate
    decode = f"decoding {timing.decoded:,} tokens at {rate:,.1f} tokens/s" if rate is not None else \
        "no decoding step (the first token comes from the prompt)"
    return f"generated {new:,} tokens in {timing.load_s + timing.tune_s + seconds:.2f} s; {setup}; {decode}"


def compile_if_it_pays(model, new_tokens: int):
    """(the model to generate with, a measure(seconds to the second token, cache length) to call after a compile
    that ran, or None): `model` compiled where compiling pays for `new_tokens` new
    tokens (engine/compiling.py decides, from what it measured here), with a note on stderr saying why or
    why not. Off the CPU, and for Qwen3 and Llama, it compiles as asked."""
    if keeps_own_cache(model):  # chapter 4's variants: the repository's forward(ids, use_cache) decodes
        print(f"note: --compile skipped: {describe(model).name} keeps its own KV cache and decodes through its own "
              "forward (the repository's use_cache API), which the engine does not compile", file=sys.stderr)
        return model, None
    if not runs_kernels(model.cfg) or model.tok_emb.weight.device.type != "cpu":
        return compile_for_generation(model), None
    engine = as_engine(model)
    choices = engine.choices
    if choices is None:  # (float16 on a CPU: nothing chosen, nothing measured)
        return compile_for_generation(engine), None
    native = autotune.native_step_chosen(engine, KVCache(engine.cfg, 1, 4, dtype=model.tok_emb.weight.dtype))
    decision = compiling.decide(choices.ms.get(compiling.COMPILE), native, new_tokens, choices.ms.get("step"))
    print(f"note: {decision.note}", file=sys.stderr)
    if not decision.compile:
        return engine, None
    engine = compile_for_generation(engine)

    def measure(to_second_token: float, max_len: int) -> None:
        steps = compiling.measure_steps(engine, max_len)
        compiling.remember(choices, to_second_token - 2 * steps["compiled"] / 1e3, steps)
    return engine, measure


def _clocked(steps, arrivals: list[float]):
    """`steps`, noting the time each new token arrives in `arrivals`."""
    for i in steps:
        arrivals.append(time.perf_counter())
        yield i


def _stream_text(prompt: str, tok, steps, new_ids: list[int], beat=None) -> None:
    """Print the prompt, then each new token's text as it comes (whole characters only)."""
    def ids():
        for i in steps:
            new_ids.append(int(i[0]))
            if beat:
                beat(len(new_ids))
            yield new_ids[-1]

    sys.stdout.write(prompt)
    sys.stdout.flush()
    for text in decode_stream(tok, ids()):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")


LONG_GENERATION = 1000  # new tokens from which generate times one step first and says how long it will take


def estimate_line(model, n_prompt: int, n_new: int) -> str:
    """How long `n_new` tokens after `n_prompt` will take, from one step of each kind timed now: a token
    decoded through the KV cache while the sequence fits in context_length, and past it (the window
    slides) a whole window prefilled again for every token."""
    ctx = glass_model(model).cfg.context_length
    cached = max(0, min(n_new, ctx - n_prompt))
    sliding = n_new - cached

    def timed(prompt_len: int, new: int) -> float:
        t0 = time.perf_counter()
        for _ in stream(model, [0] * prompt_len, new):
            pass
        return time.perf_counter() - t0

    decode = (timed(1, 5) - timed(1, 1)) / 4 if cached else 0.0
    refill = timed(ctx, 1) if sliding else 0.0
    seconds = cached * max(decode, 0.0) + sliding * refill
    where = (f"{cached:,} through the KV cache at {1 / max(decode, 1e-9):,.0f} tokens/s" if cached else "") + \
        (" and " if cached and sliding else "") + \
        (f"{sliding:,} past context_length {ctx:,}, each re-reading the window at {1 / max(refill, 1e-9):,.1f} tokens/s"
         if sliding else "")
    return f"{n_new:,} new tokens will take about {duration(seconds)} ({where}, timed here just now); Ctrl-C stops"


def _choice_recorder(choices: list[dict], tok, args: argparse.Namespace):
    """on_pick for `stream`: each step's K best candidates after the cuts, and the one drawn."""
    temperature = args.temperature or 1.0  # greedy takes the largest of softmax(logits)

    def on_pick(logits, next_id) -> None:
        probs = sampling_probs(logits[:1], temperature, args.top_k, args.top_p)[0]  # the first row: [V]
        top = probs.topk(min(args.show_choices, probs.numel()))
        drawn = int(next_id[0])
        choices.append({"step": len(choices) + 1, "id": drawn, "text": tok.decode([drawn]),
                        "prob": float(probs[drawn]), "rank": int((probs > probs[drawn]).sum()) + 1,
                        "top": [{"id": int(i), "text": tok.decode([int(i)]), "prob": float(p)}
                                for p, i in zip(top.values, top.indices)]})
    return on_pick


def _print_choices(args: argparse.Namespace, tok, prompt_ids: list[int], new_ids: list[int], choices: list[dict]) -> None:
    cuts = [f"temperature {args.temperature:g}" if args.temperature else "greedy (the largest of softmax(logits))"]
    if args.top_k:
        cuts.append(f"top-k {args.top_k}")
    if args.top_p:
        cuts.append(f"top-p {args.top_p:g}")
    print(args.prompt)
    print(f"{'step':>4}  {'drawn':<16} {'p':>7} {'rank':>5}   the {args.show_choices} likeliest after {', '.join(cuts)}")
    for ch in choices:
        cands = " · ".join(f"{c['text']!r} {c['prob']:.4f}" for c in ch["top"])
        print(f"{ch['step']:>4}  {ch['text']!r:<16} {ch['prob']:>7.4f} {ch['rank']:>5}   {cands}")
    print(tok.decode(prompt_ids + new_ids))


def _read_data(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except IsADirectoryError:
        raise GlassError(f"--check-against {path} is a directory: give the training text file") from None


def _print_spans(path: str, spans, n_tokens: int) -> None:
    if not spans:
        print(f"found in {path}: no span of {MIN_TOKENS} or more tokens that the model generated")
        return
    print(f"found in {path} word for word (the longest spans of the {n_tokens} tokens, each with a generated token):")
    for sp in spans:
        print(f"  tokens {sp.start}..{sp.end - 1} ({sp.end - sp.start} tokens, {sp.new_tokens} generated), "
              f"line {sp.line}: {sp.text!r}")


def run_info(args: argparse.Namespace) -> int:
    # From the config alone: gpt2-xl's table needs no 6 GB of weights (a hub id is fetched, not loaded).
    source = open_model(args)
    cfg = source.config
    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype in QUANTIZED else resolve_dtype(args.dtype, device)
    precision = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if precision == "int4":
        check_group_size(cfg)
    glass_only = not runs_kernels(cfg)  # Qwen3, Llama 3.2, Gemma 3, the variants, ...: no kernels to choose
    here = fit_here(cfg, dtype, args.batch_size, args.seq_len or cfg.context_length, memory.available_memory(device))
    # (the kernels are timed on one layer of the model's shapes: not for a model that this machine cannot run)
    choices = autotune.choose(cfg, precision) if device.type == "cpu" and precision in autotune.PRECISIONS \
        and not glass_only and here["inference"]["fits"] else None
    rows = parameter_table(cfg)
    mem = memory_needs(cfg, dtype, args.batch_size, args.seq_len,
                       prompt_attention=choices.winners.get("attention prompt", "sdpa") if choices else "sdpa")
    notes = architecture_notes(cfg) or [str(note) for note in source.notes()] + [  # (rotary models: theirs)
        n for n in (layout_note(cfg), kv_beside_gpt2(cfg, dtype)) if n]
    if source.random_weights:
        notes.insert(0, f"random weights drawn by {INIT_SCHEMES[source.init]}" if source.init else
                     "random weights: N(0, 0.02) matrices, norms at 1 (glassgpt.families.random_family_model)")
    elif source.kind == "gguf":
        notes.insert(0, gguf_dtype_note(source.name))
    advice = None
    if choices:  # the dtype and flags to use here, from what each precision measured on this machine
        measured = {p: choices if p == precision else autotune.recorded(cfg, p) for p in autotune.PRECISIONS}
        advice = advise(cfg, precision, cpu_flags(), measured, None if native.load() is not None else native.status(),
                        gemv=native.gemv_ops() is not None)
    if args.json:
        kernels = {"machine": choices.machine, "chosen": choices.winners, "ms": choices.ms} if choices else None
        print(json.dumps({"config": cfg.to_dict(), "notes": notes, "parameters": rows, "memory": mem, "here": here,
                          "kernels": kernels, "advice": advice}, indent=2))
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
    print(f"\non this machine ({memory.gib(here['available'])} available, {here['source']}; a run starts where "
          f"{here['margin']} fits)")
    for key in ("inference", "training"):
        verdict = here[key]
        if verdict is not None:
            print(f"  {key:<14} {'fits' if verdict['fits'] else 'does not fit'}: {verdict['line']}")
    if choices:
        print(f"\n{autotune.describe(choices, cfg)}")
        print("\non this CPU")
        for line in advice:
            print(f"  {line}")
    return 0


def fit_here(cfg, dtype, batch_size: int, seq_len: int, free: memory.Free) -> dict:
    """What `generate` and `train` would decide on this machine for `cfg` (memory.inference_fit and training_fit,
    the checks they run before loading): the figure each compares, with its margin, and the verdict in words."""
    def verdict(need: int, check) -> dict:
        try:
            note = check()
        except ConfigError as e:
            return {"need": need, "with_margin": memory.with_margin(need), "fits": False, "line": str(e)}
        line = note or f"{memory.gib(need)}, {memory.gib(memory.with_margin(need))} with the margin"
        return {"need": need, "with_margin": memory.with_margin(need), "fits": True, "line": line}

    tokens = min(seq_len, cfg.context_length)
    here = {"available": free.ram, "swap": free.swap, "source": free.source, "margin": memory.MARGIN,
            "inference": verdict(memory.inference_need(cfg, dtype, tokens),
                                 lambda: memory.inference_fit(cfg, dtype, tokens, free)),
            "training": None}
    if dtype not in QUANTIZED:
        need = memory_needs(cfg, dtype, batch_size, tokens)["training"]
        here["training"] = verdict(need, lambda: memory.training_fit(cfg, dtype, batch_size, tokens, free))
    return here


def run_download(args: argparse.Namespace) -> int:
    path = download(args.repo_id, progress=True)
    print(path)
    return 0
