"""The pictures inline in Jupyter: each result shows itself as its SVG picture and its key lines.

Each result's HTML (a Trace, a Why, a passage, a comparison, a weight diff and a check; registered
in views/__init__.py, and asked for by Result._repr_html_): the same picture that `--format svg`
writes, then the lines that matter in a monospace block. Nothing is needed
beyond what glassgpt already uses: the HTML is a string, the picture draw.py's SVG.

    glassgpt.show(model, "Every effort moves you")   # the one-liner: a Trace, shown by the notebook
"""

from __future__ import annotations

from html import escape

from torch import nn

from ...tokenizer import Tokenizer, get_tokenizer
from . import diagram, draw
from ..compare import Comparison
from ..diff import WeightDiff
from .draw import GRAY, GREEN, INK, MUTED, RED, Drawing, Rect, Text
from ..passage import Passage
from ..trace import GPT2Changes, Trace, trace
from ..debugger import LayerReport
from ..verify import CheckResult
from .compare import comparison_layout, comparison_text
from .diff import diff_layout, summary
from .passage import passage_layout, passage_text

KEY_LINES = 12  # lines of a text view shown under a picture; the rest is a method call away


def show(model: nn.Module, text: str = "Every effort moves you", tokenizer: Tokenizer | None = None) -> Trace:
    """Trace `text` through `model` (any model adopt.py reads) with GPT-2's tokenizer unless one is
    given; the Trace returned shows itself in a notebook as the picture and its key lines."""
    return trace(model, tokenizer or get_tokenizer("gpt2"), text)


def figure_html(picture: Drawing | str, lines: list[str]) -> str:
    """One notebook cell's output: the SVG picture, then `lines` in a monospace block."""
    svg = draw.to_svg(picture) if isinstance(picture, Drawing) else picture
    text = escape("\n".join(lines))
    return (f'<div class="glassgpt">{svg}<pre style="font-size: 12px; line-height: 1.35; white-space: pre-wrap">'
            f"{text}</pre></div>")


def trace_html(tr: Trace) -> str:
    if tr.rotary:
        return family_html(tr)
    nt = tr.next_token
    top = " · ".join(f"{t['text']!r} {t['prob']:.3f}" for t in nt.get("top", [])[:5])
    lines = list(tr.notes) + [
        f"prompt {tr.prompt!r}: {len(tr.tokens)} tokens",
        f"next token: id {nt['id']} {nt['text']!r}" + (f"  (top: {top})" if top else ""),
        f"parameters: {tr.params['total']:,} as stored, {tr.params['total_untied']:,} if untied"
        + (f" ({tr.params['note']})" if tr.params.get("note") else ""),
        "trace.to_text() for every stage; trace.to_dict() for the JSON"]
    return figure_html(diagram.layout(tr), lines)


def passage_html(p: Passage) -> str:
    return figure_html(passage_layout(p), passage_text(p).splitlines()[:KEY_LINES])


def comparison_html(c: Comparison) -> str:
    return figure_html(comparison_layout(c), comparison_text(c).splitlines()[:KEY_LINES])


def diff_html(d: WeightDiff) -> str:
    return figure_html(diff_layout(d), summary(d).splitlines())


def check_layout(result: CheckResult, width: float = 1040) -> Drawing:
    """Every stage as a box in the order the data flows: green where it matches, red where it first differs."""
    d = Drawing()
    d.add(Text(20, 30, f"glassgpt check: {result.kind}", size=16, bold=True, color=INK))
    x, y, box = 20.0, 50.0, 14.0
    for s in result.stages:
        colour = GREEN if s.ok else (RED if s is result.first else GRAY)
        d.add(Rect(x, y, box, box, fill=colour, width=0, key=f"stage:{s.name}"))
        x += box + 3
        if x + box > width - 20:
            x, y = 20.0, y + box + 3
    d.add(Text(20, y + box + 24, draw.fit(result.finding, width - 40, 13), size=13, color=RED if result.first else MUTED))
    return d.fit_canvas(width, y + box + 32)


def check_html(result: CheckResult) -> str:
    return figure_html(check_layout(result), result.to_text().splitlines())


def layers_layout(report: LayerReport, width: float = 1040) -> Drawing:
    """The layer debugger's table as a column of boxes: green [OK], red where a layer first differs
    (and the parts inside it), gray after; the first cause under them."""
    d = Drawing()
    d.add(Text(20, 30, f"glassgpt check: {report.kind} against {report.reference}", size=16, bold=True, color=INK))
    y = 50.0
    for prefix, lines in (("", report.layers), (f"{report.layer}.", report.parts)):
        for line in lines:
            first = f"{prefix}{line.name}" in (report.layer, f"{report.layer}.{report.part}")
            colour = GREEN if line.status == "OK" else (RED if first else GRAY)
            d.add(Rect(20, y, 14, 14, fill=colour, width=0, key=f"layer:{prefix}{line.name}"))
            d.add(Text(42, y + 12, draw.fit(line.line, width - 62, 12), size=12, color=INK))
            y += 20
        y += 8
    d.add(Text(20, y + 16, draw.fit(report.finding, width - 40, 13), size=13, color=RED if report.layer else MUTED))
    return d.fit_canvas(width, y + 28)


def layers_html(report: LayerReport) -> str:
    return figure_html(layers_layout(report), report.to_text().splitlines())


def family_html(result: Trace | GPT2Changes) -> str:
    """A notebook cell: the picture (a rotary Trace's), then the text view as it reads in the terminal."""
    svg = draw.to_svg(result.picture()) if isinstance(result, Trace) else ""
    return f"{svg}<pre>{escape(result.to_text())}</pre>"
