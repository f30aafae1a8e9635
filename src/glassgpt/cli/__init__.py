"""The `glassgpt` command line: the only place that reads flags, prints, or shows progress bars.

Each group of subcommands lives in its own module and registers itself with
`add_parser(subparsers)`. Errors that the user can fix (GlassError, bad files,
bad flags) end as one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import GlassError
from .common import notes_for_warnings

EXIT_USAGE = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (`error: ...`) and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"error: {message} (see '{self.prog} --help')\n")
        sys.exit(EXIT_USAGE)


def build_parser() -> ArgumentParser:
    from . import core

    parser = ArgumentParser(prog="glassgpt", description="GPT-2 from scratch, and a way to see it.")
    parser.add_argument("--version", action="version", version=f"glassgpt {__import__('glassgpt').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    sub.required = True
    for module in (core,) + _optional_modules():
        module.add_parsers(sub)
    return parser


def _optional_modules() -> tuple:
    """Command groups added by later parts of glassgpt (training, finetuning, the web page)."""
    import importlib

    modules = []
    for name in ("explain", "diff", "train", "finetune", "serve", "export"):
        try:
            modules.append(importlib.import_module(f"{__name__}.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    return tuple(modules)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
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
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
