"""`glassgpt train`, `glassgpt eval`, `glassgpt plot`, `glassgpt tokenizer train`.

    glassgpt train --data PATH --out RUN_DIR [--tokenizer gpt2|char|FILE]
                   [--model SPEC | --n-layers N --n-heads H --emb-dim D --context-length T]
                   [--init SPEC] [--drop-rate P] [--recipe glassgpt|book] [--epochs N] [training flags]
    glassgpt train --resume RUN_DIR [--max-steps S]
    glassgpt eval --model SPEC --data PATH [--split val|train] [--recipe book]
    glassgpt plot RUN_DIR

The run's lifecycle (its directory claimed once, resume, fit, the signals) is cli/run.py's,
shared with `glassgpt finetune`; here is what `train` trains: the model, the tokenizer and
the task, glassgpt's random windows (training/tasks/data.py) or the book's loaders (training/book/ch05.py).
A run records its data as absolute paths (the token cache relative to the run directory) with
the data's fingerprint, so `--resume` works from any directory and refuses data that changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from .. import formats
from ..config import PRESETS, init_scheme
from ..families import FAMILY_PRESETS as PRESETS_OF_FAMILIES
from ..engine import native
from ..errors import GlassError
from ..formats import get_config
from ..formats.files import atomic_write
from ..tokenizer import ENDOFTEXT, check_fits, get_tokenizer, train_bpe
from ..training import TrainConfig, plot_run, read_metrics
from ..training import evaluation, recipes
from ..training.book import ch05 as book
from ..training.loop.compute import with_dropout
from ..training.loop.config import SMALL_TEXT_FINDING, default, runs_as_book
from ..training.tasks.data import build_tokenizer, resolve_files, scan_file
from ..training.loop.metrics import snapshot_records
from ..training.loop.rundir import saved_train_config
from .common import (N_HEADS_HELP, add_source_args, add_special_arg, add_threads_arg, check_training_memory, fraction,
                     open_model, positive_int, require_language_model, say, seed, set_threads)
from .run import (Prepared, Start, add_train_args, check_evaluation_sizes, given_flags, run_training, stoppable,
                  train_config_from_args)

DTYPE_CHOICES = ["float32", "bfloat16", "float16", "auto"]
MODEL_FLAGS = ("data", "tokenizer", "model", "init", "n_layers", "n_heads", "emb_dim", "context_length",
               "drop_rate", "val_fraction", "cache_dir", "sample_prompt", "stride", "recipe", "allow_special")
BOOK_DROP_RATE = 0.1  # GPT_CONFIG_124M's: what a state dict, which cannot record it, is assumed to have trained with


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="pretrain a GPT on your text (also under torchrun)",
                       description="Train a GPT from scratch (or from --init weights) on text files. --recipe book "
                                   "trains as the book's chapter 5 does and prints its numbers.")
    p.add_argument("--data", metavar="PATH", help="a UTF-8 text file, a folder of .txt files, or a quoted glob "
                                                  "(required for a new run)")
    p.add_argument("--tokenizer", metavar="gpt2|char|FILE",
                   help="gpt2 (default), char (the characters of the data), or a tokenizer .json "
                        "(glassgpt tokenizer train); with --init: the checkpoint's")
    p.add_argument("--model", metavar="SPEC",
                   help=f"architecture to start from: a preset ({', '.join(PRESETS)}) or a config .json; "
                        "random weights, the *-book presets drawn as the book's GPTModel draws them (default gpt2, "
                        "with the flags below overriding)")
    p.add_argument("--init", metavar="SPEC", help="start from these weights instead: checkpoint, run directory, the "
                                                  "book's model.pth, the gpt2/124M folder, or a hub id such as "
                                                  "openai-community/gpt2 (default: random weights)")
    p.add_argument("--n-layers", type=positive_int, metavar="N", help="transformer blocks (default: the --model's)")
    p.add_argument("--emb-dim", type=positive_int, metavar="D", help="embedding width (default: the --model's)")
    add_source_args(p, context_length="tokens per training window (default: the --model's, at most --init's)",
                    n_heads="attention heads per block (default: the --model's); with --init: " + N_HEADS_HELP,
                    drop_rate=f"dropout (default: the preset's; a .pth state dict, which cannot record it: "
                              f"{BOOK_DROP_RATE}, the book's)", tokenizer=False)
    p.add_argument("--val-fraction", type=fraction, help="share held out at the end (default 0.1: of the tokens; "
                                                         "--recipe book: of the characters, as the notebook splits)")
    p.add_argument("--stride", type=positive_int, metavar="N",
                   help="--recipe book: tokens between the starts of two windows (default: --context-length)")
    p.add_argument("--cache-dir", metavar="DIR", help="where tokenized data is cached (default RUN_DIR/cache)")
    p.add_argument("--sample-prompt", metavar="TEXT",
                   help="prompt of the samples and snapshots at each evaluation (default: the first tokens of the "
                        f"val split; --recipe book: {book.START_CONTEXT!r})")
    add_special_arg(p, "the training text (between files it is added as that token either way; --recipe book "
                       "reads it so always, as the book's code does)")
    add_train_args(p, epochs="none, --max-steps says; --recipe book: 10, the book's",
                   choices={"recipe": recipes.names("train")})
    p.set_defaults(run=run_train)
    _add_eval_parser(sub)

    p = sub.add_parser("plot", help="draw the loss and the snapshots' next tokens against tokens seen (RUN_DIR/loss.png)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory")
    p.add_argument("--out", metavar="PNG", help="where to write the plot (default RUN_DIR/loss.png)")
    p.set_defaults(run=run_plot)

    p = sub.add_parser("tokenizer", help="learn a byte-level BPE from your text")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="COMMAND", parser_class=type(p))
    tsub.required = True
    t = tsub.add_parser("train", help="learn a BPE of --vocab-size tokens and save it as JSON")
    t.add_argument("--data", required=True, metavar="PATH", help="text file, folder of .txt files or quoted glob "
                                                                 "(required)")
    t.add_argument("--vocab-size", required=True, type=positive_int,
                   help="tokens, <|endoftext|> included (>= 257; required)")
    t.add_argument("--out", required=True, metavar="FILE", help="e.g. tokenizer.json, to use with --tokenizer FILE "
                                                                "(required)")
    t.set_defaults(run=run_tokenizer_train)


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="loss and perplexity of a model on a text",
                       description="Loss and perplexity on the validation windows that training uses: "
                                   "batch-size x eval-batches windows, evenly spaced over the split; with "
                                   "--recipe book, every window of the book's loaders, as calc_loss_loader does.")
    p.add_argument("--model", required=True, metavar="SPEC", help="run directory, checkpoint, the book's model.pth, "
                                                                  "preset or hub id (required)")
    p.add_argument("--data", required=True, metavar="PATH", help="text file, folder of .txt files or quoted glob "
                                                                 "(required)")
    p.add_argument("--tokenizer", metavar="gpt2|char|FILE", help="default: the model's (gpt2 for presets)")
    p.add_argument("--split", choices=["val", "train"], default="val", help="which part of the data (default val)")
    p.add_argument("--recipe", choices=recipes.names("train"), default="glassgpt",
                   help="glassgpt: the evenly spaced windows training evaluates; book: the book's loaders, every "
                        "window at --stride from the start (default glassgpt)")
    p.add_argument("--val-fraction", type=fraction, help="default: the run's, else 0.1")
    add_source_args(p, context_length="window length (default: the run's or the model's)", tokenizer=False)
    p.add_argument("--stride", type=positive_int, help="--recipe book: tokens between windows (default: the context length)")
    p.add_argument("--batch-size", type=positive_int, help="default: the run's, else 8 (--recipe book: 2)")
    p.add_argument("--eval-batches", type=positive_int,
                   help="default: the run's, else the windows that score each token once (at most 20 batches)")
    p.add_argument("--seed", type=seed, default=None,
                   help=f"--recipe book: torch.manual_seed before the shuffled loader (default {recipes.recipe('train', recipes.BOOK).defaults['seed']})")
    p.add_argument("--cache-dir", metavar="DIR", help="where tokenized data is cached (default $XDG_CACHE_HOME/glassgpt/tokens, "
                                                        "~/.cache/glassgpt/tokens without it)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="autocast precision (default float32)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: one line of text)")
    add_threads_arg(p)
    p.set_defaults(run=run_eval)


# --- train ------------------------------------------------------------------------------

@stoppable
def run_train(args: argparse.Namespace) -> int:
    if not args.resume and (not args.data or not args.out):
        raise GlassError("glassgpt train needs --data PATH and --out RUN_DIR (or --resume RUN_DIR)")
    return run_training(args, "glassgpt train", _setup, _report)


def _setup(args: argparse.Namespace, start: Start):
    prepared = (_resume_setup if start.checkpoint else _new_setup)(args, start)
    model, task, cfg = prepared.model, prepared.task, prepared.cfg
    c, world = model.cfg, start.ranks.world
    say(f"model: {c.n_layers} layers, {c.n_heads} heads, emb_dim {c.emb_dim}, context {c.context_length}, "
        f"vocab {c.vocab_size:,}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    accum = "auto" if cfg.batch_tokens else cfg.grad_accum
    say(f"batch: {cfg.batch_size} x {task.context_length} tokens x {accum} accumulation x {world} rank(s); "
        f"{cfg.max_steps:,} steps, lr {cfg.lr:g}, {cfg.dtype}" + (", the book's recipe" if runs_as_book(cfg) else ""))
    return prepared


def _report(result: dict, cfg: TrainConfig, task, tokenizer, model) -> None:
    val, run_dir = result["val_loss"], cfg.out
    summary = f"done: step {result['step']:,}, {result['tokens']:,} tokens"
    if val is not None:
        best = result["best_val_loss"]
        ppl = f"perplexity {result['val_ppl']:.2f}" if result["val_ppl"] is not None else "perplexity overflows"
        summary += f", val loss {val:.4f} ({ppl})" + (f", best {best:.4f}" if best else "")
    say(summary + f", {result['elapsed_s']:.0f} s of training")
    say(f"model: {run_dir}   try: glassgpt generate \"...\" --model {run_dir}   |   "
        f"glassgpt explain \"...\" --model {run_dir}")
    if result["plot"]:
        say(f"plot: {result['plot']}")


def _new_setup(args: argparse.Namespace, start: Start):
    recipe = recipes.recipe("train", args.recipe)
    _check_recipe_flags(args, recipe, start.ranks.world)
    files = resolve_files(args.data)
    cfg = recipe.train_config({f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainConfig)},
                              {"out": args.out})
    model, tokenizer, context = _model_and_tokenizer(args, files, recipe, cfg)
    data = {"path": os.path.abspath(args.data), "files": len(files), "recipe": recipe.name,
            "val_fraction": args.val_fraction if args.val_fraction is not None else 0.1,
            "cache_dir": os.path.abspath(args.cache_dir) if args.cache_dir else "cache",
            "context_length": context, "stride": args.stride or context, "sample_prompt": args.sample_prompt}
    if args.allow_special:  # (recorded only when given: a resume reads the text as the run did)
        if tokenizer.eot_id is None:
            raise GlassError(f"--allow-special reads {ENDOFTEXT} as its token, and the {tokenizer.name} tokenizer has "
                             "none: drop --allow-special")
        data["allow_special"] = True
        say(f"note: {ENDOFTEXT} written in the training text is read as the token {tokenizer.eot_id} "
            "(--allow-special), as it is between files", file=sys.stderr)
    task, data["fingerprint"], line = recipe.task(files, tokenizer, data, cfg, Path(args.out))
    say(line)
    notebook = book.next_model_notebook(recipe, model.cfg)
    cfg = _with_epochs(args, cfg, task, start.ranks.world, default=notebook.epochs if notebook else recipe.epochs)
    if recipe.settle:
        cfg = recipe.settle(cfg, task.steps_per_epoch)
    if not recipe.seeds_globally and len(task.train) < SMALL_TEXT_WINDOWS * task.context_length:
        say(f"note: {small_text_note(len(task.train), task.context_length)}", file=sys.stderr)
    meta = {"data": data, "tokenizer": args.tokenizer or ("checkpoint" if args.init else "gpt2"), "init": args.init}
    return Prepared(model, tokenizer, task, cfg, meta, recipe)


SMALL_TEXT_WINDOWS = 1000  # a training split under this many windows' worth of tokens is small enough to memorise


def small_text_note(tokens: int, context: int) -> str:
    return (f"the training split is {tokens:,} tokens, {tokens / context:,.0f} windows of {context}: on a text "
            f"this small, {SMALL_TEXT_FINDING}")


def _model_and_tokenizer(args: argparse.Namespace, files: list[Path], recipe: recipes.Recipe, cfg: TrainConfig):
    """(model, tokenizer, context length) for a new run: --init's weights (--n-heads and --drop-rate for a state
    dict), or a random --model; either once its training is known to fit in the memory available
    (check_training_memory)."""
    arch = [f for f in ("model", "n_layers", "emb_dim") if getattr(args, f) is not None]
    if args.init and arch:
        raise GlassError(f"--init loads a model with its own architecture; drop --{arch[0].replace('_', '-')}")
    if not args.init:
        if args.model and Path(args.model).is_dir():
            raise GlassError(f"--model takes an architecture (a preset or a config .json); to start from the "
                             f"weights in {args.model}, pass --init {args.model}")
        tokenizer = build_tokenizer(args.tokenizer or "gpt2", files)
        seed = args.seed if args.seed is not None else recipe.defaults.get("seed", default("seed"))
        notebook = book.next_model_notebook(recipe, get_config(args.model or "gpt2"))
        if notebook is not None:
            return _as_the_notebook(args, notebook, tokenizer, recipe, cfg, seed)
        gcfg = get_config(args.model or "gpt2", vocab_size=tokenizer.n_vocab, n_layers=args.n_layers,
                          n_heads=args.n_heads, emb_dim=args.emb_dim, context_length=args.context_length,
                          drop_rate=args.drop_rate)
        check_training_memory(gcfg, cfg.dtype, cfg.batch_size, gcfg.context_length, args.device)
        return recipe.new_model(gcfg, init_scheme(args.model or "gpt2"), seed), tokenizer, gcfg.context_length
    source = open_model(args, spec=args.init, window=True)  # --n-heads, --drop-rate, --context-length: its own
    init_cfg = source.config_before_weights()  # a Qwen3/Llama hub id's: its config.json alone
    if init_cfg is not None:
        check_training_memory(init_cfg, cfg.dtype, cfg.batch_size, args.context_length or init_cfg.context_length,
                              args.device, model_flags=False)
    model = source.load("cpu", "float32")
    tokenizer = build_tokenizer(args.tokenizer, files) if args.tokenizer else source.tokenizer()
    check_fits(tokenizer, model.cfg.vocab_size, f"use {args.init}'s own tokenizer (drop --tokenizer)")
    drop_rate = args.drop_rate
    if drop_rate is None and source.assumed("drop_rate"):
        drop_rate = BOOK_DROP_RATE
        say(f"note: {args.init} is a state dict, which cannot record dropout: training assumes drop_rate "
            f"{BOOK_DROP_RATE}, the book's GPT_CONFIG_124M (--drop-rate P to change)", file=sys.stderr)
    if drop_rate is not None:
        model = with_dropout(model, drop_rate)
    recipe.seed_before_training(args.seed if args.seed is not None else recipe.defaults.get("seed", default("seed")))
    context = args.context_length or model.cfg.context_length
    if context > model.cfg.context_length:
        raise GlassError(f"--context-length {context} is longer than {args.init}'s context_length "
                         f"{model.cfg.context_length}: give at most {model.cfg.context_length}")
    return model, tokenizer, context


def _as_the_notebook(args: argparse.Namespace, notebook: book.Notebook, tokenizer, recipe: recipes.Recipe,
                     cfg: TrainConfig, seed: int):
    """(model, tokenizer, window) for chapter 5 with Qwen3 or Llama 3.2, as ch05/14_ch05_with_other_llms
    runs it: the model keeps its context_length and vocabulary (the windows are `train_context_length`,
    --context-length), its own out_head, and the book's `torch.manual_seed(seed)` then the model."""
    base = get_config(args.model)
    if tokenizer.n_vocab > base.vocab_size:
        raise GlassError(f"the {tokenizer.name} tokenizer has {tokenizer.n_vocab:,} tokens, more than {args.model}'s "
                         f"vocab_size {base.vocab_size:,}: give a config .json with a larger vocab_size")
    overrides = {"n_layers": args.n_layers, "n_heads": args.n_heads, "emb_dim": args.emb_dim,
                 "drop_rate": args.drop_rate}
    if not args.tokenizer:  # GPT-2's tokenizer, not the model's own: its 50,257 rows (the model's would never be read)
        overrides["vocab_size"] = tokenizer.n_vocab
    if str(args.model) in PRESETS_OF_FAMILIES:  # the notebook's Qwen3Model / Llama3Model: out_head of its own
        overrides["tie_embeddings"] = False
    gcfg = get_config(args.model, **overrides)
    window = args.context_length or notebook.window
    if window > gcfg.context_length:
        raise GlassError(f"--context-length {window:,} is longer than {args.model}'s context_length "
                         f"{gcfg.context_length:,}: give at most {gcfg.context_length:,}")
    check_training_memory(gcfg, cfg.dtype, cfg.batch_size, window, args.device)
    say(f"note: {notebook.describe(gcfg, window, cfg.dtype, args.tokenizer or 'gpt2', seed)}", file=sys.stderr)
    return recipe.new_model(gcfg, init_scheme(args.model), seed), tokenizer, window


def _check_recipe_flags(args: argparse.Namespace, recipe: recipes.Recipe, world: int) -> None:
    recipe.refuse_flags(vars(args))
    if world > 1 and recipe.one_process:
        raise GlassError(f"--recipe {recipe.name} trains in one process, as the book's code does: run it without "
                         "torchrun")


def _with_epochs(args: argparse.Namespace, cfg: TrainConfig, task, world: int, default: float | None) -> TrainConfig:
    """max_steps from --epochs (or the recipe's default epochs when --max-steps is not given)."""
    epochs = args.epochs if args.epochs is not None else (default if args.max_steps is None else None)
    if epochs is None:
        return cfg
    per_epoch = task.steps_per_epoch if isinstance(task, book.BookTask) else task.steps_per_epoch(cfg.grad_accum, world)
    return dataclasses.replace(cfg, max_steps=max(1, math.ceil(epochs * per_epoch)))


def _resume_setup(args: argparse.Namespace, start: Start):
    given = given_flags(args, MODEL_FLAGS)
    if given:
        raise GlassError(f"--resume continues a run with its own data and model: drop {given[0]} "
                         "(training flags such as --max-steps may change)")
    cfg = train_config_from_args(args, start.saved)
    source = formats.open(start.checkpoint)
    meta = dict(source.meta)
    meta.pop("train", None)
    data = meta.get("data")
    if not data:
        raise GlassError(f"{start.checkpoint}/meta.json does not say what data the run trained on: it was not "
                         "made by glassgpt train")
    saved_cfg = source.config
    check_training_memory(saved_cfg, cfg.dtype, cfg.batch_size, data.get("context_length") or saved_cfg.context_length,
                          cfg.device, model_flags=False)
    model, tokenizer = source.load("cpu", "float32"), source.tokenizer()
    recipe = recipes.recipe("train", data.get("recipe"))
    _check_recipe_flags(args, recipe, start.ranks.world)
    task, _, line = recipe.task(resolve_files(data["path"]), tokenizer, data, cfg, start.run_dir.path,
                                data.get("fingerprint"))
    say(line)
    return Prepared(model, tokenizer, task, _with_epochs(args, cfg, task, start.ranks.world, None), meta, recipe)


# --- eval, plot, tokenizer --------------------------------------------------------------

@stoppable
def run_eval(args: argparse.Namespace) -> int:
    check_evaluation_sizes(args)
    source = open_model(args, window=True)
    run_cfg, run_data = _run_settings(source)
    model = source.load(args.device, "float32")
    require_language_model(model, args.model)
    set_threads(args.threads, model.cfg.emb_dim)
    files = resolve_files(args.data)
    tokenizer = build_tokenizer(args.tokenizer, files) if args.tokenizer else source.tokenizer()
    check_fits(tokenizer, model.cfg.vocab_size)
    context = args.context_length or run_data.get("context_length") or model.cfg.context_length
    if context > model.cfg.context_length:
        raise GlassError(f"--context-length {context} is longer than the model's {model.cfg.context_length}")
    val_fraction = args.val_fraction if args.val_fraction is not None else run_data.get("val_fraction", 0.1)
    if recipes.recipe("train", args.recipe).chapter == 5:
        result = evaluation.book_split_loss(model, tokenizer, files, context, val_fraction, args.split, args.stride,
                                            args.batch_size, args.seed, args.dtype)
    else:
        result = evaluation.glassgpt_split_loss(
            model, tokenizer, files, context, val_fraction, args.split, args.batch_size or run_cfg.get("batch_size", 8),
            args.eval_batches or run_cfg.get("eval_batches"), args.dtype,
            args.cache_dir or native.cache_dir() / "tokens")
        if source.kind in ("state_dict", "openai") or runs_as_book(run_cfg):
            say("note: these are glassgpt's evaluation windows, evenly spaced over the split; the book scores the "
                "windows its loaders cut (every context_length tokens from the start), the very ones a chapter-5 "
                "model memorised, so it reports a much lower loss: --recipe book scores those", file=sys.stderr)
    if args.json:
        print(json.dumps(result))
    else:
        ppl = f"{result['perplexity']:.2f}" if result["perplexity"] is not None else "overflows (loss >= 700)"
        print(f"{args.split} loss {result['loss']:.4f}   perplexity {ppl}   ({result['windows_text']})")
    return 0


def _run_settings(source: formats.Source) -> tuple[dict, dict]:
    """(train_config, data settings) of the run a checkpoint came from, or ({}, {})."""
    try:
        ckpt = source.dir
    except GlassError:  # a path with no checkpoint in it: loading says so, with the fix
        return {}, {}
    if ckpt is None:
        return {}, {}
    run_dir = ckpt.parent  # (spec is RUN_DIR, or RUN_DIR/best or /latest)
    try:
        run_cfg, note = saved_train_config(run_dir, ckpt)
    except GlassError as e:  # not a run's checkpoint, or its settings are lost: eval's own defaults
        run_cfg, note = {}, (str(e) if (run_dir / "train_config.json").exists() else None)
    if note:
        print(f"note: {note}", file=sys.stderr)
    return run_cfg, source.meta.get("data") or {}


def run_plot(args: argparse.Namespace) -> int:
    path = plot_run(args.run_dir, args.out)
    if path is None:
        raise GlassError("glassgpt plot needs matplotlib: pip install 'glassgpt[plot]'")
    if not snapshot_records(read_metrics(args.run_dir)):
        print(f"note: {args.run_dir} has no snapshots (a run made before glassgpt recorded them, or one without "
              "a sample prompt): the plot shows the loss alone", file=sys.stderr)
    print(path)
    return 0


def run_tokenizer_train(args: argparse.Namespace) -> int:
    files = resolve_files(args.data)
    n_bytes = 0
    for path in files:
        scan_file(path)  # refuses empty, binary and non-UTF-8 files, naming them
        n_bytes += path.stat().st_size
    if args.vocab_size < 257:
        raise GlassError(f"--vocab-size must be at least 257 (256 bytes + <|endoftext|>), got {args.vocab_size}")
    t0 = time.perf_counter()
    tok = train_bpe(files, args.vocab_size)
    seconds = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(tok.to_dict(), ensure_ascii=False)
    atomic_write(out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    sample = files[0].read_text(encoding="utf-8")[:1_000_000]
    ratio = len(sample.encode("utf-8")) / max(1, len(tok.encode(sample)))
    gpt2 = len(sample.encode("utf-8")) / max(1, len(get_tokenizer("gpt2").encode(sample)))
    print(f"learned {tok.n_vocab:,} tokens from {len(files)} file(s) ({n_bytes / 1e6:.1f} MB) in {seconds:.1f} s; "
          f"{ratio:.2f} bytes per token on {files[0].name} (GPT-2's: {gpt2:.2f})")
    print(f"saved {out}: use it with glassgpt train --tokenizer {out}")
    return 0
