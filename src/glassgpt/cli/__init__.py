"""The `glassgpt` command line: the only place that reads flags, prints, or shows progress bars.

Each group of subcommands lives in its own module and registers itself with
`add_parser(subparsers)`. Errors that the user can fix (GlassError, bad files,
bad flags) end as one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from ..errors import GlassError
from .common import notes_for_warnings
from .text import guard_streams, quiet_stdout, read_text_args

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (`error: ...`) and exit code 2, and a flag is
    never taken from its first letters (`--max-new-token` is not `--max-new-tokens`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message} (see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, where an unknown flag is answered by the subcommand that was given it, with the
    flag it most resembles: `--temprature 1.4` -> did you mean --temperature? (see 'glassgpt generate --help')."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = _command_parser(parser, args)
        known = [o for action in command._actions for o in action.option_strings]
        flags = [e.split("=", 1)[0] for e in extra if e.startswith("-")]
        close = [m for flag in flags for m in difflib.get_close_matches(flag, known, n=1, cutoff=0.6)]
        hint = f": did you mean {close[0]}?" if close else ""
        command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command's own parser that `args` came through, e.g. `glassgpt finetune classify`'s."""
    while True:
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, action.dest, None) if action else None
        if action is None or name not in action.choices:
            return parser
        parser = action.choices[name]


# Which module of cli/ declares each command, so that a command imports only its own (`generate` does not
# wait for explain's or training's modules); tests/test_cli_help.py checks it against the whole parser.
MODULES = ("core", "explain", "compare", "diff", "check", "train", "finetune", "serve", "export")
COMMANDS = {"generate": "core", "info": "core", "download": "core", "explain": "explain", "compare": "compare",
            "diff": "diff", "check": "check", "train": "train", "plot": "train", "tokenizer": "train", "eval": "train",
            "finetune": "finetune", "classify": "finetune", "chat": "finetune", "serve": "serve", "export": "export"}


def build_parser(command: str | None = None) -> ArgumentParser:
    """The whole command line; with `command` (one of COMMANDS), only the commands of its module."""
    parser = ArgumentParser(prog="glassgpt", description="GPT-2 from scratch, and a way to see it.")
    parser.add_argument("--version", action="version", version=f"glassgpt {__import__('glassgpt').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    sub.required = True
    for name in (COMMANDS[command],) if command in COMMANDS else MODULES:
        importlib.import_module(f".{name}", __name__).add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line. Its streams first (cli/text.py): output that a stream cannot encode is escaped,
    text in argv and stdin is read as it was meant, and a pipe closed early ends the command quietly."""
    guard_streams()
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(argv[0] if argv else None)
        args = parse(parser, argv)
        read_text_args(args)
        with notes_for_warnings():
            return args.run(args) or 0
    except GlassError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as e:
        print(f"error: {e.filename or e}: no such file or directory", file=sys.stderr)
        return EXIT_USAGE
    except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
        print(f"error: {e.filename or e}: {e.strerror}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `glassgpt ... | head -1`: the reader has what it wanted
        quiet_stdout()
        return 0


if __name__ == "__main__":
    sys.exit(main())
