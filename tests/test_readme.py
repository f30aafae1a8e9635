"""Every page works as written: README.md, CONTRIBUTING.md and every docs/*.md.

Every ```python block runs as it stands, in a fresh interpreter in an empty directory (so an
import that some other test happened to do cannot hide a missing one). Every `glassgpt ...`
command line in a ```bash block (also `python -m glassgpt ...` and `torchrun ... -m glassgpt ...`;
`pip`, `flock` and other programs are left alone) must parse with the real argument parser, and
those that need no hub, no data and no run directory run for real, in a temporary directory:
`info` on any preset, `explain` on gpt2 or gpt2-book and `generate` on gpt2 (without --compile, which takes
minutes; `generate` with MAX_NEW_TOKENS appended, since argparse takes the last value, so every
other flag still runs as written). The tests read whatever the pages say today, so they follow
their edits, and a page whose command drifts from the code fails here.

A ```bash block marked `<!-- runs small -->` on the line before it runs whole, command after
command, in one directory holding the-verdict.txt (its first 3,000 characters) and
../shared/data/tinyshakespeare.txt: each `train` made tiny by flags appended after its own
(argparse takes the last value: one block, 32 wide, a few steps or one epoch), a `--resume` given
two steps more, `generate` three tokens; every other command as written, on what the commands
before it wrote. A block that cannot run as
written (it needs real weights, a data set or a long training run) and cannot be written to run
small is marked `<!-- output only: why -->`; it is shown, not run. Few may be (MAX_OUTPUT_ONLY),
and each must say why. Blocks in ```text (or no language) are printed output, not commands.

Also: README.md stays at most 250 lines and maps every page of docs/; every relative link of every
page reaches a file (and a heading, for a #fragment); docs/api.md names everything in
glassgpt.__all__.
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

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
MAX_OUTPUT_ONLY = 3
SEPARATORS = {"&&", "||", ";", "|", "&"}
CHEAP_TO_RUN = {"info": set(glassgpt.PRESETS), "explain": {"gpt2", "gpt2-book"}, "generate": {"gpt2"}}
MAX_NEW_TOKENS = ["--max-new-tokens", "3"]  # 50 (the default) random-weight tokens prove nothing more
FENCE = re.compile(r"^(?:<!-- (?:output only: (?P<why>.*?)|(?P<small>runs small)) -->\n)?```(?P<language>\w*)\n"
                   r"(?P<code>.*?)^```", re.S | re.M)
# What makes a training command tiny, appended after its own flags (the last value wins).
TINY_MODEL = ["--n-layers", "1", "--emb-dim", "32", "--n-heads", "2", "--context-length", "32", "--threads", "1",
              "--no-progress"]


def name_of(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def fenced_blocks(page: Path, language: str, output_only: bool = False) -> list[str]:
    """The code of `page`'s ```LANGUAGE blocks: those to run, or with output_only those marked not to."""
    return [m["code"] for m in FENCE.finditer(page.read_text(encoding="utf-8"))
            if m["language"] == language and (m["why"] is not None) == output_only]


def small_blocks(page: Path) -> list[str]:
    """The code of `page`'s ```bash blocks marked to run whole, made small."""
    return [m["code"] for m in FENCE.finditer(page.read_text(encoding="utf-8")) if m["small"]]


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


def page_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) for every glassgpt command of every page, each command once (the first page that has it)."""
    seen, found = set(), []
    for page in PAGES:
        for block in fenced_blocks(page, "bash"):
            for words in shell_commands(block):
                argv = glassgpt_argv(words)
                if argv is not None and tuple(argv) not in seen:
                    seen.add(tuple(argv))
                    found.append((name_of(page), argv))
    return found


def is_cheap(argv: list[str]) -> bool:
    args = build_parser().parse_args(argv)
    models = CHEAP_TO_RUN.get(args.command, set())
    return getattr(args, "model", None) in models and not getattr(args, "compile", False)


COMMANDS = page_commands()
PYTHON_BLOCKS = [(name_of(page), i, code) for page in PAGES for i, code in enumerate(fenced_blocks(page, "python"))]


def test_the_pages_have_commands_and_python_to_check():
    assert len(PAGES) >= 12 and len(COMMANDS) >= 40 and len(PYTHON_BLOCKS) >= 5
    assert any(is_cheap(argv) for _, argv in COMMANDS)
    assert {page for page, _ in COMMANDS} >= {"README.md", "docs/book.md", "docs/training.md", "docs/formats.md"}


@pytest.mark.parametrize("page, index, code", PYTHON_BLOCKS, ids=[f"{p}-python-{i}" for p, i, _ in PYTHON_BLOCKS])
def test_every_python_block_runs_as_written(page, index, code, tmp_path):
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{page}, python block {index}:\n{code}\n{result.stderr}"


@pytest.mark.parametrize("page, argv", COMMANDS, ids=[f"{p}: {shlex.join(a)[:60]}" for p, a in COMMANDS])
def test_every_glassgpt_command_parses(page, argv):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{page}: the command does not parse: glassgpt {shlex.join(argv)}")
    assert args.command == argv[0]  # the subcommand it names, never another one it abbreviates


CHEAP = [(page, argv) for page, argv in COMMANDS if is_cheap(argv)]


@pytest.mark.parametrize("page, argv", CHEAP, ids=[f"{p}: {shlex.join(a)[:60]}" for p, a in CHEAP])
def test_every_cheap_command_runs(page, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(argv + (MAX_NEW_TOKENS if argv[0] == "generate" else []))
    _, err = capsys.readouterr()
    assert code == 0, f"{page}: {err}"
    assert "Traceback" not in err
    args = build_parser().parse_args(argv)
    for name in ("out", "attention_out"):
        path = getattr(args, name, None)
        if path:
            assert (tmp_path / path).is_file(), f"{page}: glassgpt {shlex.join(argv)} wrote no {path}"


SMALL_BLOCKS = [(name_of(page), i, block) for page in PAGES for i, block in enumerate(small_blocks(page))]


def made_small(argv: list[str]) -> list[str]:
    """`argv` with what makes it tiny appended: a new training run 1 block 32 wide for 4 steps (the
    book's recipes, which fix the steps, for 1 epoch), a resumed one 2 steps more, 3 new tokens."""
    args = build_parser().parse_args(argv)
    if args.command == "train" and args.resume:
        return argv + ["--max-steps", str(args.max_steps + 2 if args.max_steps else 6)]
    if args.command == "train":
        steps = ["--epochs", "1"] if args.recipe and args.recipe.startswith("book") else ["--max-steps", "4",
                                                                                          "--eval-every", "2"]
        return argv + TINY_MODEL + steps
    return argv + (MAX_NEW_TOKENS if args.command == "generate" else [])


@pytest.mark.parametrize("page, index, block", SMALL_BLOCKS, ids=[f"{p}-small-{i}" for p, i, _ in SMALL_BLOCKS])
def test_every_block_marked_to_run_small_runs_whole(page, index, block, tmp_path, monkeypatch, capsys,
                                                      shared_data):
    work = tmp_path / "work"
    (tmp_path / "shared" / "data").mkdir(parents=True)
    work.mkdir()
    (tmp_path / "shared" / "data" / "tinyshakespeare.txt").write_bytes(shared_data("tinyshakespeare.txt").read_bytes())
    verdict = shared_data("the-verdict.txt").read_text(encoding="utf-8")[:3000]  # an epoch of about 20 windows
    (work / "the-verdict.txt").write_text(verdict, encoding="utf-8")
    monkeypatch.chdir(work)
    commands = [argv for argv in map(glassgpt_argv, shell_commands(block)) if argv is not None]
    assert commands, f"{page}: a block marked to run small holds no glassgpt command"
    for argv in commands:
        code = main(made_small(argv))
        _, err = capsys.readouterr()
        assert code == 0 and "Traceback" not in err, f"{page}: glassgpt {shlex.join(made_small(argv))}\n{err}"


def test_blocks_shown_and_not_run_are_few_and_each_says_why():
    marked = [(name_of(page), m["why"].strip()) for page in PAGES
              for m in FENCE.finditer(page.read_text(encoding="utf-8")) if m["why"] is not None]
    assert len(marked) <= MAX_OUTPUT_ONLY, marked
    assert all(len(why.split()) >= 3 for _, why in marked), marked
    # a marker must sit right above a fence, or it marks nothing and hides nothing
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        markers = re.findall(r"^<!-- (?:output only:|runs small -->)", text, re.M)
        assert len(markers) == len([m for m in FENCE.finditer(text) if m["why"] is not None or m["small"]]), page


def test_a_marked_block_is_not_run_and_an_unmarked_one_is(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(1)\n```\n\n<!-- output only: needs GPT-2's real weights -->\n```python\n"
                    "print(2)\n```\n\n```text\nprint(3)\n```\n", encoding="utf-8")
    assert fenced_blocks(page, "python") == ["print(1)\n"]
    assert fenced_blocks(page, "python", output_only=True) == ["print(2)\n"]


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: move a topic to docs/"


def test_the_readmes_first_bash_block_holds_the_one_test_command_ci_runs():
    first = fenced_blocks(README, "bash")[0]
    assert [line for line in first.splitlines() if "pytest" in line] == [
        'pip install -c constraints.txt -e ".[test]" && pip install -c constraints.txt --no-deps llms-from-scratch '
        "&& python -m pytest"]


def test_the_readme_maps_every_page_of_the_docs():
    text = README.read_text(encoding="utf-8")
    assert [p.name for p in PAGES[2:] if f"](docs/{p.name})" not in text] == []


def heading_anchors(page: Path) -> set[str]:
    """The #fragments GitHub gives a page's headings: lower case, punctuation dropped, spaces as dashes."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.+)$", page.read_text(encoding="utf-8"), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=[name_of(p) for p in PAGES])
def test_every_relative_link_reaches_a_file_and_heading(page):
    broken = []
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # code is not links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in heading_anchors(linked):
            broken.append(target)
    assert broken == []


def test_the_api_page_names_everything_in_all():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert [name for name in glassgpt.__all__ if f"`{name}" not in text] == []
