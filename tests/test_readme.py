"""The README works as written: its Python runs, its commands parse, the cheap ones run.

Every ```python block of README.md runs as it stands, in a fresh interpreter (so an import
that some other test happened to do cannot hide a missing one). Every `glassgpt ...` command line
in its ```bash blocks (also `python -m glassgpt ...` and `torchrun ... -m glassgpt ...`;
`pip`, `flock` and other programs are left alone) must parse with the real argument
parser, and those that need no hub, no data and no run directory run for real, in a
temporary directory: `info` on any preset, `explain` and `generate` on the gpt2 preset
(without --compile, which takes minutes; `generate` with MAX_NEW_TOKENS appended, since
argparse takes the last value, so every other flag still runs as written). The tests read
whatever the README says today, so they follow its edits.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import glassgpt
from glassgpt.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"
SEPARATORS = {"&&", "||", ";", "|", "&"}
CHEAP_TO_RUN = {"info": set(glassgpt.PRESETS), "explain": {"gpt2"}, "generate": {"gpt2"}}
MAX_NEW_TOKENS = ["--max-new-tokens", "3"]  # 50 (the default) random-weight tokens prove nothing more


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


def shell_commands(block: str) -> list[list[str]]:
    """The simple commands of a bash block: continuation lines joined, comments dropped,
    `a && b; c | d` split into [a], [b], [c], [d]."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in list(lexer) + [";"]:
            if token in SEPARATORS:
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def glassgpt_argv(words: list[str]) -> list[str] | None:
    """The arguments after `glassgpt` (or after `-m glassgpt`), or None for another program."""
    if words[0] == "glassgpt":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "glassgpt" and words[0] not in ("pip", "flock"):
            return words[i + 2:]
    return None


def readme_commands() -> list[list[str]]:
    argvs = [glassgpt_argv(words) for block in fenced_blocks("bash") for words in shell_commands(block)]
    return [argv for argv in argvs if argv is not None]


def is_cheap(argv: list[str]) -> bool:
    args = build_parser().parse_args(argv)
    models = CHEAP_TO_RUN.get(args.command, set())
    return getattr(args, "model", None) in models and not getattr(args, "compile", False)


COMMANDS = readme_commands()
PYTHON_BLOCKS = fenced_blocks("python")


def test_the_readme_has_commands_and_python_to_check():
    assert len(COMMANDS) >= 10 and PYTHON_BLOCKS
    assert any(is_cheap(argv) for argv in COMMANDS)


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_every_python_block_runs_as_written(code, tmp_path):
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{code}\n{result.stderr}"


@pytest.mark.parametrize("argv", COMMANDS, ids=[shlex.join(argv)[:60] for argv in COMMANDS])
def test_every_glassgpt_command_parses(argv):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"README command does not parse: glassgpt {shlex.join(argv)}")
    assert args.command == argv[0]  # the subcommand it names, never another one it abbreviates


CHEAP = [argv for argv in COMMANDS if is_cheap(argv)]


@pytest.mark.parametrize("argv", CHEAP, ids=[shlex.join(argv)[:60] for argv in CHEAP])
def test_every_cheap_command_runs(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(argv + (MAX_NEW_TOKENS if argv[0] == "generate" else []))
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err
    args = build_parser().parse_args(argv)
    for name in ("out", "attention_out"):
        path = getattr(args, name, None)
        if path:
            assert (tmp_path / path).is_file(), f"glassgpt {shlex.join(argv)} wrote no {path}"
