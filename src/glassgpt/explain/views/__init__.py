"""The views of explain's results, and the one place each result type gets them: its text, picture and HTML.

    text.py       a Trace in the terminal (GPT-2's flow, or the rotary one); what changed from GPT-2 too
    diagram.py    a Trace's picture (GPT-2's, or the rotary flow's); attention heatmaps
    why.py        a Why and a FamilyWhy: text, picture, HTML  passage.py  a Passage: text and picture
    compare.py    a Comparison: text and picture         diff.py     a WeightDiff: text and picture
    gallery.py    a Gallery of architecture cards: text, picture, HTML; what changed from GPT-2 (text, HTML)
    notebook.py   each result's notebook cell (its picture and key lines); show(model, text)
    pieces.py     a text's sliding windows; a checked piece's picture; show(piece, input) for any piece
    draw.py       boxes, text and lines, measured; written as SVG or PNG

The views import the analyses and never the reverse: a result finds its views in result.py's
registry, filled here when glassgpt.explain is imported.
"""

from ..compare import Changes, Comparison
from ..debugger import LayerReport
from ..diff import WeightDiff
from ..gallery import Gallery
from ..passage import Passage
from ..pieces import PieceResult, SlidingWindows
from ..result import register
from ..trace import GPT2Changes, Trace
from ..verify import CheckResult
from ..why import Why
from ..why import FamilyWhy
from .compare import comparison_layout, comparison_text
from .diagram import trace_picture
from .diff import diff_layout, diff_text
from .gallery import changes_html, changes_text, gallery_html, gallery_layout, gallery_text
from .notebook import family_html, check_html, check_layout, layers_html, layers_layout, comparison_html, diff_html, passage_html, trace_html
from .passage import passage_layout, passage_text
from .pieces import piece_html, piece_layout, windows_html, windows_layout, windows_text
from .text import render_changes_text, render_text
from .why import family_why_html, render_family_why_text, why_html, why_layout, why_text

register(Trace, text=render_text, picture=trace_picture, html=trace_html)
register(Why, text=why_text, picture=why_layout, html=why_html)
register(Passage, text=passage_text, picture=passage_layout, html=passage_html)
register(Comparison, text=comparison_text, picture=comparison_layout, html=comparison_html)
register(WeightDiff, text=diff_text, picture=diff_layout, html=diff_html)
register(GPT2Changes, text=render_changes_text, html=family_html)
register(FamilyWhy, text=render_family_why_text, picture=why_layout, html=family_why_html)
register(CheckResult, picture=check_layout, html=check_html)  # its text is CheckResult.to_text, in verify.py
register(LayerReport, picture=layers_layout, html=layers_html)  # its text is LayerReport.to_text, in debugger.py
register(PieceResult, picture=piece_layout, html=piece_html)  # its text is PieceResult.to_text, in pieces/report.py
register(Gallery, text=gallery_text, picture=gallery_layout, html=gallery_html)
register(Changes, text=changes_text, html=changes_html)
register(SlidingWindows, text=windows_text, picture=windows_layout, html=windows_html)
