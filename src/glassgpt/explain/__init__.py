"""explain: from the live model, every shape on the way from text to the next token, and more.

    record.py    taps on the model's modules, one recorder per trace (threads trace side by side)
    trace.py     `trace(model, tokenizer, text) -> Trace`: the recorded tensors as plain data
    head.py      the head's logits as dot products h · W[id], checked against out_head
    check.py     nn.Embedding == nn.Linear on one-hot vectors, on the live weights
    passage.py   the probability of each true next token over a text: where the model is surprised
    compare.py   two models' next-token distributions side by side, and their KL divergence
    diff.py      two models' weights: the relative change of every tensor, and which did not move
    recall.py    the longest spans of a text found word for word in the training data
    notation.py  how every view writes shapes and tokens
    text.py      the terminal view of a Trace
    draw.py      boxes, text and lines, measured; written as SVG or PNG
    why.py       why this token: the parts' exact sum, the prompt tokens' shares, activation patching
    why_view.py  its text, picture and notebook HTML
    options.py   each analysis option declared once (CLI flag, API field, page control)
    diagram.py   the Trace's picture, in the style of the book's GPT figure; attention heatmaps
    verify.py    check(model): a reader's own module against the book's formulas, stage by stage
    notebook.py  each result's picture and key lines inline in Jupyter; show(model, text)
"""

from .views import diagram
from .check import check_embedding_is_linear
from .record import Progress
from .views.notebook import show  # also gives every result its _repr_html_
from .trace import About, Stage, Trace, TraceOptions, trace
from .verify import CheckResult, check
from .why import Why, why

__all__ = ["About", "CheckResult", "Progress", "Stage", "Trace", "TraceOptions", "Why", "check_embedding_is_linear", "check",
           "diagram", "show", "trace", "why"]
