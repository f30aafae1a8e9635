"""The process's own edges, each row of docs/troubleshooting.md's "The process's inputs" tried under faults:
bytes that are not UTF-8 in argv and stdin, streams that cannot encode a character or are closed,
pipes closed early, thread counts and OMP_NUM_THREADS at extremes, config files that name what the
weights already tell, files at and past their kind's size limit, and environment variables unset,
garbage or extreme. Each case asserts the exit code, the one line printed and that no traceback came.

Most cases run the command in-process (`main(argv)`, argv as Python hands it over: undecodable bytes
as surrogateescape'd str); a few run the real `glassgpt` in a subprocess, where only a real process
shows the fault (the locale's encoding, a segfault, the interpreter's last flush into a closed pipe).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt.cli import main
from glassgpt.cli.common import set_threads
from glassgpt.errors import CheckpointError
from glassgpt.families import build_model
from glassgpt.formats.families import export_family_book
from glassgpt.formats.files import read_json

from helpers import SMALL, TINY, run

GLASSGPT = [sys.executable, "-m", "glassgpt"]
SRC = str(Path(glassgpt.__file__).resolve().parents[1])  # the glassgpt under test, for its subprocesses
KINDS = ("config", "tokenizer", "meta", "index", "header")  # formats/files.py FILE_LIMITS


@pytest.fixture
def small(tmp_path):
    """A config JSON as --model: GPT-2's tokenizer, random weights, one block 16 wide."""
    path = tmp_path / "small.json"
    path.write_text(json.dumps(SMALL))
    return str(path)


def glassgpt_process(args: list, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """The real command, this checkout's source first on the path, offline."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1",
               **(env or {}))
    return subprocess.run(GLASSGPT + args, env=env, capture_output=True, timeout=300, **kwargs)


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("note: ")]


# --- argv and stdin: bytes that are not UTF-8 -------------------------------------------------------

@pytest.mark.parametrize("raw, meant, places", [
    (b"\xff\xfeab", "\ufffd\ufffdab", [(0, b"\xff"), (1, b"\xfe")]),           # not UTF-8 at all
    (b"a\x80b", "a\ufffdb", [(1, b"\x80")]),                                    # a lone continuation byte
    (b"x\xed\xa0\x80y", "x\ufffdy", [(1, b"\xed\xa0\x80")]),                    # a lone surrogate's CESU-8
    (b"a\xed\xa0\xbd\xed\xb8\x80", "a\U0001F600", [(1, b"\xed\xa0\xbd\xed\xb8\x80")]),  # a CESU-8 pair: 😀
    (b"caf\xc3", "caf\ufffd", [(3, b"\xc3")]),                                   # a sequence cut short
    ("Café ☕".encode(), "Café ☕", []),                                          # UTF-8: untouched
])
def test_bytes_that_are_not_utf8_read_as_meant_with_each_offset(raw, meant, places):
    from glassgpt.cli.text import decode_meant
    text, found = decode_meant(raw)
    assert text == meant
    assert [(at, chunk) for at, chunk, _ in found] == places


def surrogateescaped(raw: bytes) -> str:
    """What Python hands a program for argv bytes `raw` (PEP 383)."""
    return raw.decode("utf-8", "surrogateescape")


def error_line(err: str) -> str:
    """The one error line among a command's notes (and its threads line); no traceback."""
    lines = [line for line in err.strip().splitlines() if not line.startswith(("note:", "threads:", "kernels:"))]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("raw, meant, said", [
    (b"\xff\xfe moves you", "\ufffd\ufffd moves you", "0xff at byte 0 (U+FFFD), 0xfe at byte 1 (U+FFFD)"),
    (b"a\x80b", "a\ufffdb", "0x80 at byte 1 (U+FFFD)"),
    (b"x\xed\xa0\x80y", "x\ufffdy", "0xed 0xa0 0x80 at byte 1 (U+FFFD)"),
    (b"a\xed\xa0\xbd\xed\xb8\x80", "a\U0001F600", "0xed 0xa0 0xbd 0xed 0xb8 0x80 at byte 1 (U+1F600 \U0001F600)"),
])
def test_a_prompt_of_bytes_that_are_not_utf8_is_tokenised_as_meant_with_a_note(raw, meant, said, small, capsys):
    code, out, err = run(["generate", surrogateescaped(raw), "--model", small, "--max-new-tokens", "1", "--json"],
                         capsys)
    assert code == 0 and "Traceback" not in err, err
    assert json.loads(out)["prompt_ids"] == glassgpt.get_tokenizer("gpt2").encode(meant)
    assert notes(err)[0].startswith(f"note: the prompt is not all UTF-8: {said}; read as ")


def test_every_command_that_takes_text_reads_bytes_that_are_not_utf8_without_a_traceback(small, capsys):
    bad = surrogateescaped(b"\xff\xfe effort")
    for argv, what in ((["explain", bad, "--model", small, "--format", "json"], "the prompt"),
                       (["explain", "Every effort", "--model", small, "--why", "--versus",
                         surrogateescaped(b"\xff\xfe"), "--format", "json"], "--versus"),
                       (["diff", small, small, "--prompt", bad, "--format", "json"], "the prompt"),
                       (["chat", bad, "--model", small, "--max-new-tokens", "1"], "the instruction"),
                       (["chat", "Say hi", "--input", bad, "--model", small, "--max-new-tokens", "1"], "--input")):
        code, out, err = run(argv, capsys)
        assert code == 0 and "Traceback" not in err, (argv, err)
        assert f"note: {what} is not all UTF-8: 0xff at byte 0 (U+FFFD), 0xfe at byte 1 (U+FFFD);" in err, err
        if "json" in argv:
            json.loads(out)


def test_a_path_of_bytes_that_are_not_utf8_is_opened_as_the_bytes_it_is(tmp_path, capsys):
    (tmp_path / os.fsdecode(b"caf\xe9.json")).write_text(json.dumps(SMALL))
    code, out, err = run(["generate", "Hi", "--model", str(tmp_path / surrogateescaped(b"caf\xe9.json")),
                          "--max-new-tokens", "1", "--json"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "caf\\udce9.json has random weights" in err  # the byte shown escaped; the path kept its bytes
    code, out, err = run(["generate", "Hi", "--model", str(tmp_path / surrogateescaped(b"gone\xff.json"))], capsys)
    assert code == 2 and "gone\\udcff.json" in error_line(err)


def test_stdin_lines_that_are_not_utf8_are_read_as_meant(small, capsys, monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"Say \xff hi\nok\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", stdin)
    code, out, err = run(["chat", "--model", small, "--max-new-tokens", "1"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "note: line 1 of stdin is not all UTF-8: 0xff at byte 4 (U+FFFD)" in err
    assert len(out.strip().splitlines()) >= 1


# --- stdout and stderr: encodings, closed streams, pipes closed early --------------------------------

def ascii_stream() -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict")


def written(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode("ascii")


def test_a_stream_that_cannot_encode_a_character_gets_an_escape_and_json_stays_valid(small, monkeypatch):
    prompt = "Café ☕ moves you 😀"
    for argv, is_json in ((["explain", prompt], False), (["explain", prompt, "--format", "json"], True),
                          (["generate", prompt, "--max-new-tokens", "2", "--json"], True),
                          (["generate", prompt, "--max-new-tokens", "2"], False), (["info"], False)):
        out, err = ascii_stream(), ascii_stream()
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        assert main(argv + ["--model", small]) == 0
        text, said = written(out), written(err)
        assert "Traceback" not in said
        if is_json:
            assert "☕" in json.dumps(json.loads(text), ensure_ascii=False)
        elif argv[0] == "explain":
            assert "\\u00b7" in text and "\\u2502" in text and "Caf\\u00e9 \\u2615 moves you \\ud83d\\ude00" in text


def test_real_process_with_an_ascii_locale_and_undecodable_argv_escapes_and_stays_valid_json(small):
    env = {"PYTHONIOENCODING": "ascii", "LC_ALL": "C"}
    txt = glassgpt_process(["explain", "Café ☕ moves you".encode(), "--model", small], env)
    assert txt.returncode == 0 and b"Traceback" not in txt.stderr, txt.stderr
    assert b"glassgpt explain \\u00b7 model" in txt.stdout and b"Caf\\u00e9 \\u2615" in txt.stdout
    js = glassgpt_process(["generate", b"Caf\xc3\xa9 \xe2\x98\x95 \xff", "--model", small, "--max-new-tokens", "1",
                           "--json"], env)
    assert js.returncode == 0 and b"Traceback" not in js.stderr, js.stderr
    assert json.loads(js.stdout)["text"].startswith("Café ☕ \ufffd")
    assert b"note: the prompt is not all UTF-8: 0xff at byte 10 (U+FFFD)" in js.stderr


def test_a_closed_stderr_sends_notes_nowhere_and_leaves_stdout_valid_json(small, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)  # what Python sets for `2>&-`
    code = main(["generate", "Hi", "--model", small, "--max-new-tokens", "1", "--json"])
    assert code == 0
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == [17250]


class ClosedPipe(io.TextIOWrapper):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_pipe_closed_early_ends_the_command_quietly(small, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", ClosedPipe(io.BytesIO(), encoding="utf-8"))
    assert main(["explain", "Hi", "--model", small, "--format", "json"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    # the real process: the reader has gone before a byte is written, and the interpreter's last flush too
    process = subprocess.Popen(GLASSGPT + ["explain", "Hi " * 200, "--model", small, "--format", "json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=dict(os.environ, PYTHONPATH=SRC, HF_HUB_OFFLINE="1"))
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=300) == 0
    assert b"Traceback" not in err and b"Exception ignored" not in err, err


# --- threads ------------------------------------------------------------------------------------------

def test_threads_past_the_cores_are_capped_with_a_note_and_the_command_runs(small):
    result = glassgpt_process(["generate", "Hi", "--model", small, "--max-new-tokens", "2", "--threads", "99999"])
    err = result.stderr.decode()
    assert result.returncode == 0, err  # was a segfault, exit 139
    from glassgpt.device import usable_cores
    cores = usable_cores()
    assert f"note: 99,999 threads (--threads) are more than the {cores} cores this process may use: {cores} " \
           "threads" in err
    assert f"threads: {cores} (--threads, capped at the cores;" in err


@pytest.mark.parametrize("value, note", [
    ("abc", "note: OMP_NUM_THREADS='abc' is not a positive integer: ignored, as if it were unset"),
    ("-3", "note: OMP_NUM_THREADS='-3' is not a positive integer: ignored, as if it were unset"),
    ("0", "note: OMP_NUM_THREADS='0' is not a positive integer: ignored, as if it were unset"),
    ("2.5", "note: OMP_NUM_THREADS='2.5' is not a positive integer: ignored, as if it were unset"),
    ("99999", "note: 99,999 threads (OMP_NUM_THREADS) are more than the {cores} cores this process may use"),
])
def test_omp_num_threads_garbage_is_ignored_and_extremes_capped_with_a_note(value, note, monkeypatch, capsys):
    from glassgpt.device import usable_cores
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    try:
        n = set_threads(None, emb_dim=16)
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert note.format(cores=usable_cores()) in err
    assert 1 <= n <= usable_cores()


def test_a_resumed_runs_recorded_thread_count_is_capped_too(capsys):
    from glassgpt.device import usable_cores
    before = torch.get_num_threads()
    try:
        assert set_threads(None, emb_dim=16, recorded=10**6) == usable_cores()
    finally:
        torch.set_num_threads(before)
    assert "note: 1,000,000 threads (the run's own, kept on resume) are more than the" in capsys.readouterr().err


# --- config files that say what the weights already tell --------------------------------------------

@pytest.fixture
def qwen3_pth(tmp_path) -> Path:
    export_family_book(build_model(TINY["qwen3"]), tmp_path / "model.pth")
    return tmp_path / "model.pth"


def with_config(pth: Path, **fields) -> None:
    side = pth.with_suffix(".json")
    side.write_text(json.dumps({**json.loads(side.read_text()), **fields}))


def test_a_book_config_that_names_its_family_loads_and_one_that_names_another_is_one_line(qwen3_pth, capsys):
    with_config(qwen3_pth, family="qwen3")
    code, out, err = run(["info", "--model", str(qwen3_pth), "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["config"]["family"] == "qwen3"
    # explain and generate read the config and build the model; what stops them is the tokenizer it lacks
    for argv in (["explain", "hi"], ["generate", "hi", "--max-new-tokens", "1"]):
        code, out, err = run(argv + ["--model", str(qwen3_pth)], capsys)
        assert code == 2 and "has no tokenizer.json" in error_line(err)
    with_config(qwen3_pth, family="llama3")
    code, out, err = run(["generate", "hi", "--model", str(qwen3_pth)], capsys)
    assert code == 2 and "book config field family is 'llama3', and the weights are a qwen3 model's (family " \
                         "'qwen3'): correct family or leave it out" in error_line(err)
    with_config(qwen3_pth, family="qwen3", famly="qwen3")
    code, out, err = run(["generate", "hi", "--model", str(qwen3_pth)], capsys)
    assert code == 2 and "unknown book config field(s) ['famly']" in error_line(err)


# --- file sizes, per kind -----------------------------------------------------------------------------

def sparse(path: Path, size: int, tail: bytes = b"") -> Path:
    """A file of `size` bytes that takes no room: a hole, then `tail`."""
    with open(path, "wb") as f:
        f.truncate(size - len(tail))
        f.seek(size - len(tail))
        f.write(tail)
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_every_file_kind_is_refused_past_its_limit_before_it_is_read_with_both_sizes(kind, tmp_path):
    from glassgpt.formats.files import FILE_LIMITS, read_limited
    assert set(FILE_LIMITS) == set(KINDS)
    limit = FILE_LIMITS[kind]
    with pytest.raises(CheckpointError) as refused:
        read_limited(sparse(tmp_path / "f", limit + 1), kind)
    assert f"is {limit + 1:,} bytes" in str(refused.value) and f"(at most {limit:,} bytes)" in str(refused.value)
    assert len(read_limited(sparse(tmp_path / "g", limit), kind)) == limit  # at the limit: read


def test_a_config_json_at_its_limit_is_read_and_one_byte_past_is_refused(tmp_path):
    from glassgpt.formats.files import FILE_LIMITS
    limit, body = FILE_LIMITS["config"], json.dumps(SMALL).encode()
    (tmp_path / "at.json").write_bytes(b" " * (limit - len(body)) + body)
    assert read_json(tmp_path / "at.json", kind="config") == SMALL
    (tmp_path / "past.json").write_bytes(b" " * (limit + 1 - len(body)) + body)
    with pytest.raises(CheckpointError, match=f"is {limit + 1:,} bytes, more than a config JSON may be"):
        read_json(tmp_path / "past.json", kind="config")


def test_a_1_gib_config_json_is_refused_in_one_line_by_every_command_without_being_read(tmp_path, capsys):
    config_limit = 1 << 20  # formats/files.py FILE_LIMITS["config"]
    model = glassgpt.GPTModel(glassgpt.GPTConfig(**SMALL))
    glassgpt.save_model(model, tmp_path / "ck")
    body = (tmp_path / "ck" / "config.json").read_bytes()
    sparse(tmp_path / "ck" / "config.json", 1 << 30, body)  # whitespace-free hole, then the real object
    spec = str(tmp_path / "ck")
    tracemalloc.start()
    try:
        for argv in (["info", "--model", spec], ["generate", "hi", "--model", spec], ["explain", "hi", "--model", spec],
                     ["export", spec, "--format", "hf", "--out", str(tmp_path / "out")]):
            code, out, err = run(argv, capsys)
            assert code == 2, err
            assert f"config.json is {1 << 30:,} bytes, more than a config JSON may be (at most " \
                   f"{config_limit:,} bytes)" in error_line(err)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak:,} bytes allocated"


def test_a_fifo_in_a_files_place_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "config.json")

    def waited(*_):
        raise TimeoutError("read_json waited for a writer")

    signal.signal(signal.SIGALRM, waited)
    signal.alarm(30)  # (a read that waits for a writer would hang the suite: fail it instead)
    try:
        with pytest.raises(CheckpointError, match="is a FIFO"):
            read_json(tmp_path / "config.json", kind="config")
    finally:
        signal.alarm(0)


# --- environment variables unset, garbage, extreme ----------------------------------------------------

@pytest.mark.parametrize("columns", ["-5", "0", "1", "abc", "99999999", str(2**70)])
def test_help_reads_any_columns(columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", columns)
    code, out, err = run(["generate", "--help"], capsys)
    assert code == 0 and "--max-new-tokens" in out and err == ""


def test_no_color_turns_auto_colour_off(small, monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    code, coloured, err = run(["explain", "Hi", "--model", small], capsys)
    assert code == 0 and "\x1b[" in coloured, err
    monkeypatch.setenv("NO_COLOR", "1")
    code, plain, err = run(["explain", "Hi", "--model", small], capsys)
    assert code == 0 and "\x1b[" not in plain


def test_home_unset_and_a_cache_home_that_is_a_file_still_generate(small, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HOME", raising=False)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
    code, out, err = run(["generate", "Hi", "--model", small, "--max-new-tokens", "2", "--json"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert len(json.loads(out)["new_ids"]) == 2


# --- the table itself -----------------------------------------------------------------------------------

def test_every_row_of_the_inputs_table_names_tests_that_exist():
    import re
    docs = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
    section = docs.read_text().split("## The process's inputs", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| channel", "|---"))]
    assert len(rows) >= 20
    for row in rows:
        tests = row.rstrip(" |").rsplit(" | ", 1)[1]
        named = re.findall(r"`(test_\w+\.py)(?:::(\w+))?|`::(\w+)", tests)
        assert named or "(cache helper)" in tests, row
        module = None
        for file, name, same_file in named:
            module = file or module
            text = (Path(__file__).parent / module).read_text()
            for test in filter(None, (name, same_file)):
                assert f"def {test}(" in text, f"{module}::{test} (named in the table) does not exist"
