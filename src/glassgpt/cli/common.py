"""Flags and loading shared by the subcommands."""

from __future__ import annotations

import argparse
import sys

from ..errors import GlassError
from ..model import GPTModel
from ..tokenizer import Tokenizer
from ..weights import is_random_init, load_model, load_tokenizer


def positive_int(text: str) -> int:
    value = nonneg_int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_model_args(p: argparse.ArgumentParser, default: str | None = "gpt2") -> None:
    p.add_argument("--model", default=default, metavar="SPEC",
                   help="preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl: random weights), checkpoint or "
                        "run directory, Hugging Face-layout directory, or hub id such as openai-community/gpt2"
                        + (f" (default: {default})" if default else ""))
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto (default: float32)")
    p.add_argument("--seed", type=int, default=None, help="random seed (initialisation of presets; sampling)")


def load(args: argparse.Namespace) -> tuple[GPTModel, Tokenizer]:
    """The model and tokenizer that --model names, with a note on stderr when the weights are random."""
    model = load_model(args.model, device=args.device, dtype=args.dtype,
                       seed=args.seed if args.seed is not None else 0)
    tokenizer = load_tokenizer(args.model)
    if tokenizer.n_vocab > model.cfg.vocab_size:
        raise GlassError(f"the tokenizer has {tokenizer.n_vocab:,} tokens but the model's vocab_size is "
                         f"{model.cfg.vocab_size:,}: the checkpoint's tokenizer.json does not belong to it")
    if is_random_init(args.model):
        print(f"note: {args.model} has random weights (a preset, not trained): the shapes are real, the "
              "probabilities and text are not. Load trained weights with --model openai-community/gpt2 "
              "or a checkpoint directory.", file=sys.stderr)
    return model, tokenizer


def check_prompt(prompt: str) -> None:
    """Refuse an empty prompt; call it before loading a model, so the error comes at once."""
    if not prompt:
        raise GlassError("the prompt is empty: give some text, e.g. \"Every effort moves you\"")


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    check_prompt(prompt)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise GlassError("the prompt encodes to no tokens: give some text")
    return ids
