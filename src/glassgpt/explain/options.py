"""Each option of an analysis, declared once: the CLI flag, the API field and the page's control
are derived from the declaration, so that the three cannot drift apart.

    WHY_OPTIONS: why, versus, patch   (explain --why [--versus TOKEN] [--patch CORRUPTED_PROMPT])

`add_flags(parser, options)` adds `--name` flags; `api_fields(options)` gives pydantic field
definitions for the web request; `controls(options)` is the list the page reads to draw its
controls (GET /api/model's `controls`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    name: str          # the API field; the flag is --name with "-" for "_"
    kind: type         # bool, int, float or str
    default: Any
    help: str          # one sentence, for --help, the API's schema and the page's tooltip
    metavar: str | None = None
    page: str = "input"  # the page's control: "checkbox", "input" (text) or "none"

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


WHY_OPTIONS = (
    Option("why", bool, False, "which parts of the model (blocks, heads, feed-forwards) and which prompt tokens "
           "made the next token: the direct logit attribution, each prompt token's direct and causal share",
           page="checkbox"),
    Option("versus", str, None, "with --why: explain logit[top] - logit[TOKEN] instead of the top token's logit "
           "(a single token, e.g. ' the'; a class name for a classifier)", metavar="TOKEN"),
    Option("patch", str, None, "with --why: activation patching from this corrupted prompt (as many tokens as the "
           "prompt): where the information that decides the token sits, block by block and position by position",
           metavar="CORRUPTED_PROMPT"),
)


def add_flags(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    for o in options:
        default = "off" if o.kind is bool else o.default
        help_text = f"{o.help} (default: {default})"
        if o.kind is bool:
            parser.add_argument(o.flag, action="store_true", help=help_text)
        else:
            parser.add_argument(o.flag, type=o.kind, default=o.default, metavar=o.metavar, help=help_text)


def api_fields(options: tuple[Option, ...]) -> dict[str, tuple[Any, Any]]:
    """`{name: (type, default)}` for pydantic's create_model; a None default makes the field optional."""
    return {o.name: (o.kind | None if o.default is None else o.kind, o.default) for o in options}


def controls(options: tuple[Option, ...]) -> list[dict[str, Any]]:
    """What the page draws: one control per option that has one."""
    return [{"name": o.name, "control": o.page, "help": o.help, "default": o.default, "placeholder": o.metavar}
            for o in options if o.page != "none"]
