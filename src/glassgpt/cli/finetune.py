"""`glassgpt finetune classify|instruct`, `glassgpt classify`, `glassgpt chat`.

    glassgpt finetune classify --model SPEC --data train.csv [--val val.csv] --out RUN_DIR
                               [--text-column text] [--label-column label] [--labels A,B] [--max-length N]
                               [--trainable last-block|last-N-blocks|head|all]
                               [--lora-rank R --lora-alpha A] [training flags of glassgpt train]
    glassgpt finetune instruct --model SPEC --data data.json --out RUN_DIR [--on-bad-record skip|error] ...
    glassgpt finetune classify --recipe book --model SPEC --data train.csv --val validation.csv
                               [--test test.csv] --out RUN_DIR          (the book's chapter 6)
    glassgpt finetune classify|instruct --resume RUN_DIR [--max-steps S]
    glassgpt classify "TEXT" --model RUN_DIR [--json]
    glassgpt classify "TEXT" --model review_classifier.pth --recipe book --max-length N
    glassgpt chat ["INSTRUCTION"] --model RUN_DIR        (no instruction: one per line of stdin)

The training flags, the run lifecycle and the loop are `glassgpt train`'s (cli/run.py, `fit`). What
the run was made from (model, data as absolute paths with their sha256, columns,
labels, LoRA) is saved in each checkpoint's meta.json under "finetune", so `--resume`
needs nothing else, works from any directory, and refuses data that changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

from .. import formats
from ..errors import GlassError
from ..training import TrainConfig
from ..training.tasks import classify, examples, instruct
from ..training import finetuning, recipes
from ..training.book import ch06 as book_ch06, ch07 as book_ch07
from ..training.tasks import lora
from ..training.loop.compute import exact
from ..training.loop.config import default
from ..prompt import BOOK_FILE_HINT, fit_prompt
from .common import (add_model_args, add_reading_args, add_source_args, check_training_memory, class_names,
                     classifier_reading_of, fraction, load, nonneg_int, open_model, positive_int, probability,
                     require_language_model, say, temperature)
from .limits import MAX_TEMPERATURE, MIN_TEMPERATURE, number
from .progress import StepBar
from .text import stdin_lines
from .run import Prepared, Start, add_train_args, given_flags, run_training, stoppable, train_config_from_args

# Flags that describe what a run is made of; --resume takes them from the run instead.
SETTINGS = ("model", "data", "val", "test", "val_fraction", "text_column", "label_column", "labels", "max_length",
            "trainable", "lora_rank", "lora_alpha", "on_bad_record", "recipe")
MODEL_FLAGS = ("n_heads", "drop_rate")  # formats.open's, for a .pth state dict: a resume reads its checkpoint
DEFAULTS = finetuning.DEFAULTS  # each kind's (the book's), what --help shows and a run uses; the lr is finetune.default_lr


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finetune", help="finetune a model: a classifier, or an instruction follower")
    fsub = p.add_subparsers(dest="finetune_command", metavar="KIND", parser_class=type(p))
    fsub.required = True

    c = fsub.add_parser("classify", help="swap the vocab head for a classifier head and train on labelled texts",
                        description="Replace out_head (emb_dim -> vocab_size) by emb_dim -> classes and train on "
                                    f"the last token's output. Data: {examples.DATA_FORMATS}, with a text and a label "
                                    "column.")
    _add_common(c, "classify")
    c.add_argument("--text-column", metavar="NAME", help="column with the text (default text)")
    c.add_argument("--label-column", metavar="NAME", help="column with the label (default label)")
    c.add_argument("--labels", type=_names, metavar="A,B",
                   help="the class names, in the order of the data's sorted labels (default: the labels themselves)")
    c.add_argument("--test", metavar="FILE", help="--recipe book: the book's test.csv, scored at the end "
                                                  "(default: none)")
    c.set_defaults(run=run_finetune)

    i = fsub.add_parser("instruct", help="teach a model to follow instructions (Alpaca records)",
                        description="Finetune on Alpaca records (instruction, optional input, output) with the "
                                    "Alpaca prompt; the loss counts only the response tokens.")
    _add_common(i, "instruct")
    i.add_argument("--on-bad-record", choices=("skip", "error"),
                   help="malformed records: skip them (listed on stderr; default skip) or stop at the first")
    i.add_argument("--responses", type=positive_int, metavar="N",
                   help=f"--recipe book: answer only the first N test records in RUN_DIR/{book_ch07.RESPONSES_FILE} "
                        "(the notebook shows 3 before it answers them all; default: all)")
    i.set_defaults(run=run_finetune)

    k = sub.add_parser("classify", help="label a text with a finetuned classifier")
    k.add_argument("text", help="the text to label")
    add_model_args(k, default=None)
    k.add_argument("--json", action="store_true", help='print {"label": ..., "prob": ...} (default: label<TAB>prob)')
    add_reading_args(k)
    k.set_defaults(run=run_classify)

    h = sub.add_parser("chat", help="answer an instruction with an instruction-finetuned model")
    h.add_argument("instruction", nargs="?", help="the instruction (default: one per line of stdin)")
    h.add_argument("--input", default="", help="the optional ### Input: part of the prompt (default: none)")
    add_model_args(h, default=None)
    h.add_argument("--max-new-tokens", type=nonneg_int, default=256, help="longest answer in tokens (default 256)")
    h.add_argument("--temperature", type=temperature, default=0.0,
                   help=f"0 is greedy; else from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g} (default 0)")
    h.add_argument("--top-k", type=positive_int, default=None, help="sample from the k likeliest tokens (default: all)")
    h.add_argument("--top-p", type=probability, default=None,
                   help="sample from the smallest set of tokens with this much probability (default: all)")
    h.add_argument("--recipe", choices=[recipes.BOOK], help="book: the prompt of the book's format_input, answered as "
                                                       "its chapter 7 answers the test set (default: glassgpt's "
                                                       "Alpaca prompt)")
    h.set_defaults(run=run_chat)


# Past this, the scale A / R multiplies an adapter's output so much that the first steps overflow.
LORA_ALPHA = number(float, lambda v: 0 < v <= 10_000, "a positive number of at most 10,000")


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if len(names) < 2 or not all(names) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give two or more distinct class names, comma-separated, got {text!r}")
    return names


def _add_common(p: argparse.ArgumentParser, kind: str) -> None:
    d = DEFAULTS[kind]
    p.add_argument("--recipe", choices=recipes.names(f"finetune {kind}"),
                   help="glassgpt: glassgpt's own; book: the book's chapter 6, exactly (train_classifier_simple, "
                        "its settings as defaults, its lines) (default glassgpt)" if kind == "classify" else
                        "glassgpt: glassgpt's own; book: the book's chapter 7, exactly (its 85/10/5 split, "
                        "custom_collate_fn, train_model_simple's lines, the test set's responses written as "
                        f"RUN_DIR/{book_ch07.RESPONSES_FILE}) (default glassgpt)")
    p.add_argument("--model", metavar="SPEC", help="the model to start from: checkpoint or run directory, "
                                                   "hub id (openai-community/gpt2), the book's model.pth, or a preset "
                                                   "(random weights); required for a new run")
    add_source_args(p)
    p.add_argument("--data", metavar="FILE", help="training data, required for a new run: " + (
        f"{examples.DATA_FORMATS} with a text and a label column" if kind == "classify"
        else f"{examples.DATA_FORMATS} of Alpaca records (instruction, optional input, output)"))
    p.add_argument("--val", metavar="FILE", help="validation data in the same form (default: hold out --val-fraction)")
    p.add_argument("--val-fraction", type=fraction, help="share of --data held out when there is no --val (default 0.1)")
    p.add_argument("--max-length", type=positive_int, help="cut inputs to this many tokens (default: context_length)")
    p.add_argument("--trainable", metavar="WHICH",
                   help="all, head, last-block or last-N-blocks; final_norm and out_head always train "
                        f"(default {d['trainable']})")
    p.add_argument("--lora-rank", type=positive_int, metavar="R",
                   help="train rank-R LoRA adapters instead of the weights (default: no LoRA)")
    p.add_argument("--lora-alpha", type=LORA_ALPHA, metavar="A", help="LoRA scale is A / R; --recipe book: A, as appendix E's LoRALayer scales it, "
                        "on every nn.Linear (default: A = R)")
    add_train_args(p, exclude=("batch_tokens", "recipe"), epochs=str(d["epochs"]), shown={
        "lr": f"{examples.BOOK_LR:g} x max(1, 768 / emb_dim): the book's at GPT-2's widths, more for narrower models",
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
    settings = _resume_settings(args, kind, start) if start.checkpoint else None
    recipe = recipes.recipe(f"finetune {kind}", settings.get("recipe") if settings else args.recipe)
    if start.ranks.world > 1 and recipe.one_process:
        raise GlassError(f"--recipe {recipe.name} trains in one process, as the book's code does: run it without torchrun")
    if recipe.chapter is not None:
        return _book_setup(args, start, recipe, settings, kind)
    if settings is not None:
        source, seed = start.checkpoint, start.saved["seed"]
    else:  # the split and the initialisation of a new head follow the seed
        if getattr(args, "test", None) is not None:
            raise GlassError("--test is --recipe book's (the book's test.csv): drop it, or add --recipe book")
        settings, source, seed = _new_settings(args, kind), None, args.seed if args.seed is not None else default("seed")
    if settings["lora_rank"] and args.fsdp:
        raise GlassError("--fsdp shards plain weights; LoRA adapters are small enough to replicate: drop --fsdp")
    batch_size = args.batch_size or (start.saved or {}).get("batch_size") or default("batch_size")
    opened = source or _open_start(args, settings)  # (a resume's checkpoint, or the model flags' source)
    _check_memory(opened, settings, args.dtype or (start.saved or {}).get("dtype") or "float32", batch_size,
                  args.device)
    model, tokenizer = finetuning.start_model(opened)
    model, data, make_task, lines = finetuning.prepare_glassgpt(kind, model, tokenizer, settings, seed)
    for line in lines:
        say(line, file=sys.stderr if line.startswith("skipped") else sys.stdout)
    world = start.ranks.world
    cfg = _train_config(args, kind, len(data["train"]), model.cfg.emb_dim, start.saved, world)
    task = make_task(cfg)
    say(_parameter_summary(model, settings))
    per_epoch = examples.steps_per_epoch(task.n_train, cfg.batch_size, cfg.grad_accum, world)
    say(f"training: {cfg.max_steps:,} steps ({cfg.max_steps / per_epoch:.2f} epochs of {per_epoch:,} steps) of "
        f"{cfg.batch_size} x {cfg.grad_accum} accumulation x {world} rank(s), lr {cfg.lr:g}, {cfg.dtype}")
    meta = {"finetune": settings}
    if kind == "classify":
        meta["labels"] = settings.get("names") or settings["labels"]
    return Prepared(model, tokenizer, task, cfg, meta, recipe)


def _book_setup(args: argparse.Namespace, start: Start, recipe: recipes.Recipe, settings: dict | None, kind: str):
    """The book's chapter 6 or 7 (training/book_ch06.py, book_ch07.py): its data, seeds and settings."""
    if settings is not None:
        cfg = train_config_from_args(args, start.saved)
    else:
        recipe.refuse_flags(vars(args))
        if kind == "classify" and args.val is None:
            raise GlassError("--recipe book reads the book's validation.csv as well: pass --val validation.csv")
        settings = _new_settings(args, kind)
        cfg = recipe.train_config({f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainConfig)},
                                  {"out": args.out})
    opened = start.checkpoint or _open_start(args, settings, book=True)
    _check_memory(opened, settings, cfg.dtype, cfg.batch_size, cfg.device)
    model, tokenizer = finetuning.start_model(opened)
    new = start.checkpoint is None
    model, task, line = finetuning.prepare_book(kind, model, tokenizer, settings, cfg, new, getattr(args, "responses", None))
    say(line)
    if new:
        cfg.max_steps = finetuning.book_steps(args.epochs or recipe.epochs, task.steps_per_epoch, args.max_steps)
    say(_parameter_summary(model, settings))
    say(f"training: {cfg.max_steps:,} steps ({cfg.max_steps / task.steps_per_epoch:.2f} epochs of "
        f"{task.steps_per_epoch:,} batches of {cfg.batch_size}), AdamW lr {cfg.lr:g}, weight decay "
        f"{cfg.weight_decay:g}, as {recipe.summary}")
    meta = {"finetune": settings, **({"labels": book_ch06.LABELS} if kind == "classify" else {})}
    return Prepared(model, tokenizer, task, cfg, meta, recipe)


def _check_memory(source, settings: dict, dtype: str, batch_size: int, device: str | None) -> None:
    """check_training_memory for the model a run starts from (its config read without its weights): full
    finetuning's gradients and AdamW state counted for every weight; with LoRA or a frozen body, the weights
    and activations alone."""
    cfg = formats.open(source).config_before_weights()  # a Qwen3/Llama hub id's: its config.json alone
    if cfg is not None:
        check_training_memory(cfg, dtype, batch_size, settings.get("max_length") or cfg.context_length, device,
                              model_flags=False, frozen=bool(settings.get("lora_rank")) or settings.get("trainable") != "all")


def _report(result: dict, cfg: TrainConfig, task, tokenizer, model, kind: str) -> None:
    run_dir = cfg.out
    if isinstance(task, book_ch06.BookClassifierTask):  # the notebook's last cell, on the weights it ended with
        for line in book_ch06.accuracy_lines(task.final_accuracies(model)):
            print(line)
        print(f"model: {run_dir}   try: glassgpt classify \"...\" --model {run_dir}")
        return
    if isinstance(task, book_ch07.BookInstructionTask):  # the notebook's responses to the test set
        with StepBar("responses", unit="record") as bar:  # 256 greedy tokens each, at most
            path = book_ch07.write_responses(model, tokenizer, task.test_records,
                                             Path(run_dir) / book_ch07.RESPONSES_FILE, exact(cfg), bar)
        print(f"responses: {path} ({len(task.test_records):,} test records, as the book writes them)")
        print(f"model: {run_dir}   try: glassgpt chat \"...\" --model {run_dir} --recipe book")
        return
    if result["val_loss"] is not None:
        print(f"done: step {result['step']:,}, val loss {result['val_loss']:.4f} "
              f"(best {result['best_val_loss']:.4f}), {result['elapsed_s']:.0f} s of training")
    best = formats.open(run_dir).load(cfg.device, "float32")  # best/ if any: what users will load
    if kind == "classify":
        _report_classification(best, task, Path(run_dir))
        print(f"model: {run_dir}   try: glassgpt classify \"...\" --model {run_dir}")
    else:
        rec = task.sample_records[0] if task.sample_records else None
        if rec is not None:
            answer = instruct.respond(best, tokenizer, rec["instruction"], rec["input"], max_new_tokens=cfg.sample_tokens or 64)
            print(f"sample: {rec['instruction']!r}\n  -> {answer!r}")
        print(f"model: {run_dir}   try: glassgpt chat \"...\" --model {run_dir}")


def _open_start(args: argparse.Namespace, settings: dict[str, Any], book: bool = False) -> formats.Source:
    """The model a new run starts from, opened with the model flags, its lines said first (a drop_rate assumed
    matters to glassgpt's recipe; the book's chapters 6 and 7 finetune with drop_rate 0.0, what is assumed)."""
    return open_model(args, spec=settings["model"], dropout_matters=not book)


def _new_settings(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    return finetuning.new_settings(kind, **{name: getattr(args, name, None) for name in SETTINGS})


def _resume_settings(args: argparse.Namespace, kind: str, start: Start) -> dict[str, Any]:
    """The run's settings (model, data, columns, LoRA), with its data checked unchanged."""
    given = given_flags(args, SETTINGS + MODEL_FLAGS + ("epochs",))
    if given:
        raise GlassError(f"--resume continues a run with its own model and data: drop {given[0]} "
                         "(training flags such as --max-steps may change)")
    return finetuning.resumed_settings(start.checkpoint, start.run_dir.path, kind)


def _train_config(args: argparse.Namespace, kind: str, n_train: int, emb_dim: int, saved: dict | None,
                  world: int) -> TrainConfig:
    """The run's TrainConfig: a resumed run's own, or the flags over glassgpt's finetuning defaults
    (examples.finetune_defaults); --epochs sets max_steps, --max-steps sets it directly (cli/run.py refuses both)."""
    if saved is not None:
        return train_config_from_args(args, saved)
    base = examples.finetune_defaults(n_train, emb_dim, args.batch_size or default("batch_size"), args.grad_accum or 1,
                                world, args.epochs or DEFAULTS[kind]["epochs"], args.max_steps,
                                sample_tokens=0 if kind == "classify" else 64)
    return train_config_from_args(args, {"out": args.out, **base})


# --- classification ------------------------------------------------------------------------

def _report_classification(model, task: classify.ClassificationTask, run_dir: Path) -> None:
    report = finetuning.classification_report(model, task, run_dir)
    print(f"validation accuracy: {report['accuracy']:.2%} of {report['n']:,} texts (best/ checkpoint)")
    print(format_confusion(report["matrix"], report["labels"]))
    print("confusion matrix: " + ", ".join(str(f) for f in report["files"]))


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
    source = open_model(args)
    model, tokenizer = load(args, source)
    if model.cfg.num_classes is None:
        raise GlassError(f"{args.model} is a language model (no classifier head): make a classifier with "
                         "glassgpt finetune classify")
    reading, notes = classifier_reading_of(source, args.recipe, args.max_length)
    labels = class_names(source, model.cfg.num_classes, reading.padded)
    prompt = reading.fit(tokenizer.encode(args.text), model.cfg.context_length)
    hint = f": {BOOK_FILE_HINT}" if not reading.padded and source.kind == "state_dict" else ""
    for note in [f"{args.model}: {n}" for n in notes] + [prompt.note, reading.line(prompt) + hint]:
        if note:
            print(f"note: {note}", file=sys.stderr)
    probs = book_ch06.class_probs(model, prompt.ids)
    k = int(probs.argmax())
    if args.json:
        print(json.dumps({"label": labels[k], "prob": float(probs[k])}))
    else:
        print(f"{labels[k]}\t{float(probs[k]):.4f}")
    return 0


# --- instructions ----------------------------------------------------------------------------

def run_chat(args: argparse.Namespace) -> int:
    if args.model is None:
        raise GlassError("glassgpt chat needs --model RUN_DIR (a run of glassgpt finetune instruct)")
    if args.instruction is not None and not args.instruction.strip():
        raise GlassError("the instruction is empty: say what the model should do")
    if args.recipe == recipes.BOOK and (args.temperature or args.top_k or args.top_p):
        raise GlassError("--recipe book answers greedily, as the book's chapter 7 does: drop --temperature, --top-k "
                         "and --top-p")
    prompt_bytes = len(instruct.format_prompt(args.instruction or "", args.input).encode("utf-8"))
    model, tokenizer = load(args, tokens=prompt_bytes + args.max_new_tokens, new_tokens=args.max_new_tokens)
    require_language_model(model, args.model)
    if tokenizer.eot_id is None:
        raise GlassError(f"{args.model}'s tokenizer has no <|endoftext|>, so an answer could not end: "
                         "use a model finetuned with glassgpt finetune instruct")
    if args.instruction is not None:
        instructions = [args.instruction]
    else:
        if sys.stdin.isatty():
            print("one instruction per line; Ctrl-D ends", file=sys.stderr)
        instructions = (line.strip() for line in stdin_lines())
    for instruction in instructions:
        if not instruction:
            continue
        cut = fit_prompt(tokenizer.encode(instruct.format_prompt(instruction, args.input)), model.cfg.context_length)
        if cut.note:  # generation reads the window's last tokens, as it does for every prompt
            print(f"note: {cut.note}", file=sys.stderr)
        if args.recipe == recipes.BOOK:
            print(book_ch07.respond(model, tokenizer, {"instruction": instruction, "input": args.input},
                                    args.max_new_tokens), flush=True)
            continue
        print(instruct.respond(model, tokenizer, instruction, args.input, args.max_new_tokens, args.temperature,
                         args.top_k, args.top_p, args.seed), flush=True)
    return 0
