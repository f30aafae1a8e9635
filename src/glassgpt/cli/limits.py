"""What a number flag may be: the one layer every numeric flag of every command parses through.

Each number flag's `type` is made here by `number(kind, ok, words)`, directly (the flags of
common.py, core.py, serve.py, ...) or from a declaration that already bounds it (TrainConfig's
`Check`s: cli/run.py; explain/options.py's `Option`s). Before a command starts, a value
  - is a number of the flag's kind, and finite: nan and inf are refused for every float;
  - fits in 64 bits when it is an integer (torch's and numpy's counters), a seed in [0, 2**64)
    (what torch.Generator.manual_seed takes), a port in [0, 65535] (0: a free one);
  - meets the flag's own bounds, said in words ("a positive integer", "in (0, 1]").
Sizes that only the model and the machine can bound (tokens to generate, the batch to hold) are
checked once both are known and before anything is allocated: cli/common.py `check_memory`.

A parser made here carries `.kind` (int or float), so tests can find every numeric flag of
every command from the argparse parser itself (tests/test_cli_limits.py).
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

INT64_MAX = 2**63 - 1
SEED_END = 2**64  # torch.Generator.manual_seed takes [-(2**63), 2**64); glassgpt's seeds are [0, 2**64)
PORT_MAX = 65535
# Below this, logits / temperature overflows float32 (max 3.4e38) for any logit above 3.4e8: sampling
# that close to 0 is greedy anyway, and 0 says so. The upper end is explain's (options.py).
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 100.0


def number(kind: type, ok: Callable[[Any], bool], words: str, most: int = INT64_MAX) -> Callable[[str], Any]:
    """argparse's `type` for a number flag: `kind(text)`, finite, within 64 bits (integers: |v| <= most),
    and `ok(value)`; else an ArgumentTypeError that argparse prints as one line with the flag's name."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if kind is int else 'a number'} ({words}), got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number ({words}), got {text}")
        if kind is int and not -most - 1 <= value <= most:  # (a seed's words state its own range)
            fits = "" if most != INT64_MAX else f" that fits in 64 bits (at most {most:,})"
            raise argparse.ArgumentTypeError(f"must be {words}{fits}, got {text}")
        if not ok(value):  # written as `not ok` so that nan fails every check
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value
    parse.kind = kind  # type: ignore[attr-defined]
    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


positive_int = number(int, lambda v: v > 0, "a positive integer")
nonneg_int = number(int, lambda v: v >= 0, "a non-negative integer")
nonneg_float = number(float, lambda v: v >= 0, ">= 0")
positive_float = number(float, lambda v: v > 0, "a positive number")
probability = number(float, lambda v: 0 < v <= 1, "in (0, 1]")
fraction = number(float, lambda v: 0 <= v < 1, "in [0, 1)")
seed = number(int, lambda v: 0 <= v < SEED_END, "an integer in [0, 2**64)", most=SEED_END - 1)
port = number(int, lambda v: 0 <= v <= PORT_MAX, f"a TCP port in [1, {PORT_MAX}], or 0 for a free one")
temperature = number(float, lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
                     f"0 (greedy) or a temperature from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}: below "
                     f"{MIN_TEMPERATURE:g} the logits divided by it overflow float32, and sampling is greedy anyway")
