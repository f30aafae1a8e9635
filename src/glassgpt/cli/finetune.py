"""`glassgpt finetune classify|instruct`, `glassgpt classify`, `glassgpt chat`.

    glassgpt finetune classify --model SPEC --data train.csv [--val val.csv] --out RUN_DIR
                               [--text-column text] [--label-column label] [--max-length N]
                               [--trainable last-block|last-N-blocks|head|all]
                               [--lora-rank R --lora-alpha A] [training flags of glassgpt train]
    glassgpt finetune instruct --model SPEC --data data.json --out RUN_DIR [--on-bad-record skip|error] ...
    glassgpt finetune classify|instruct --resume RUN_DIR [--max-steps S]
    glassgpt classify "TEXT" --model RUN_DIR [--json]
    glassgpt chat ["INSTRUCTION"] --model RUN_DIR        (no instruction: one per line of stdin)

The training flags, the run lifecycle and the loop are `glassgpt train`'s (cli/run.py, `fit`). What
the run was made from (model, data as absolute paths with their sha256, columns,
labels, LoRA) is saved in each checkpoint's meta.json under "finetune", so `--resume`
needs nothing else, works from any directory, and refuses data that changed.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..errors import GlassError
from ..formats import load_meta, load_model, load_tokenizer
from ..tokenizer import check_fits
from ..training import TrainConfig
from ..training import finetune as ft
from ..training import lora
from ..training.config import default
from ..prompt import fit_prompt
from ..training.data import scan_file
from .common import (add_model_args, fraction, load, nonneg_float, nonneg_int, positive_float, positive_int, probability,
                     require_language_model, say)
from .run import Start, add_train_args, given_flags, run_training, stoppable, train_config_from_args

# Flags that describe what a run is made of; --resume takes them from the run instead.
SETTINGS = ("model", "data", "val", "val_fraction", "text_column", "label_column", "max_length", "trainable",
            "lora_rank", "lora_alpha", "on_bad_record")
# Each kind's defaults (the book's), what --help shows and a run uses; the lr is finetune.default_lr.
DEFAULTS = {
    "classify": {"epochs": 5, "trainable": "last-block"},
    "instruct": {"epochs": 2, "trainable": "all"},
}


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finetune", help="finetune a model: a classifier, or an instruction follower")
    fsub = p.add_subparsers(dest="finetune_command", metavar="KIND", parser_class=type(p))
    fsub.required = True

    c = fsub.add_parser("classify", help="swap the vocab head for a classifier head and train on labelled texts",
                        description="Replace out_head (emb_dim -> vocab_size) by emb_dim -> classes and train on "
                                    f"the last token's output. Data: {ft.DATA_FORMATS}, with a text and a label "
                                    "column.")
    _add_common(c, "classify")
    c.add_argument("--text-column", metavar="NAME", help="column with the text (default text)")
    c.add_argument("--label-column", metavar="NAME", help="column with the label (default label)")
    c.set_defaults(run=run_finetune)

    i = fsub.add_parser("instruct", help="teach a model to follow instructions (Alpaca records)",
                        description="Finetune on Alpaca records (instruction, optional input, output) with the "
                                    "Alpaca prompt; the loss counts only the response tokens.")
    _add_common(i, "instruct")
    i.add_argument("--on-bad-record", choices=("skip", "error"),
                   help="malformed records: skip them (listed on stderr; default skip) or stop at the first")
    i.set_defaults(run=run_finetune)

    k = sub.add_parser("classify", help="label a text with a finetuned classifier")
    k.add_argument("text", help="the text to label")
    add_model_args(k, default=None)
    k.add_argument("--json", action="store_true", help='print {"label": ..., "prob": ...} (default: label<TAB>prob)')
    k.set_defaults(run=run_classify)

    h = sub.add_parser("chat", help="answer an instruction with an instruction-finetuned model")
    h.add_argument("instruction", nargs="?", help="the instruction (default: one per line of stdin)")
    h.add_argument("--input", default="", help="the optional ### Input: part of the prompt (default: none)")
    add_model_args(h, default=None)
    h.add_argument("--max-new-tokens", type=nonneg_int, default=256, help="longest answer in tokens (default 256)")
    h.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 is greedy (default 0)")
    h.add_argument("--top-k", type=positive_int, default=None, help="sample from the k likeliest tokens (default: all)")
    h.add_argument("--top-p", type=probability, default=None,
                   help="sample from the smallest set of tokens with this much probability (default: all)")
    h.set_defaults(run=run_chat)


def _add_common(p: argparse.ArgumentParser, kind: str) -> None:
    d = DEFAULTS[kind]
    p.add_argument("--model", metavar="SPEC", help="the model to start from: checkpoint or run directory, "
                                                   "hub id (openai-community/gpt2), or a preset (random weights); "
                                                   "required for a new run")
    p.add_argument("--data", metavar="FILE", help="training data, required for a new run: " + (
        f"{ft.DATA_FORMATS} with a text and a label column" if kind == "classify"
        else f"{ft.DATA_FORMATS} of Alpaca records (instruction, optional input, output)"))
    p.add_argument("--val", metavar="FILE", help="validation data in the same form (default: hold out --val-fraction)")
    p.add_argument("--val-fraction", type=fraction, help="share of --data held out when there is no --val (default 0.1)")
    p.add_argument("--max-length", type=positive_int, help="cut inputs to this many tokens (default: context_length)")
    p.add_argument("--trainable", metavar="WHICH",
                   help="all, head, last-block or last-N-blocks; final_norm and out_head always train "
                        f"(default {d['trainable']})")
    p.add_argument("--lora-rank", type=positive_int, metavar="R",
                   help="train rank-R LoRA adapters instead of the weights (default: no LoRA)")
    p.add_argument("--lora-alpha", type=positive_float, metavar="A", help="LoRA scale is A / R (default: A = R)")
    add_train_args(p, exclude=("batch_tokens", "recipe"), epochs=str(d["epochs"]), shown={
        "lr": f"{ft.BOOK_LR:g} x max(1, 768 / emb_dim): the book's at GPT-2's widths, more for narrower models",
        "max_steps": "from --epochs; not with --epochs",
        "warmup_steps": "a tenth of the steps, at most 100", "eval_every": "once per epoch, at most 100 steps",
        "sample_tokens": "0" if kind == "classify" else "64"})


# --- finetune ------------------------------------------------------------------------------

@stoppable
def run_finetune(args: argparse.Namespace) -> int:
    kind = args.finetune_command
    if not args.resume:
        missing = [f for f in ("model", "data", "out") if getattr(args, f) is None]
        if missing:
            raise GlassError(f"glassgpt finetune {kind} needs --model SPEC, --data FILE and --out RUN_DIR "
                             f"(missing --{missing[0]}), or --resume RUN_DIR")
    return run_training(args, f"glassgpt finetune {kind}", functools.partial(_setup, kind=kind),
                        functools.partial(_report, kind=kind))


def _setup(args: argparse.Namespace, start: Start, kind: str):
    if start.checkpoint:
        settings, source, seed = _resume_settings(args, kind, start), start.checkpoint, start.saved["seed"]
    else:  # the split and the initialisation of a new head follow the seed
        settings, source, seed = _new_settings(args, kind), None, args.seed if args.seed is not None else default("seed")
    if settings["lora_rank"] and args.fsdp:
        raise GlassError("--fsdp shards plain weights; LoRA adapters are small enough to replicate: drop --fsdp")
    model = load_model(source or settings["model"], device="cpu", dtype="float32")
    tokenizer = load_tokenizer(source or settings["model"])
    check_fits(tokenizer, model.cfg.vocab_size, "the checkpoint's tokenizer.json does not belong to it")
    max_length = min(settings["max_length"] or model.cfg.context_length, model.cfg.context_length)
    setup = _classification_setup if kind == "classify" else _instruction_setup
    model, data, make_task = setup(model, tokenizer, settings, max_length, seed)
    world = start.ranks.world
    cfg = _train_config(args, kind, len(data["train"]), model.cfg.emb_dim, start.saved, world)
    task = make_task(cfg)
    say(_parameter_summary(model, settings))
    per_epoch = ft.steps_per_epoch(task.n_train, cfg.batch_size, cfg.grad_accum, world)
    say(f"training: {cfg.max_steps:,} steps ({cfg.max_steps / per_epoch:.2f} epochs of {per_epoch:,} steps) of "
        f"{cfg.batch_size} x {cfg.grad_accum} accumulation x {world} rank(s), lr {cfg.lr:g}, {cfg.dtype}")
    meta = {"finetune": settings}
    if kind == "classify":
        meta["labels"] = settings["labels"]
    return model, tokenizer, task, cfg, meta


def _report(result: dict, cfg: TrainConfig, task, tokenizer, kind: str) -> None:
    run_dir = cfg.out
    if result["val_loss"] is not None:
        print(f"done: step {result['step']:,}, val loss {result['val_loss']:.4f} "
              f"(best {result['best_val_loss']:.4f}), {result['elapsed_s']:.0f} s of training")
    best = load_model(run_dir, device=cfg.device, dtype="float32")  # best/ if any: what users will load
    if kind == "classify":
        _report_classification(best, task, Path(run_dir))
        print(f"model: {run_dir}   try: glassgpt classify \"...\" --model {run_dir}")
    else:
        rec = task.sample_records[0] if task.sample_records else None
        if rec is not None:
            answer = ft.respond(best, tokenizer, rec["instruction"], rec["input"], max_new_tokens=cfg.sample_tokens or 64)
            print(f"sample: {rec['instruction']!r}\n  -> {answer!r}")
        print(f"model: {run_dir}   try: glassgpt chat \"...\" --model {run_dir}")


def _new_settings(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    if args.lora_rank is None and args.lora_alpha is not None:
        raise GlassError("--lora-alpha needs --lora-rank R")
    if args.lora_rank is not None and args.trainable is not None:
        raise GlassError("with --lora-rank only the adapters (and a classifier head) train: drop --trainable")
    for path in (args.data, args.val):
        if path is not None and not Path(path).is_file():
            raise GlassError(f"{path}: no such file")
    absolute = lambda p: str(Path(p).resolve()) if p else None
    local_model = Path(args.model).exists()
    settings = {"kind": kind, "model": absolute(args.model) if local_model else args.model,
                "data": absolute(args.data), "val": absolute(args.val),
                # The files' sha256: --resume refuses data that changed (it could not continue exactly).
                "data_sha256": scan_file(Path(args.data)), "val_sha256": scan_file(Path(args.val)) if args.val else None,
                "val_fraction": 0.1 if args.val_fraction is None else args.val_fraction,
                "max_length": args.max_length,
                "trainable": None if args.lora_rank else (args.trainable or DEFAULTS[kind]["trainable"]),
                "lora_rank": args.lora_rank,
                "lora_alpha": (args.lora_alpha or float(args.lora_rank)) if args.lora_rank else None}
    if kind == "classify":
        settings.update(text_column=args.text_column or "text", label_column=args.label_column or "label")
    else:
        settings["on_bad_record"] = args.on_bad_record or "skip"
    return settings


def _resume_settings(args: argparse.Namespace, kind: str, start: Start) -> dict[str, Any]:
    """The run's settings (model, data, columns, LoRA), with its data checked unchanged."""
    given = given_flags(args, SETTINGS + ("epochs",))
    if given:
        raise GlassError(f"--resume continues a run with its own model and data: drop {given[0]} "
                         "(training flags such as --max-steps may change)")
    run_dir = start.run_dir.path
    settings = load_meta(start.checkpoint).get("finetune")
    if not settings or settings.get("kind") != kind:
        made = f"glassgpt finetune {settings['kind']}" if settings else "glassgpt train"
        raise GlassError(f"{run_dir} was made by {made}, not glassgpt finetune {kind}: resume it with that")
    for name in ("data", "val"):
        recorded = settings.get(f"{name}_sha256")
        if recorded and scan_file(Path(settings[name])) != recorded:
            raise GlassError(f"{settings[name]} changed since the run started (its sha256 differs from the run's "
                             "record), so --resume could not continue it exactly: restore it, or start a new "
                             f"finetuning run from this one's weights with --model {run_dir}")
    return settings


def _train_config(args: argparse.Namespace, kind: str, n_train: int, emb_dim: int, saved: dict | None,
                  world: int) -> TrainConfig:
    """The run's TrainConfig: a resumed run's own, or the flags over this kind's DEFAULTS.

    --epochs sets max_steps (at least one); --max-steps sets it directly (cli/run.py refuses
    both). Warm-up is a tenth of the steps (at most 100); one evaluation per epoch.
    """
    if saved is not None:
        return train_config_from_args(args, saved)
    d = DEFAULTS[kind]
    per_epoch = ft.steps_per_epoch(n_train, args.batch_size or default("batch_size"), args.grad_accum or 1, world)
    max_steps = args.max_steps or max(1, math.ceil((args.epochs or d["epochs"]) * per_epoch))
    base = {"out": args.out, "lr": ft.default_lr(emb_dim), "max_steps": max_steps, "warmup_steps": min(100, max_steps // 10),
            "eval_every": min(100, per_epoch), "sample_tokens": 0 if kind == "classify" else 64}
    return train_config_from_args(args, base)


# --- classification ------------------------------------------------------------------------

def _classification_setup(model, tokenizer, settings, max_length, seed):
    """(classifier, {"train", "val"} data, cfg -> ClassificationTask); prints what the data holds."""
    cols = dict(text_column=settings["text_column"], label_column=settings["label_column"])
    if settings["val"]:
        train = ft.load_classification_data(settings["data"], **cols)
        val = ft.load_classification_data(settings["val"], label_names=train.label_names, **cols)
    else:
        train, val = ft.split_validation(ft.load_classification_data(settings["data"], **cols),
                                         settings["val_fraction"], seed)
    if settings.get("labels") and settings["labels"] != train.label_names:
        raise GlassError(f"the data's labels {train.label_names} differ from the run's {settings['labels']}: "
                         "resume with the data the run was started with")
    settings["labels"] = train.label_names
    train_ids = ft.encode_texts(tokenizer, train.texts, max_length)
    val_ids = ft.encode_texts(tokenizer, val.texts, max_length)
    model = ft.to_classifier(model, len(train.label_names), seed)
    _set_trainable(model, settings, seed)
    counts = [train.labels.count(k) for k in range(len(train.label_names))]
    longest = max(len(tokenizer.encode(t)) for t in train.texts + val.texts)
    say(f"data: {len(train.texts):,} train, {len(val.texts):,} val texts; {len(train.label_names)} labels "
         + ", ".join(f"{name} ({n:,})" for name, n in zip(train.label_names, counts))
         + f"; longest text {longest:,} tokens, max_length {max_length:,}")

    def make_task(cfg: TrainConfig) -> ft.ClassificationTask:
        return ft.ClassificationTask(train_ids, train.labels, val_ids, val.labels, train.label_names,
                                     ft.pad_id_of(tokenizer), cfg.batch_size, cfg.grad_accum, cfg.seed,
                                     cfg.eval_batches)
    return model, {"train": train_ids, "val": val_ids}, make_task


def _report_classification(model, task: ft.ClassificationTask, run_dir: Path) -> None:
    metrics = task.evaluate(model, everything=True)
    matrix, labels = task.last_confusion, task.label_names
    print(f"validation accuracy: {metrics['val_accuracy']:.2%} of {task.n_val:,} texts (best/ checkpoint)")
    print(format_confusion(matrix, labels))
    record = {"labels": labels, "matrix": matrix, "accuracy": metrics["val_accuracy"], "n": task.n_val,
              "rows": "actual", "columns": "predicted"}
    (run_dir / "confusion.json").write_text(json.dumps(record, indent=1))
    png = save_confusion_png(matrix, labels, run_dir / "confusion.png")
    print(f"confusion matrix: {run_dir / 'confusion.json'}" + (f", {png}" if png else ""))


def format_confusion(matrix: list[list[int]], labels: list[str]) -> str:
    """A text table: one row per actual label, one column per predicted label."""
    names = [str(x) for x in labels]
    width = max(6, *(len(n) for n in names), *(len(f"{v:,}") for row in matrix for v in row))
    corner = "actual \\ predicted"
    head = max(len(corner), *(len(n) for n in names))
    lines = [f"{corner:<{head}}  " + "  ".join(f"{n:>{width}}" for n in names)]
    for name, row in zip(names, matrix):
        lines.append(f"{name:<{head}}  " + "  ".join(f"{v:>{width},}" for v in row))
    return "\n".join(lines)


def save_confusion_png(matrix: list[list[int]], labels: list[str], path: Path) -> Path | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    n = len(labels)
    fig = Figure(figsize=(1.2 + 0.7 * n, 1.0 + 0.6 * n), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(matrix, cmap="Blues")
    top = max(max(row) for row in matrix) or 1
    for a in range(n):
        for p in range(n):
            ax.text(p, a, f"{matrix[a][p]:,}", ha="center", va="center",
                    color="white" if matrix[a][p] > top / 2 else "black")
    ax.set_xticks(range(n), labels, rotation=45 if n > 4 else 0)
    ax.set_yticks(range(n), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("actual")
    fig.savefig(path, dpi=120)
    return path


def _set_trainable(model, settings, seed) -> None:
    if settings["lora_rank"]:
        lora.apply_lora(model, settings["lora_rank"], settings["lora_alpha"], seed)
    else:
        ft.freeze(model, settings["trainable"])


def _parameter_summary(model, settings) -> str:
    total = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    trained = lora.count_parameters(model, trainable_only=True)
    line = f"trainable parameters: {trained:,} of {total:,} ({trained / total:.2%})"
    if settings["lora_rank"]:
        line += (f" with LoRA rank {settings['lora_rank']}, alpha {settings['lora_alpha']:g}; "
                 f"without LoRA (--trainable all): {total:,}")
    else:
        line += f", --trainable {settings['trainable']}"
    return line


def run_classify(args: argparse.Namespace) -> int:
    if args.model is None:
        raise GlassError("glassgpt classify needs --model RUN_DIR (a run of glassgpt finetune classify)")
    if not args.text.strip():
        raise GlassError("the text is empty: give something to classify")
    model, tokenizer = load(args)
    if model.cfg.num_classes is None:
        raise GlassError(f"{args.model} is a language model (no classifier head): make a classifier with "
                         "glassgpt finetune classify")
    meta = load_meta(args.model)
    labels = meta.get("labels") or [str(k) for k in range(model.cfg.num_classes)]
    max_length = (meta.get("finetune") or {}).get("max_length")
    limit = min(max_length or model.cfg.context_length, model.cfg.context_length)
    why = "the --max-length it was finetuned with" if limit != model.cfg.context_length else "its context_length"
    cut = fit_prompt(tokenizer.encode(args.text), limit, keep="first", why=why)  # as predict() cuts it
    if cut.note:
        print(f"note: {cut.note}", file=sys.stderr)
    probs = ft.predict(model, tokenizer, [args.text], max_length)[0]
    k = int(probs.argmax())
    if args.json:
        print(json.dumps({"label": labels[k], "prob": float(probs[k])}))
    else:
        print(f"{labels[k]}\t{float(probs[k]):.4f}")
    return 0


# --- instructions ----------------------------------------------------------------------------

def _instruction_setup(model, tokenizer, settings, max_length, seed):
    """(model, {"train", "val"} examples, cfg -> InstructionTask); lists the records it skips."""
    if model.cfg.num_classes is not None:
        raise GlassError(f"{settings['model']} is a classifier: instruction finetuning needs a language model")
    on_bad = settings["on_bad_record"]
    records, problems = ft.load_instruction_records(settings["data"], on_bad)
    if settings["val"]:
        val_records, val_problems = ft.load_instruction_records(settings["val"], on_bad)
        _report_bad(settings["val"], val_problems)
    else:
        train_idx, val_idx = ft.holdout(len(records), settings["val_fraction"], seed)
        records, val_records = [records[i] for i in train_idx], [records[i] for i in val_idx]
    train, long_train = ft.encode_instructions(tokenizer, records, max_length, on_bad)
    val, long_val = ft.encode_instructions(tokenizer, val_records, max_length, on_bad)
    _report_bad(settings["data"], sorted(problems + long_train + (long_val if not settings["val"] else [])))
    if settings["val"]:
        _report_bad(settings["val"], long_val)
    if not train or not val:
        raise GlassError("no training or no validation record is left after skipping bad ones: fix the data")
    _set_trainable(model, settings, seed)
    response_tokens = sum(len(ids) - p for ids, p in train)
    cut = sum(ids[-1] != tokenizer.eot_id for ids, _ in train + val)
    say(f"data: {len(train):,} train, {len(val):,} val records; {response_tokens:,} response tokens "
         f"to learn; max_length {max_length:,}" + (f" ({cut:,} responses cut to fit)" if cut else ""))

    def make_task(cfg: TrainConfig) -> ft.InstructionTask:
        return ft.InstructionTask(train, val, tokenizer.eot_id, cfg.batch_size, cfg.grad_accum, cfg.seed,
                                  cfg.eval_batches, tokenizer, val_records[:1], cfg.sample_tokens)
    return model, {"train": train, "val": val}, make_task


def _report_bad(path, problems) -> None:
    if not problems:
        return
    shown = "; ".join(f"{i} ({why})" for i, why in problems[:5])
    more = f"; and {len(problems) - 5:,} more" if len(problems) > 5 else ""
    say(f"skipped {len(problems):,} malformed record(s) of {path}: {shown}{more}", file=sys.stderr)


def run_chat(args: argparse.Namespace) -> int:
    if args.model is None:
        raise GlassError("glassgpt chat needs --model RUN_DIR (a run of glassgpt finetune instruct)")
    if args.instruction is not None and not args.instruction.strip():
        raise GlassError("the instruction is empty: say what the model should do")
    model, tokenizer = load(args)
    require_language_model(model, args.model)
    if tokenizer.eot_id is None:
        raise GlassError(f"{args.model}'s tokenizer has no <|endoftext|>, so an answer could not end: "
                         "use a model finetuned with glassgpt finetune instruct")
    if args.instruction is not None:
        instructions = [args.instruction]
    else:
        if sys.stdin.isatty():
            print("one instruction per line; Ctrl-D ends", file=sys.stderr)
        instructions = (line.strip() for line in sys.stdin)
    for instruction in instructions:
        if not instruction:
            continue
        cut = fit_prompt(tokenizer.encode(ft.format_prompt(instruction, args.input)), model.cfg.context_length)
        if cut.note:  # generation reads the window's last tokens, as it does for every prompt
            print(f"note: {cut.note}", file=sys.stderr)
        print(ft.respond(model, tokenizer, instruction, args.input, args.max_new_tokens, args.temperature,
                         args.top_k, args.top_p, args.seed), flush=True)
    return 0
