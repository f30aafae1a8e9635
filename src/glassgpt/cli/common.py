"""Flags and loading shared by the subcommands."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import warnings

import torch

from ..device import pick_threads, resolve_device, resolve_dtype, usable_cores
from ..errors import GlassError
from ..model import GPTModel
from ..tokenizer import ENDOFTEXT, Tokenizer, check_fits
from ..errors import CacheWarning, ConfigError, KernelWarning, RandomWeightsWarning
from .. import formats
from .. import memory
from ..formats import Source
from ..memory import QUANTIZED, inference_fit, training_fit
# Every number flag parses through cli/limits.py; the commands import the common kinds from here.
from .limits import (fraction, nonneg_float, nonneg_int, positive_float, positive_int, probability,  # noqa: F401
                     seed, temperature)
# The prompt checks live in one place (prompt.py); the commands import them from here.
from ..prompt import check_text as check_prompt, encode as encode_prompt  # noqa: F401


def is_main_rank() -> bool:
    """True in a plain process and on rank 0 of a torchrun job: the one that prints and writes."""
    return os.environ.get("RANK", "0") == "0"


def say(*parts, **kwargs) -> None:
    """print(), on the main rank only: a torchrun job reports once, not once per rank."""
    if is_main_rank():
        print(*parts, **kwargs)


@contextlib.contextmanager
def notes_for_warnings():
    """Inside, a RandomWeightsWarning (load_model of a preset), a KernelWarning (glassgpt's CPU
    kernels could not be built here) or a CacheWarning (a cached file was made again) prints as one
    `note: ...` line on stderr, and not as Python's warning with its file and line."""
    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always", RandomWeightsWarning)
        show = warnings.showwarning

        def note(message, category, *args, **kwargs):
            if issubclass(category, (RandomWeightsWarning, KernelWarning, CacheWarning)):
                say(f"note: {message}", file=sys.stderr)
            else:
                show(message, category, *args, **kwargs)

        warnings.showwarning = note
        yield


def add_model_args(p: argparse.ArgumentParser, default: str | None = "gpt2", quantized: bool = False) -> None:
    p.add_argument("--model", default=default, metavar="SPEC",
                   help="preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt2-book, ...: random weights), "
                        "checkpoint or run directory, Hugging Face-layout directory, hub id such as "
                        "openai-community/gpt2, the book's model.pth, its gpt2/124M folder, or a .gguf file"
                        + (f" (default: {default})" if default else ""))
    add_source_args(p)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="float32",
                   help="float32: exact, the reference's logits and greedy tokens; bfloat16 / float16: half "
                        "the bytes, logits within ~3%% of their largest, so near-ties can pick another token; "
                        "auto: bfloat16 where a bf16 matmul measures faster than float32 here"
                        + ("; int8: weight-only, a quarter of float32's bytes per token, perplexity within 1%% "
                           "of float32's, near-ties pick other tokens more often; int4: 4-bit weights in groups of "
                           "32 columns (emb_dim a multiple of 32), an eighth of float32's bytes, perplexity a few "
                           "%% above float32's (benchmarks/RESULTS.md)" if quantized else "")
                        + " (default: float32)")
    p.add_argument("--seed", type=seed, default=None,
                   help="random seed in [0, 2**64) (initialisation of presets; sampling)")
    add_threads_arg(p)


dropout = fraction  # a share of the activations zeroed: [0, 1)


# The model flags every command that reads a state dict takes, declared here once and passed to formats.open.
N_HEADS_HELP = ("attention heads of a .pth state dict, whose shapes cannot tell (default: n_heads in the .json "
                "beside it, else GPT-2's rule of 64 per head, said in a note)")
DROP_RATE_HELP = ("dropout of a .pth state dict, which cannot record it (default: drop_rate in the .json beside it, "
                  "else 0.0, said in a note)")


TOKENIZER_HELP = ("the tokenizer to read and write text with, in place of the model's own: gpt2 (GPT-2's), or a "
                  "file: a Qwen3-style tokenizer.json, a Llama 3 tokenizer.model, or a tokenizer .json glassgpt saved "
                  "(default: the one saved with the model, else GPT-2's)")


def add_source_args(p: argparse.ArgumentParser, context_length: str | None = None, n_heads: str = N_HEADS_HELP,
                    drop_rate: str = DROP_RATE_HELP, tokenizer: bool = True) -> None:
    """--n-heads, --drop-rate, --tokenizer and, where a command reads windows, --context-length (its help given):
    the flags that formats.open takes, in every command that reads a model (train gives them its own help, and
    its own --tokenizer, too)."""
    if tokenizer:
        p.add_argument("--tokenizer", dest="model_tokenizer", default=None, metavar="gpt2|FILE", help=TOKENIZER_HELP)
    p.add_argument("--n-heads", type=positive_int, default=None, metavar="H", help=n_heads)
    p.add_argument("--drop-rate", type=dropout, default=None, metavar="P", help=drop_rate)
    if context_length is not None:
        p.add_argument("--context-length", type=positive_int, default=None, metavar="T", help=context_length)


def open_model(args: argparse.Namespace, spec=None, dropout_matters: bool = False, window: bool = False) -> Source:
    """formats.open of --model (or `spec`) with the model flags, its first lines said at once on stderr: the
    checkpoint a run directory opens as, then a note for each value that was assumed (drop_rate only where
    the command trains or writes it: `dropout_matters`). `window`: --context-length is a window length."""
    source = formats.open(args.model if spec is None else spec, n_heads=getattr(args, "n_heads", None),
                          drop_rate=getattr(args, "drop_rate", None),
                          context_length=getattr(args, "context_length", None) if window else None,
                          tokenizer=getattr(args, "model_tokenizer", None))
    say_opened(source, dropout_matters)
    return source


def say_opened(source: Source, dropout_matters: bool = False) -> None:
    """The lines a command says of the model it opened, on stderr (the first it prints)."""
    if source.checkpoint is not None:
        say(f"note: {source.checkpoint.line()}", file=sys.stderr)
    if (origin := source.config_origin()) is not None:
        say(f"note: {origin}", file=sys.stderr)
    if source.kind == "state_dict":
        for note in source.notes():
            if note.assumed and (dropout_matters or note.field != "drop_rate"):
                say(f"note: {note}", file=sys.stderr)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for the model's ops, at most the cores this process may use (more is capped, "
                        "with a note) (default: 1 for models with emb_dim < 512, else the cores that other work "
                        "leaves free now, measured at start, at least 1: on a 2-core machine with one core busy, 2 "
                        "threads generated 10x slower than 1; OMP_NUM_THREADS=N also sets it)")


def threads_from_env() -> int | None:
    """OMP_NUM_THREADS as a count of threads; None when unset, or (with a note) when it is not one."""
    value = os.environ.get("OMP_NUM_THREADS")
    if value is None or not value.strip():
        return None
    try:
        n = int(value.strip())
    except ValueError:
        n = 0
    if n <= 0:
        say(f"note: OMP_NUM_THREADS={value!r} is not a positive integer: ignored, as if it were unset",
            file=sys.stderr)
        return None
    return n


def set_threads(requested: int | None, emb_dim: int, file=None, recorded: int | None = None) -> int:
    """Set torch's intra-op threads: --threads, else OMP_NUM_THREADS, else the count a resumed run
    `recorded`, else device.pick_threads; at most device.usable_cores() (capped with a note), so that
    neither torch nor the native step is asked for threads the machine cannot run. Say which, and when a
    resume changes the run's count, what that does to exactness."""
    env = threads_from_env() if requested is None else None
    if requested is not None:
        n, why = requested, "--threads"
    elif env is not None:
        n, why = env, "OMP_NUM_THREADS"
    elif recorded is not None:
        n, why = recorded, "the run's own, kept on resume"
    else:
        n, why = pick_threads(emb_dim, torch.get_num_threads())
    most = usable_cores()
    if n > most:
        say(f"note: {n:,} threads ({why}) are more than the {most} cores this process may use: {most} threads",
            file=sys.stderr)
        n, why = most, f"{why}, capped at the cores"
    torch.set_num_threads(n)
    say(f"threads: {n} ({why}; --threads N to change)", file=file or sys.stderr)
    if recorded is not None and n != recorded:
        say(f"note: the run trained with {recorded} threads and resumes with {n} ({why}): sums split over another "
            "number of threads add in another order, so the results may differ from an uninterrupted run's in the "
            f"last bits (--threads {recorded} resumes exactly)", file=sys.stderr)
    return n


def load(args: argparse.Namespace, source: Source | None = None, tokens: int = 1,
         new_tokens: int = 0) -> tuple[GPTModel, Tokenizer]:
    """The model and tokenizer of `source` (default: --model, opened here) on --device in --dtype (int8 and int4
    quantize: source.load), once its config is known to fit in the memory available for a sequence of `tokens`
    tokens, `new_tokens` of them generated (check_inference_memory); a preset's RandomWeightsWarning becomes a
    note (see notes_for_warnings)."""
    source = source or open_model(args)
    cfg = source.config_before_weights()  # a Qwen3/Llama hub id's from its config.json alone
    if cfg is not None:  # a GPT-2 hub id's is read with its weights: checked once it is loaded
        check_inference_memory(args, cfg, tokens, new_tokens)
    model = source.load(args.device, args.dtype, seed=args.seed if args.seed is not None else 0)
    if cfg is None:
        check_inference_memory(args, model.cfg, tokens, new_tokens, loaded=model)
    tokenizer = source.tokenizer()
    check_fits(tokenizer, model.cfg.vocab_size, "the checkpoint's tokenizer.json does not belong to it")
    set_threads(getattr(args, "threads", None), model.cfg.emb_dim)
    return model, tokenizer


def check_inference_memory(args: argparse.Namespace, cfg, tokens: int, new_tokens: int = 0, loaded=None) -> None:
    """Refuse (one line, with the nearest setting that fits) a model and sequence that the memory available
    now cannot hold, before they are allocated; a note where only swap would be touched (memory.inference_fit).
    `loaded`: a model already in memory, whose weights are no longer available but are ours."""
    device = resolve_device(args.device)
    dtype = args.dtype if args.dtype in QUANTIZED else resolve_dtype(args.dtype, device)
    free = memory.available_memory(device)
    if loaded is not None:
        held = sum(t.numel() * t.element_size() for t in {id(t): t for t in loaded.state_dict().values()}.values())
        free = dataclasses.replace(free, ram=free.ram + held)
    try:
        note = inference_fit(cfg, dtype, max(1, tokens), free, new_tokens=new_tokens)
    except ConfigError as err:  # name the model whose config asks for it
        raise ConfigError(f"{getattr(args, 'model', None) or 'the model'}: {err}") from None
    if note:
        say(f"note: {note}", file=sys.stderr)


def check_training_memory(cfg, dtype: str, batch_size: int, seq_len: int, device: str | None,
                          model_flags: bool = True, frozen: bool = False) -> None:
    """Refuse training that the memory available now cannot hold (weights, gradients, AdamW's state, one
    batch's activations), before any of it is allocated; a note where only swap would be touched."""
    dev = resolve_device(device)
    note = training_fit(cfg, resolve_dtype(dtype, dev), batch_size, min(seq_len, cfg.context_length),
                        memory.available_memory(dev), model_flags, frozen)
    if note:
        say(f"note: {note}", file=sys.stderr)


# --- <|endoftext|> in text: plain text unless --allow-special -----------------------------------

ALLOW_SPECIAL_HELP = (f"read {ENDOFTEXT} in {{what}} as the one token that ends a text (id 50256 in GPT-2's "
                      "vocabulary), as tiktoken's encode(allowed_special={{'<|endoftext|>'}}) and transformers' GPT-2 "
                      f"tokenizer read it (default: as plain text, the characters <, |, endoftext, ... in 7 tokens, "
                      "as tiktoken's encode_ordinary; tiktoken's encode refuses it)")


def add_special_arg(p: argparse.ArgumentParser, what: str = "the prompt") -> None:
    p.add_argument("--allow-special", action="store_true", default=None,  # None: not given (a resume's check)
                   help=ALLOW_SPECIAL_HELP.format(what=what))


def special_reading(tokenizer: Tokenizer, text: str, allow: bool, what: str = "the prompt") -> tuple[set[str], str | None]:
    """(allowed_special for tokenizer.encode, a note saying how ENDOFTEXT in `text` was read, or None when
    it holds none)."""
    if allow and tokenizer.eot_id is None:
        raise GlassError(f"--allow-special reads {ENDOFTEXT} as its token, and this {tokenizer.name} tokenizer has "
                         f"none: drop --allow-special")
    allowed = {ENDOFTEXT} if allow else set()
    if ENDOFTEXT not in text:
        return allowed, None
    if allow:
        return allowed, f"{ENDOFTEXT} in {what} was read as the one token {tokenizer.eot_id} (--allow-special)"
    pieces = tokenizer.encode(ENDOFTEXT)
    return allowed, (f"{ENDOFTEXT} in {what} was read as plain text (on its own {len(pieces)} tokens {pieces}); "
                     f"--allow-special reads it as the one token {tokenizer.eot_id}")


def require_language_model(model: GPTModel, spec: str) -> None:
    """Refuse a classifier where next-token scores are needed (generate, eval, chat)."""
    if model.cfg.num_classes is not None:
        raise GlassError(f"{spec} is a classifier ({model.cfg.num_classes} classes, no next-token head): use "
                         "glassgpt classify with it, or a language model here")


# --- how a classifier reads a text: classify, explain and serve ---------------------------------

def add_reading_args(p: argparse.ArgumentParser) -> None:
    from ..training import recipes  # (here, not above: `generate` does not wait for training's modules)

    p.add_argument("--recipe", choices=[recipes.BOOK],
                   help="book: read a classifier as the book's classify_review does, the text padded with 50256 to "
                        "--max-length and the last position read (default: as its checkpoint records it was trained)")
    p.add_argument("--max-length", type=positive_int, metavar="N",
                   help="--recipe book: the padded length it was trained at (the book's train_dataset.max_length)")


def classifier_reading_of(source: Source, recipe: str | None, max_length: int | None):
    """(reading, notes): how the classifier `source` reads a text, as its checkpoint records it was finetuned, or
    with `--recipe book [--max-length N]` as the book's classify_review reads it (Source.classifier_reading)."""
    from ..training import recipes

    return source.classifier_reading(recipe == recipes.BOOK, max_length)


def class_names(source: Source, num_classes: int, book: bool) -> list[str]:
    """The run's labels, or {"labels": [...]} beside a .pth, or the book's "not spam"/"spam", or the indices."""
    labels = source.labels
    if labels is not None and len(labels) != num_classes:
        raise GlassError(f"{source.name} has {num_classes} classes but its labels name {len(labels)} ({labels}): give "
                         "one name for each class")
    from ..training.book import ch06 as book_ch06

    if labels is None and book and num_classes == len(book_ch06.LABELS):
        labels = book_ch06.LABELS
    return labels or [str(k) for k in range(num_classes)]
