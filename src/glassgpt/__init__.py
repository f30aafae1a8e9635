"""glassgpt: GPT-2 from scratch on PyTorch, and a way to see it.

    import glassgpt
    model = glassgpt.load_model("gpt2")            # or a checkpoint dir, the book's model.pth, a hub id
    tok = glassgpt.get_tokenizer("gpt2")
    ids = glassgpt.generate(model, tok.encode("Every effort moves you"), max_new_tokens=10)
    print(tok.decode(ids[0].tolist()))
    print(glassgpt.trace(model, tok, "Every effort moves you").to_text())
    glassgpt.show(my_gpt, "Every effort moves you")  # your own module (the book's GPTModel ...), in a notebook
    glassgpt.check(my_gpt)                           # ... and where it parts from the book's formulas

The package, layer by layer (each imports only from the layers above it in this list):

    errors, version      every exception; the version
    config, tokenizer    GPTConfig and the presets; GPT-2's BPE (vocab/ holds its files)
    model                the glass model: the book's GPT-2, the forward pass and nothing else
    device               where, how precisely and on how many threads to run
    engine/              the same computation made fast, each piece proven equal to model.py
    memory, generate     what a model needs in bytes; picking the next token, streaming
    prompt               text -> ids for a model: the one rule for a prompt longer than the context
    formats/             every file a reader brings, both ways, checked before anything is built
    explain/             record -> Trace (plain data) -> text / picture / JSON
    training/            the loop, its config, checkpoints and run directories, the tasks, LoRA
    cli/, web/           the only places that read flags, print, or serve

This module is the public API and nothing else.
"""

import sys as _sys

from .adopt import adopt
from .config import PRESETS, GPTConfig
from .engine import KVCache
from .errors import GlassError, RandomWeightsWarning
from .explain import Trace, Why, check, show, trace, why
from .explain.views import diagram as explain_diagram
from .formats import download, export_hf, get_config, get_tokenizer, load_meta, load_model, load_tokenizer, save_model
from .generate import generate, stream
from .model import GPTModel
from .tokenizer import Tokenizer
from .version import __version__

# `import glassgpt.explain_diagram` is a documented import path: the picture module under its public name.
_sys.modules[__name__ + ".explain_diagram"] = explain_diagram

__all__ = [
    "GPTConfig", "PRESETS", "Trace", "Why", "adopt", "check", "show", "trace", "why", "get_config", "GlassError",
    "generate", "stream", "GPTModel", "KVCache",
    "Tokenizer", "get_tokenizer", "download", "export_hf", "load_meta", "load_model",
    "load_tokenizer", "save_model", "RandomWeightsWarning", "explain_diagram", "__version__",
]
