"""explain: from the live model, every shape on the way from text to the next token.

    record.py    taps on the model's modules, one recorder per trace (threads trace side by side)
    trace.py     `trace(model, tokenizer, text) -> Trace`: the recorded tensors turned into plain data
    text.py      the terminal view of a Trace
    diagram.py   the picture: SVG and PNG in the style of the book's GPT figure, attention heatmaps
"""

from . import diagram
from .trace import Progress, Stage, Trace, check_embedding_is_linear, trace

__all__ = ["Progress", "Stage", "Trace", "check_embedding_is_linear", "diagram", "trace"]
