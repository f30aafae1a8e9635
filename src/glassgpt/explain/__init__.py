"""explain: from the live model, every shape on the way from text to the next token, and more.

record, the parts every analysis shares:
    record.py    taps on the model's modules, one recorder per trace (threads trace side by side)
    options.py   each analysis option declared once (CLI flag, API field, page control)
    result.py    what an analysis returns: plain data that finds its views in one registry
    notation.py  one spelling of shapes, tokens and numbers, for the results' lines and every view
analyses, each a function over the model that returns a result:
    trace.py     `trace(model, tokenizer, text) -> Trace`: the recorded tensors as plain data, for any model
                 object glassgpt.describe reads (its modules found through the description)
    head.py      the head's logits as dot products h · W[id], checked against out_head
    check.py     nn.Embedding == nn.Linear on one-hot vectors, on the live weights
    passage.py   the probability of each true next token over a text: where the model is surprised
    compare.py   two models' next-token distributions side by side, and their KL divergence
    diff.py      two models' weights: the relative change of every tensor, and which did not move
    why.py       why this token: the parts' exact sum, the prompt tokens' shares, activation patching
    verify.py    check(model): a reader's own module against the book's formulas, stage by stage (GPT-2 against
                 model.py; every other described model against its description), and the known mistakes
    formulas.py  what a description states, computed: RoPE's tables and turn, the attention weights (verify and
                 trace read them)
    debugger.py  check(port, against="transformers"): the layer debugger's [OK]/[DIFF] table against
                 transformers; causes.py the first cause inside the layer that differs (property, catalogue)
    loading.py   check_state_dict: what goes wrong loading a state dict into a port, named
    family.py    the rotary trace (RoPE models: Qwen3, Llama 3.2), which trace() runs where the description puts
                 positions inside the attention: the four answers, RoPE, the heads; what changed from GPT-2
    pieces/      check(piece): any piece of chapters 2 to 7 as the reader wrote it (a class, a function,
                 a tokenizer, a dataset), its first difference and the mistake that reproduces it
views/, above the analyses: each result's text, picture and notebook HTML, registered in views/__init__.py
"""

from . import views  # registers every result's views (views/__init__.py)
from .check import check_embedding_is_linear
from .debugger import LayerReport
from .loading import check_state_dict
from .record import Progress
from .trace import About, Stage, Trace, TraceOptions, trace
from .pieces import PieceResult, SlidingWindows, check, sliding_windows
from .verify import CheckResult
from .views import diagram
from .views.pieces import show
from .why import Why, why

__all__ = ["About", "CheckResult", "LayerReport", "check_state_dict", "PieceResult", "Progress", "SlidingWindows", "sliding_windows", "Stage", "Trace", "TraceOptions", "Why", "check_embedding_is_linear", "check",
           "diagram", "show", "trace", "why"]
