"""Text at the process's edges: argv and stdin in, stdout and stderr out, for every command at once.

In: the kernel hands argv and stdin over as bytes, and Python gives bytes that are not UTF-8 as
lone surrogates (U+DC80..U+DCFF, "surrogateescape"), which no tokenizer or encoder takes. Text
that the model reads (the arguments named in TEXT_ARGS, and chat's lines of stdin) is read as
what was meant, with one note naming each byte offset:
  - a surrogate pair written in CESU-8 (Java's "modified UTF-8": each half as three bytes,
    ed a0-af .. ed b0-bf ..) is the character it spells;
  - every other byte that is not UTF-8 (0xff, a lone continuation byte, a lone surrogate's three
    bytes, a sequence cut short) is U+FFFD, the replacement character, as Unicode's
    "maximal subpart" practice reads it (Python's errors="replace").
Other arguments (paths, model specs) keep their bytes: the operating system takes any bytes in a
file name, and messages show the undecodable ones escaped.

Out: a stream that cannot encode a character (PYTHONIOENCODING=ascii, LC_ALL=C on an old Python,
a Latin-1 terminal) writes it as a \\uXXXX escape (a surrogate pair past U+FFFF), never a
traceback: glassgpt's own box-drawing and '·', a model's tokens, a path's bytes. The escape is
JSON's own, so --json output stays valid JSON on any stream. A closed stdout or stderr (`>&-`)
writes nowhere; a pipe closed early (`| head -1`) ends the command quietly (cli.main).
"""

from __future__ import annotations

import argparse
import codecs
import os
import re
import sys

from .common import say

# The arguments whose values the model reads as text (not paths or model specs): every command's.
TEXT_ARGS = {"prompt": "the prompt", "text": "the text", "instruction": "the instruction", "input": "--input",
             "sample_prompt": "--sample-prompt", "versus": "--versus", "patch": "--patch"}
ESCAPE = "glassgpt-escape"  # the codecs error handler of stdout and stderr
_SURROGATE = re.compile("[\ud800-\udfff]")
_LISTED = 3  # offsets named in a note; the rest counted


def _escape(err: UnicodeError) -> tuple[str, int]:
    """codecs error handler: what the stream cannot encode, as JSON's \\uXXXX (UTF-16 units)."""
    if not isinstance(err, UnicodeEncodeError):
        raise err
    units = err.object[err.start:err.end].encode("utf-16-be", "surrogatepass")
    return "".join(f"\\u{units[i]:02x}{units[i + 1]:02x}" for i in range(0, len(units), 2)), err.end


codecs.register_error(ESCAPE, _escape)


def guard_streams() -> None:
    """stdout and stderr escape what they cannot encode; stdin hands undecodable bytes on (as
    surrogateescape) for `meant` to read; a closed stdout or stderr is os.devnull."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:  # closed at start (`2>&-`): print(file=None) would write to stdout instead
            setattr(sys, name, open(os.devnull, "w"))
        elif hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=ESCAPE)
    if sys.stdin is not None and hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")


def quiet_stdout() -> None:
    """After a pipe closed early: stdout points at os.devnull, so that the interpreter's last flush of
    what is still buffered does not fail again on the way out."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # (not a real file: an in-process caller's buffer)
        pass


# --- in: text as it was meant ---------------------------------------------------------------------

def bytes_of(text: str) -> bytes:
    """The bytes `text` came from: each surrogateescape'd byte as itself, another lone surrogate
    as its three CESU-8 bytes, everything else in UTF-8."""
    return b"".join(c.encode("utf-8", "surrogateescape" if "\udc80" <= c <= "\udcff" else "surrogatepass")
                    for c in text)


def _cesu8_pair(raw: bytes, at: int) -> str | None:
    """The character at `at` when a CESU-8 surrogate pair starts there: ed a0-af xx ed b0-bf xx."""
    six = raw[at:at + 6]
    if len(six) == 6 and six[0] == six[3] == 0xED and 0xA0 <= six[1] <= 0xAF and 0xB0 <= six[4] <= 0xBF \
            and all(0x80 <= b <= 0xBF for b in (six[2], six[5])):
        return six.decode("utf-8", "surrogatepass").encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    return None


def decode_meant(raw: bytes) -> tuple[str, list[tuple[int, bytes, str]]]:
    """(the text `raw` meant, [(byte offset, the bytes, what they were read as)] for each place that
    was not UTF-8): CESU-8 pairs as their character, anything else as U+FFFD."""
    parts, places, i = [], [], 0
    while True:
        try:
            parts.append(raw[i:].decode("utf-8"))
            return "".join(parts), places
        except UnicodeDecodeError as e:
            at = i + e.start
            parts.append(raw[i:at].decode("utf-8"))
            pair = _cesu8_pair(raw, at)
            if pair is not None:
                parts.append(pair)
                places.append((at, raw[at:at + 6], f"U+{ord(pair):04X} {pair}"))
                i = at + 6
                continue
            lone = raw[at] == 0xED and at + 2 < len(raw) and 0xA0 <= raw[at + 1] <= 0xBF and 0x80 <= raw[at + 2] <= 0xBF
            end = at + 3 if lone else i + e.end
            parts.append("\ufffd")
            places.append((at, raw[at:end], "U+FFFD"))
            i = end


def meant(text: str, what: str) -> tuple[str, str | None]:
    """(`text` as it was meant, a note naming the bytes that were not UTF-8, or None when all were)."""
    if not _SURROGATE.search(text):
        return text, None
    fixed, places = decode_meant(bytes_of(text))
    named = ", ".join(f"{' '.join(f'{b:#04x}' for b in chunk)} at byte {at:,} ({as_})"
                      for at, chunk, as_ in places[:_LISTED])
    more = f" and {len(places) - _LISTED:,} more" if len(places) > _LISTED else ""
    return fixed, (f"{what} is not all UTF-8: {named}{more}; read as the character a CESU-8 pair spells, "
                   "else as U+FFFD, the replacement character (give UTF-8 text to avoid this)")


def read_text_args(args: argparse.Namespace) -> None:
    """Each text argument of `args` (TEXT_ARGS) as it was meant, with a note where bytes were not UTF-8."""
    for dest, what in TEXT_ARGS.items():
        value = getattr(args, dest, None)
        if isinstance(value, str):
            fixed, note = meant(value, what)
            if note:
                setattr(args, dest, fixed)
                say(f"note: {note}", file=sys.stderr)


def stdin_lines():
    """The lines of stdin, each as it was meant (a note for each line that was not all UTF-8)."""
    for number, line in enumerate(sys.stdin, 1):
        fixed, note = meant(line, f"line {number:,} of stdin")
        if note:
            say(f"note: {note}", file=sys.stderr)
        yield fixed
