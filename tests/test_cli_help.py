"""Every flag in every `--help` has a description, and states its default.

Walks every subcommand of `glassgpt.cli.build_parser()` (nested ones too, e.g.
`finetune classify`) and checks each option except -h/--help: its help text is not
empty, and when its default is neither None nor False, the help says "default" and
names the value (for a number, a number equal to it, however written: 6e-4 or 0.0006).
"""

from __future__ import annotations

import argparse
import math
import re

import pytest

from glassgpt.cli import build_parser

from helpers import subparsers





def options():
    """(command, flag, action) for every option of every subcommand but -h/--help."""
    for command, parser in subparsers(build_parser()):
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield command, max(action.option_strings, key=len), action, parser


def names_the_default(help_text: str, default) -> bool:
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        numbers = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", help_text.replace(",", ""))
        return any(math.isclose(float(n), default, rel_tol=1e-9) for n in numbers)
    return str(default) in help_text


CASES = [pytest.param(action, parser, id=f"{command} {flag}") for command, flag, action, parser in options()]


def test_every_subcommand_has_options_to_check():
    commands = {command for command, *_ in options()}
    assert {"generate", "info", "serve", "explain", "train"} <= commands


@pytest.mark.parametrize("action, parser", CASES)
def test_every_flag_has_help_that_states_its_default(action, parser):
    help_text = parser._get_formatter()._expand_help(action) if action.help else ""
    assert help_text.strip() and action.help is not argparse.SUPPRESS, "no help text"
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return
    assert "default" in help_text.lower(), f"help does not mention the default {default!r}: {help_text!r}"
    assert names_the_default(help_text, default), f"help does not name the default {default!r}: {help_text!r}"


def test_each_command_is_parsed_by_its_own_module_alone_as_by_the_whole_parser():
    # `glassgpt generate` builds only cli/core's parsers (a command imports only its own module):
    # the map names every command, and each command's parser alone takes its flags as the whole one.
    from glassgpt.cli import COMMANDS

    whole = build_parser()
    top = {command for command, _ in subparsers(whole) if " " not in command}
    assert set(COMMANDS) == top
    for command in COMMANDS:
        alone = {name for name, _ in subparsers(build_parser(command))}
        assert command in alone
        assert dict(subparsers(build_parser(command)))[command].format_help() == \
            dict(subparsers(whole))[command].format_help()
