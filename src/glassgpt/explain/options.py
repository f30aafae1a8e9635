"""Each option of an analysis, declared once: the CLI flag, the API field and the page's control are
derived from the declaration, so that they cannot drift apart. A trace's options are the fields of the
plain dataclass `TraceOptions`, each declared with `option(...)`.

    TRACE_OPTIONS: top_k, temperature, block, logit_lens, attention, embedding_check (TraceOptions'), layer
    WHY_OPTIONS:   why, versus, patch   (explain --why [--versus TOKEN] [--patch CORRUPTED_PROMPT])

`add_flags(parser, options)` adds `--name` flags (`--no-name` for one on by default);
`api_fields(options)` gives the web request's field definitions; `controls(options)` is the list
the page reads to draw its controls (GET /api/model's `controls`); `check(options, values)` holds
values to the declared bounds.
"""

from __future__ import annotations

import argparse
import math
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import PromptError


@dataclass(frozen=True)
class Option:
    name: str          # the API field and the TraceOptions field; the flag is --name with "-" for "_"
    kind: type         # bool, int, float or str
    default: Any
    help: str          # one sentence, for --help, the API's schema and the page's tooltip
    metavar: str | None = None
    page: str = "input"  # the page's control: "checkbox", "input" (text), "number", "range", "blocks" (one
    #                      choice per trf_block), "always" (the page asks for it every time: a panel shows it)
    #                      or "none"
    label: str | None = None   # the page's words for it (default: the name)
    ge: float | None = None    # bounds of a number: >= ge, > gt, <= le
    gt: float | None = None
    le: float | None = None
    view_only: bool = False    # the terminal view's alone: no API field and no TraceOptions field
    step: float | None = None  # a "range" control's step; its ends are gt/ge and the page's `most`
    most: float | None = None  # a "range" control's right end, when the bound le is wider than a slider should be

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def bounds(self) -> str:
        """The declared bounds in words, e.g. ">= 1 and <= 100" ("" when none)."""
        words = [f"{op} {_num(v)}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le)) if v is not None]
        return " and ".join(words)


MAX_TOP_K = 100


def option(default: Any, help: str, **declared: Any) -> Any:
    """A TraceOptions field that is also an option: its default, and the rest of its `Option` (help, metavar,
    page, label, bounds) as the field's metadata; its name and kind are the field's."""
    return field(default=default, metadata={"option": dict(help=help, **declared)})


@dataclass(frozen=True)
class TraceOptions:
    """What a trace records besides the flow. A field made by `option(...)` is also a flag, an API field
    and a page control (TRACE_OPTIONS, derived below)."""

    top_k: int = option(10, "how many next tokens (or classes) to list, each with its dot product h · W[id]",
                        metavar="K", page="number", label="top-k", ge=1, le=MAX_TOP_K)
    temperature: float = option(1.0, "divides the last logits before the softmax that gives probs",
                                metavar="T", page="range", gt=0, le=100, step=0.05, most=3)
    block: int = option(0, "which of the trf_blocks the flow opens up to show its norms, heads and feed-forward",
                        metavar="N", page="blocks", label="open block", ge=0)
    logit_lens: bool = option(False, "also the top token at every position after every block", page="always")
    attention: bool = option(False, "also every layer's attention weights (the text: a per-head table of --layer "
                             "and a heatmap PNG)", page="always")
    embedding_check: bool = option(True, "check on this prompt that tok_emb(ids) == one_hot(ids) @ tok_emb.weight, "
                                   "the embedding lookup as the matmul it is", page="checkbox",
                                   label="check tok_emb = one_hot · W")
    timing: bool = True  # not an option: the embedding check also times the lookup and the matmul (the terminal's)


def declared_options(options_type: type) -> tuple[Option, ...]:
    """The Options of a dataclass's fields made by `option(...)`, in the order they are declared."""
    kinds = typing.get_type_hints(options_type)
    return tuple(Option(f.name, kinds[f.name], f.default, **f.metadata["option"])
                 for f in fields(options_type) if "option" in f.metadata)


# The terminal view's alone: which block's attention the text's table and the heatmap show.
LAYER = Option("layer", int, 0, "which block's attention --attention shows in the text and the heatmap; independent "
               "of --block (the page and the JSON show every layer)", metavar="N", page="none", ge=0, view_only=True)
TRACE_OPTIONS = (*declared_options(TraceOptions), LAYER)

WHY_OPTIONS = (
    Option("why", bool, False, "which parts of the model (blocks, heads, feed-forwards) and which prompt tokens "
           "made the next token: the direct logit attribution, each prompt token's direct and causal share",
           page="checkbox", label="explain why with every trace"),
    Option("versus", str, None, "with --why: explain logit[top] - logit[TOKEN] instead of the top token's logit "
           "(a single token, e.g. ' the'; a class name for a classifier)", metavar="TOKEN"),
    Option("patch", str, None, "with --why: activation patching from this corrupted prompt (as many tokens as the "
           "prompt): where the information that decides the token sits, block by block and position by position",
           metavar="CORRUPTED_PROMPT"),
)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def _within(o: Option, value: Any) -> bool:
    """Whether a number meets o's bounds (written so that nan fails every one)."""
    if o.kind is float and not math.isfinite(value):
        return False
    if o.kind is int and not -2**63 <= value < 2**63:  # 64 bits, as every integer flag (cli/limits.py)
        return False
    return all((
        o.ge is None or value >= o.ge, o.gt is None or value > o.gt, o.le is None or value <= o.le))


def check(options: tuple[Option, ...], values: Any) -> None:
    """A one-line PromptError for the first of `values`' fields (an object with the options' names) out of bounds."""
    for o in options:
        value = getattr(values, o.name, None)
        if o.kind in (int, float) and value is not None and not _within(o, value):
            raise PromptError(f"{o.name} must be {o.bounds()}, got {value}")


def _parse(o: Option):
    """argparse's type for a number flag: the value, checked against the declared bounds."""
    def parse(text: str):
        try:
            value = o.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if o.kind is int else 'a number'}, got {text!r}") from None
        if not _within(o, value):
            fits = o.kind is not int or -2**63 <= value < 2**63
            raise argparse.ArgumentTypeError(f"must be {o.bounds()}{'' if fits else ' and fit in 64 bits'}, got {text}")
        return value
    parse.kind = o.kind  # a number flag, for the tests that find every one (cli/limits.py)
    return parse


def add_flags(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    """--name for each option; an option that is on by default is turned off with --no-name."""
    for o in options:
        if o.kind is bool and o.default:
            off = "--no-" + o.flag[2:]
            parser.add_argument(off, dest=o.name, action="store_false",
                                help=f"leave out what is on by default: {o.help} (default: True, on)")
        elif o.kind is bool:
            parser.add_argument(o.flag, action="store_true", help=f"{o.help} (default: off)")
        else:
            kind = _parse(o) if o.kind in (int, float) else o.kind
            parser.add_argument(o.flag, type=kind, default=o.default, metavar=o.metavar,
                                help=f"{o.help} (default: {o.default})")


def api_fields(options: tuple[Option, ...]) -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """`{name: (type, default, constraints)}` of the web request's fields (a None default makes the field
    optional); the constraints are pydantic Field's keywords (ge, gt, le, allow_inf_nan)."""
    fields = {}
    for o in options:
        if o.view_only:
            continue
        bounds = {k: getattr(o, k) for k in ("ge", "gt", "le") if getattr(o, k) is not None}
        if o.kind is float:
            bounds["allow_inf_nan"] = False
        fields[o.name] = (o.kind | None if o.default is None else o.kind, o.default, bounds)
    return fields


def controls(options: tuple[Option, ...]) -> list[dict[str, Any]]:
    """What the page draws: one control per option that has one."""
    return [{"name": o.name, "control": o.page, "label": o.label or o.name, "help": o.help, "default": o.default,
             "placeholder": o.metavar, "min": _least(o), "max": o.most or o.le, "step": o.step}
            for o in options if o.page != "none"]


def _least(o: Option) -> float | None:
    """The smallest value a control offers: ge, or one step above gt (which is itself excluded)."""
    if o.ge is not None or o.gt is None:
        return o.ge
    return o.gt + (o.step or 0)
