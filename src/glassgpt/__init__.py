"""glassgpt: GPT-2 from scratch on PyTorch, and a way to see it.

    import glassgpt
    model = glassgpt.load_model("gpt2")            # or a checkpoint dir, the book's model.pth, a hub id
    tok = glassgpt.get_tokenizer("gpt2")
    ids = glassgpt.generate(model, tok.encode("Every effort moves you"), max_new_tokens=10)
    print(tok.decode(ids[0].tolist()))
    print(glassgpt.trace(model, tok, "Every effort moves you").to_text())
    glassgpt.show(my_gpt, "Every effort moves you")  # your own module (the book's GPTModel ...), in a notebook
    glassgpt.check(my_gpt)                           # ... and where it parts from the book's formulas
    glassgpt.describe(my_model)                      # what any model object is made of, as data (anatomy.py)
    glassgpt.check(MultiHeadAttention, args="ch03")  # any piece of chapters 2-7: its first difference, its mistake

The package's layers, from errors and config at the bottom to cli/ and web/ at the top, are stated
and enforced in one place: tests/test_layout.py. Each folder's __init__.py names its files.

This module is the public API and nothing else.
"""

import importlib as _importlib
import sys as _sys
import types as _types

from .adopt import adopt
from .config import PRESETS, GPTConfig
from .engine import KVCache
from .errors import GlassError, RandomWeightsWarning
from .formats import download, export_hf, get_config, get_tokenizer, load_meta, load_model, load_tokenizer, save_model
from .generate import generate, stream
from .kinds import describe
from .model import GPTModel
from .tokenizer import Tokenizer
from .version import __version__

# The explain tools load when first named, so that a command which does not explain (`glassgpt
# generate`) does not wait for them: `glassgpt.trace`, `from glassgpt import why` work as ever.
_EXPLAIN = ("Trace", "Why", "check", "show", "trace", "why")


def __getattr__(name: str):
    if name in _EXPLAIN:
        return getattr(_importlib.import_module(".explain", __name__), name)
    if name == "explain_diagram":
        return _importlib.import_module(".explain.views.diagram", __name__)
    try:  # a subpackage not imported yet (`glassgpt.explain`), as an eager import would have left it
        return _importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


class _LaterModule(_types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):  # what inspect asks of every module in sys.modules: not a reason to load it
            raise AttributeError(name)
        return getattr(__getattr__(self.__name__.rpartition(".")[2]), name)


# `import glassgpt.explain_diagram` is a documented import path: the picture module under its public name.
_sys.modules[__name__ + ".explain_diagram"] = _LaterModule(__name__ + ".explain_diagram")

__all__ = [
    "GPTConfig", "PRESETS", "Trace", "Why", "adopt", "describe", "check", "show", "trace", "why", "get_config", "GlassError",
    "generate", "stream", "GPTModel", "KVCache",
    "Tokenizer", "get_tokenizer", "download", "export_hf", "load_meta", "load_model",
    "load_tokenizer", "save_model", "RandomWeightsWarning", "explain_diagram", "__version__",
]
