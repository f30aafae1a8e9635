"""`glassgpt train`, `glassgpt eval`, `glassgpt plot`, `glassgpt tokenizer train`.

    glassgpt train --data PATH --out RUN_DIR [--tokenizer gpt2|char|FILE]
                   [--model SPEC | --n-layers N --n-heads H --emb-dim D --context-length T]
                   [--init SPEC] [--drop-rate P] [--batch-size B] [--grad-accum K] [--max-steps S]
                   [--lr LR] [--warmup-steps W] [--weight-decay WD] [--eval-every E] [--seed SEED]
                   [--dtype float32|bfloat16] [--compile] [--threads N] ...
    glassgpt train --resume RUN_DIR [--max-steps S]

`add_train_args`, `train_config_from_args` and `stoppable` are shared with `glassgpt
finetune`. A run records its data as absolute paths (the token cache relative to the
run directory) with the data's fingerprint, so `--resume` works from any directory
and refuses data that changed (it could not continue the run exactly).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from ..training.checkpoint import recover_checkpoints, resume_checkpoint
from ..config import PRESETS, init_scheme
from ..engine import autotune
from ..training.data import TextTask, build_tokenizer, resolve_files, scan_file, split_ids, tokenize_files
from ..errors import GlassError
from ..training.rundir import lock_run_dir
from ..tokenizer import check_fits, get_tokenizer, train_bpe
from ..training.loop import TrainConfig, check_out_dir, evaluate_loss, fit, plot_run, saved_train_config
from ..formats import get_config, load_meta, load_model, load_tokenizer, local_checkpoint_dir, random_model
from ..formats.files import atomic_write
from .common import (add_threads_arg, fraction, is_main_rank, nonneg_float, nonneg_int, positive_float, positive_int,
                     require_language_model, say, set_threads)

DTYPE_CHOICES = ["float32", "bfloat16", "float16", "auto"]
MODEL_FLAGS = ("data", "tokenizer", "model", "init", "n_layers", "n_heads", "emb_dim", "context_length",
               "drop_rate", "val_fraction", "cache_dir", "sample_prompt")


def dropout(text: str) -> float:
    value = nonneg_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def add_train_args(p: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                   defaults: dict[str, str] | None = None) -> None:
    """The TrainConfig flags. Defaults are None, so a resumed run knows which were given.

    `defaults` replaces the default that help shows for some flags (finetuning has its own).
    """
    d = TrainConfig(out="-")
    shown = {"batch_size": d.batch_size, "grad_accum": d.grad_accum, "max_steps": f"{d.max_steps}",
             "lr": f"{d.lr:g}", "min_lr": "lr/10", "warmup_steps": d.warmup_steps, "weight_decay": f"{d.weight_decay:g}",
             "grad_clip": f"{d.grad_clip:g}", "beta1": d.beta1, "beta2": d.beta2, "eval_every": d.eval_every,
             "eval_batches": d.eval_batches, "save_every": "at each evaluation", "log_every": d.log_every,
             "sample_tokens": d.sample_tokens, "seed": d.seed, **(defaults or {})}
    flags = [
        ("--out", dict(metavar="RUN_DIR", help="the run directory: checkpoints, metrics.jsonl, loss.png "
                                                "(required for a new run; default with --resume: RUN_DIR)")),
        ("--resume", dict(metavar="RUN_DIR", help="continue RUN_DIR/latest exactly where it stopped (RUN_DIR/best "
                                                   "if latest/ is gone; default: start a new run)")),
        ("--batch-size", dict(type=positive_int, help="sequences per micro-batch and rank (default {batch_size})")),
        ("--grad-accum", dict(type=positive_int, help="micro-batches per optimizer step (default {grad_accum})")),
        ("--batch-tokens", dict(type=positive_int, help="target tokens per optimizer step over all ranks: "
                                                        "sets --grad-accum (default: off)")),
        ("--max-steps", dict(type=positive_int, help="optimizer steps (default {max_steps})")),
        ("--lr", dict(type=positive_float, help="peak learning rate (default {lr})")),
        ("--min-lr", dict(type=nonneg_float, help="learning rate at the end of the cosine (default {min_lr})")),
        ("--warmup-steps", dict(type=nonneg_int, help="linear warm-up steps (default {warmup_steps})")),
        ("--weight-decay", dict(type=nonneg_float, help="AdamW weight decay on matrices (default {weight_decay})")),
        ("--grad-clip", dict(type=nonneg_float, help="clip the gradient norm at this (0: off; default {grad_clip})")),
        ("--beta1", dict(type=fraction, help="AdamW beta1 (default {beta1})")),
        ("--beta2", dict(type=fraction, help="AdamW beta2 (default {beta2})")),
        ("--eval-every", dict(type=positive_int, help="steps between evaluations (default {eval_every})")),
        ("--eval-batches", dict(type=positive_int, help="validation batches per evaluation (default {eval_batches})")),
        ("--save-every", dict(type=positive_int, help="steps between saves of latest/ (default {save_every})")),
        ("--log-every", dict(type=positive_int, help="steps between metrics.jsonl lines (default {log_every})")),
        ("--sample-tokens", dict(type=nonneg_int, help="tokens sampled at each evaluation (default {sample_tokens})")),
        ("--seed", dict(type=nonneg_int, help="seed for initialisation, batches and dropout (default {seed}; "
                                              "a resumed run keeps its own)")),
        ("--dtype", dict(choices=DTYPE_CHOICES, help="compute precision; the weights and AdamW stay float32: "
                                                     "bfloat16 trains a bf16 copy of them (autocast under --fsdp), "
                                                     "float16 autocasts with a grad scaler (CUDA), auto picks "
                                                     "bfloat16 where it measured faster (default float32)")),
        ("--device", dict(help="cpu, cuda, cuda:N or auto (default auto; under torchrun cuda:LOCAL_RANK)")),
    ]
    for flag, kwargs in flags:
        if flag.lstrip("-").replace("-", "_") not in exclude:
            kwargs["help"] = kwargs["help"].format(**shown)
            p.add_argument(flag, default=None, **kwargs)
    if "compile" not in exclude:
        p.add_argument("--compile", action="store_true", default=None, help="torch.compile the model (default: off)")
    if "fsdp" not in exclude:
        p.add_argument("--fsdp", action="store_true", default=None,
                       help="under torchrun: shard the model over the ranks (FSDP2) instead of replicating it "
                            "(default: off)")
    if "plot" not in exclude:
        p.add_argument("--no-plot", dest="plot", action="store_false", default=None,
                       help="do not draw RUN_DIR/loss.png at the end (default: draw it)")
    p.add_argument("--no-progress", action="store_true",
                   help="hide the progress bar (on a terminal) or the progress lines (in a log); the evaluation "
                        "lines and samples still print (default: shown)")
    add_threads_arg(p)


def train_config_from_args(args: argparse.Namespace, base: TrainConfig | dict | None = None) -> TrainConfig:
    """A TrainConfig from the flags given, over `base` (a saved config, or field defaults)."""
    values = dataclasses.asdict(base) if isinstance(base, TrainConfig) else dict(base or {})
    for field in dataclasses.fields(TrainConfig):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
    return TrainConfig.from_dict(values)


# --- signals: a clean exit with the shell's code -------------------------------------------------

class Terminated(KeyboardInterrupt):
    """SIGTERM outside the training loop: unwinds like Ctrl-C, so `finally` blocks remove temp files."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def stoppable(run):
    """Wrap a training command so that every way it stops ends in a line and the shell's exit code.

    In the loop, SIGINT and SIGTERM save latest/ (train.fit) and the command returns
    128 + the signal (130, 143). Before or after it, SIGTERM unwinds like Ctrl-C, so
    temporary files are removed, and exits 143. SIGXFSZ is ignored, so a file-size
    limit (ulimit -f) is an error that names the file rather than a core dump.
    """
    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> int:
        if threading.current_thread() is not threading.main_thread():
            return run(args)
        handlers = {signal.SIGTERM: _raise_terminated}
        if hasattr(signal, "SIGXFSZ"):
            handlers[signal.SIGXFSZ] = signal.SIG_IGN
        old = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            return run(args)
        except Terminated:
            say("terminated (SIGTERM)", file=sys.stderr)
            return 128 + signal.SIGTERM
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    return wrapped


def interrupted_exit(result: dict, run_dir: str, resume_command: str) -> int:
    """The line and exit code (128 + signal) of a run that a signal stopped after saving latest/."""
    say(f"interrupted at step {result['step']:,}: saved {run_dir}/latest; continue with: "
        f"{resume_command} --resume {run_dir}", file=sys.stderr)
    return 128 + int(result["signal"])


def locked(run_dir: str | os.PathLike):
    """RUN_DIR's lock on the main rank (under torchrun the other ranks follow rank 0)."""
    return lock_run_dir(run_dir) if is_main_rank() else contextlib.nullcontext()


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="pretrain a GPT on your text (also under torchrun)",
                       description="Train a GPT from scratch (or from --init weights) on text files.")
    p.add_argument("--data", metavar="PATH", help="a UTF-8 text file, a folder of .txt files, or a quoted glob "
                                                  "(required for a new run)")
    p.add_argument("--tokenizer", metavar="gpt2|char|FILE",
                   help="gpt2 (default), char (the characters of the data), or a tokenizer .json "
                        "(glassgpt tokenizer train); with --init: the checkpoint's")
    p.add_argument("--model", metavar="SPEC",
                   help=f"architecture to start from: a preset ({', '.join(PRESETS)}) or a config .json; "
                        "random weights (default gpt2, with the flags below overriding)")
    p.add_argument("--init", metavar="SPEC", help="start from these weights instead: checkpoint, run "
                                                  "directory or hub id such as openai-community/gpt2 "
                                                  "(default: random weights)")
    p.add_argument("--n-layers", type=positive_int, metavar="N", help="transformer blocks (default: the --model's)")
    p.add_argument("--n-heads", type=positive_int, metavar="H", help="attention heads per block (default: the --model's)")
    p.add_argument("--emb-dim", type=positive_int, metavar="D", help="embedding width (default: the --model's)")
    p.add_argument("--context-length", type=positive_int, metavar="T",
                   help="tokens per training window (default: the --model's)")
    p.add_argument("--drop-rate", type=dropout, metavar="P", help="dropout (default: the preset's, 0)")
    p.add_argument("--val-fraction", type=fraction, help="share of the tokens held out (default 0.1, the end)")
    p.add_argument("--cache-dir", metavar="DIR", help="where tokenized data is cached (default RUN_DIR/cache)")
    p.add_argument("--sample-prompt", metavar="TEXT",
                   help="prompt for the samples at each evaluation (default: the first tokens of the val split)")
    add_train_args(p)
    p.set_defaults(run=run_train)

    p = sub.add_parser("eval", help="loss and perplexity of a model on a text",
                       description="Loss and perplexity on the validation windows that training uses: "
                                   "batch-size x eval-batches windows, evenly spaced over the split.")
    p.add_argument("--model", required=True, metavar="SPEC", help="run directory, checkpoint, preset or hub id (required)")
    p.add_argument("--data", required=True, metavar="PATH", help="text file, folder of .txt files or quoted glob "
                                                                 "(required)")
    p.add_argument("--tokenizer", metavar="gpt2|char|FILE", help="default: the model's (gpt2 for presets)")
    p.add_argument("--split", choices=["val", "train"], default="val", help="which part of the data (default val)")
    p.add_argument("--val-fraction", type=fraction, help="default: the run's, else 0.1")
    p.add_argument("--context-length", type=positive_int, help="window length (default: the run's or the model's)")
    p.add_argument("--batch-size", type=positive_int, help="default: the run's, else 8")
    p.add_argument("--eval-batches", type=positive_int, help="default: the run's, else 20")
    p.add_argument("--cache-dir", metavar="DIR", help="where tokenized data is cached (default ~/.cache/glassgpt/tokens)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="autocast precision (default float32)")
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: one line of text)")
    add_threads_arg(p)
    p.set_defaults(run=run_eval)

    p = sub.add_parser("plot", help="draw train/val loss against tokens seen (RUN_DIR/loss.png)")
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


# --- train ------------------------------------------------------------------------------

@stoppable
def run_train(args: argparse.Namespace) -> int:
    if args.resume:
        check_out_dir(args.resume, resume=True)  # before the lock creates the directory
    elif not args.data or not args.out:
        raise GlassError("glassgpt train needs --data PATH and --out RUN_DIR (or --resume RUN_DIR)")
    with locked(args.resume or args.out):
        model, tokenizer, task, cfg, meta = _resume_setup(args) if args.resume else _new_setup(args)
        n_params = sum(p.numel() for p in model.parameters())
        c = model.cfg
        say(f"model: {c.n_layers} layers, {c.n_heads} heads, emb_dim {c.emb_dim}, context {c.context_length}, "
            f"vocab {c.vocab_size:,}: {n_params / 1e6:.2f}M parameters")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        accum = "auto" if cfg.batch_tokens else cfg.grad_accum
        say(f"batch: {cfg.batch_size} x {task.context_length} tokens x {accum} accumulation x {world} rank(s); "
            f"{cfg.max_steps:,} steps, lr {cfg.lr:g}, {cfg.dtype}")
        set_threads(args.threads, c.emb_dim, file=sys.stdout)
        if model.tok_emb.weight.device.type == "cpu":
            say(autotune.training_note())
        result = fit(model, task, cfg, tokenizer, meta=meta, resume=bool(args.resume), progress=not args.no_progress)
    run_dir = cfg.out
    if result["interrupted"]:
        return interrupted_exit(result, run_dir, "glassgpt train")
    val = result["val_loss"]
    summary = f"done: step {result['step']:,}, {result['tokens']:,} tokens"
    if val is not None:
        summary += f", val loss {val:.4f} (perplexity {math.exp(val):.2f}), best {result['best_val_loss']:.4f}"
    say(summary + f", {result['elapsed_s']:.0f} s of training")
    say(f"model: {run_dir}   try: glassgpt generate \"...\" --model {run_dir}   |   "
        f"glassgpt explain \"...\" --model {run_dir}")
    if result["plot"]:
        say(f"plot: {result['plot']}")
    return 0


def _new_setup(args: argparse.Namespace):
    if is_main_rank():
        check_out_dir(args.out, resume=False)
    arch = [f for f in ("model", "n_layers", "n_heads", "emb_dim") if getattr(args, f) is not None]
    if args.init and arch:
        raise GlassError(f"--init loads a model with its own architecture; drop --{arch[0].replace('_', '-')}")
    files = resolve_files(args.data)
    if args.init:
        model = load_model(args.init, device="cpu", dtype="float32")
        tokenizer = build_tokenizer(args.tokenizer, files) if args.tokenizer else load_tokenizer(args.init)
        check_fits(tokenizer, model.cfg.vocab_size, f"use {args.init}'s own tokenizer (drop --tokenizer)")
        if args.drop_rate is not None:
            model = _with_dropout(model, args.drop_rate)
        context = args.context_length or model.cfg.context_length
        if context > model.cfg.context_length:
            raise GlassError(f"--context-length {context} is longer than {args.init}'s context_length "
                             f"{model.cfg.context_length}: give at most {model.cfg.context_length}")
    else:
        if args.model and Path(args.model).is_dir():
            raise GlassError(f"--model takes an architecture (a preset or a config .json); to start from the "
                             f"weights in {args.model}, pass --init {args.model}")
        tokenizer = build_tokenizer(args.tokenizer or "gpt2", files)
        gcfg = get_config(args.model or "gpt2", vocab_size=tokenizer.n_vocab, n_layers=args.n_layers,
                          n_heads=args.n_heads, emb_dim=args.emb_dim, context_length=args.context_length,
                          drop_rate=args.drop_rate)
        seed = args.seed if args.seed is not None else TrainConfig(out="-").seed
        model = random_model(gcfg, torch.device("cpu"), torch.float32, seed, init_scheme(args.model or "gpt2"))
        context = gcfg.context_length
    cfg = train_config_from_args(args, {"out": args.out})
    # Paths that hold from any working directory: the data absolute, the cache relative to the run.
    data = {"path": os.path.abspath(args.data), "files": len(files),
            "val_fraction": args.val_fraction if args.val_fraction is not None else 0.1,
            "cache_dir": os.path.abspath(args.cache_dir) if args.cache_dir else "cache",
            "context_length": context, "sample_prompt": args.sample_prompt}
    task, data["fingerprint"] = _text_task(files, tokenizer, data, cfg, Path(args.out))
    meta = {"data": data, "tokenizer": args.tokenizer or ("checkpoint" if args.init else "gpt2"), "init": args.init}
    return model, tokenizer, task, cfg, meta


def _resume_setup(args: argparse.Namespace):
    given = [f for f in MODEL_FLAGS if getattr(args, f, None) is not None]
    if given:
        raise GlassError(f"--resume continues a run with its own data and model: drop --{given[0].replace('_', '-')} "
                         "(training flags such as --max-steps may change)")
    if args.out and Path(args.out) != Path(args.resume):
        raise GlassError("--resume RUN_DIR writes to RUN_DIR: drop --out")
    run_dir = Path(args.resume)
    if is_main_rank():
        recover_checkpoints(run_dir)
    ckpt, note = resume_checkpoint(run_dir)
    saved = resumed_train_config(args, run_dir, ckpt, note)
    args.out = str(run_dir)
    cfg = train_config_from_args(args, saved)
    meta = load_meta(ckpt)
    meta.pop("train", None)
    data = meta.get("data")
    if not data:
        raise GlassError(f"{ckpt}/meta.json does not say what data the run trained on: it was not "
                         "made by glassgpt train")
    model = load_model(ckpt, device="cpu", dtype="float32")
    tokenizer = load_tokenizer(ckpt)
    task, _ = _text_task(resolve_files(data["path"]), tokenizer, data, cfg, run_dir, expect=data.get("fingerprint"))
    return model, tokenizer, task, cfg, meta


def resumed_train_config(args: argparse.Namespace, run_dir: Path, ckpt: Path, note: str | None) -> dict:
    """The run's saved TrainConfig values, after saying where they and the weights come from;
    a --seed other than the run's is refused (another seed draws other batches)."""
    saved, damaged = saved_train_config(run_dir, ckpt)
    for line in (note, damaged):
        if line:
            say(f"note: {line}", file=sys.stderr)
    if args.seed is not None and args.seed != saved.get("seed"):
        raise GlassError(f"--resume continues {run_dir} with its seed {saved.get('seed')} (another seed draws other "
                         "batches, so it would not be the same run): drop --seed")
    return saved


def _text_task(files, tokenizer, data: dict, cfg: TrainConfig, run_dir: Path,
               expect: str | None = None) -> tuple[TextTask, str]:
    """(the LM task over the tokenized files, the data's fingerprint: the token cache's key)."""
    t0 = time.perf_counter()
    # A run records its cache relative to itself; older runs recorded it relative to where they started.
    cache_dir = run_dir / data["cache_dir"] if "fingerprint" in data or data["cache_dir"] == "cache" else data["cache_dir"]
    cache = tokenize_files(files, tokenizer, cache_dir, expect_key=expect)
    train, val = split_ids(cache.ids(), data["val_fraction"])
    say(f"data: {len(files)} file(s), {cache.n_tokens:,} tokens ({len(train):,} train, {len(val):,} val), "
        f"tokenizer {tokenizer.name} ({tokenizer.n_vocab:,} tokens), cached in {cache.path} "
        f"({time.perf_counter() - t0:.1f} s)")
    task = TextTask(train, val, data["context_length"], cfg.batch_size, tokenizer=tokenizer, seed=cfg.seed,
                    eval_batches=cfg.eval_batches, sample_tokens=cfg.sample_tokens,
                    sample_prompt=data.get("sample_prompt"))
    return task, cache.key


def _with_dropout(model, drop_rate: float):
    from ..model import GPTModel
    cfg = dataclasses.replace(model.cfg, drop_rate=drop_rate)
    new = GPTModel(cfg)
    new.load_state_dict(model.state_dict())
    return new


# --- eval, plot, tokenizer --------------------------------------------------------------

@stoppable
def run_eval(args: argparse.Namespace) -> int:
    run_cfg, run_data = _run_settings(args.model)
    model = load_model(args.model, device=args.device, dtype="float32")
    require_language_model(model, args.model)
    set_threads(args.threads, model.cfg.emb_dim)
    files = resolve_files(args.data)
    if args.tokenizer:
        tokenizer = build_tokenizer(args.tokenizer, files)
    else:
        tokenizer = load_tokenizer(args.model)
    check_fits(tokenizer, model.cfg.vocab_size)
    context = args.context_length or run_data.get("context_length") or model.cfg.context_length
    if context > model.cfg.context_length:
        raise GlassError(f"--context-length {context} is longer than the model's {model.cfg.context_length}")
    val_fraction = args.val_fraction if args.val_fraction is not None else run_data.get("val_fraction", 0.1)
    batch_size = args.batch_size or run_cfg.get("batch_size", 8)
    eval_batches = args.eval_batches or run_cfg.get("eval_batches", 20)
    cache_dir = args.cache_dir or _default_cache_dir()
    cache = tokenize_files(files, tokenizer, cache_dir)
    train, val = split_ids(cache.ids(), val_fraction)
    if args.split == "val" and not len(val):
        raise GlassError("--val-fraction 0 leaves no validation split: pass --split train or a --val-fraction > 0")
    held = val if args.split == "val" else train
    task = TextTask(held, held, context, batch_size, seed=0, eval_batches=eval_batches)
    loss = evaluate_loss(model, task, args.dtype)
    windows = len(task.eval_offsets())
    result = {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf, "split": args.split,
              "windows": windows, "context_length": context, "tokens": windows * context,
              "split_tokens": len(held)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.split} loss {loss:.4f}   perplexity {result['perplexity']:.2f}   "
              f"({describe_windows(windows, context, len(held), args.split)})")
    return 0


def describe_windows(windows: int, context: int, split_tokens: int, split: str) -> str:
    """How the evaluation windows were drawn, in the words a reader would count them."""
    spread = f"{windows:,} windows of {context:,} tokens, evenly spaced over the {split_tokens:,} {split} tokens"
    if windows * context > split_tokens:
        return spread + f" (so they overlap: {windows * context:,} predictions scored)"
    return spread + f" ({windows * context:,} of them scored)"


def _run_settings(spec: str) -> tuple[dict, dict]:
    """(train_config, data settings) of the run a checkpoint came from, or ({}, {})."""
    try:
        ckpt = local_checkpoint_dir(spec)
    except GlassError:  # a path with no checkpoint in it: load_model says so, with the fix
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
    return run_cfg, load_meta(ckpt).get("data") or {}


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glassgpt" / "tokens"


def run_plot(args: argparse.Namespace) -> int:
    path = plot_run(args.run_dir, args.out)
    if path is None:
        raise GlassError("glassgpt plot needs matplotlib: pip install 'glassgpt[plot]'")
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
