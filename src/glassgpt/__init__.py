"""glassgpt: GPT-2 from scratch on PyTorch, and a way to see it.

    import glassgpt
    model = glassgpt.load_model("gpt2")            # or a checkpoint dir, or openai-community/gpt2
    tok = glassgpt.get_tokenizer("gpt2")
    ids = glassgpt.generate(model, tok.encode("Every effort moves you"), max_new_tokens=10)
    print(tok.decode(ids[0].tolist()))
    print(glassgpt.trace(model, tok, "Every effort moves you").to_text())
"""

__version__ = "0.1.0"

from .config import PRESETS, GPTConfig, get_config  # noqa: E402
from .errors import GlassError  # noqa: E402
from .explain import Trace, trace  # noqa: E402
from .generate import generate, stream  # noqa: E402
from .engine import KVCache  # noqa: E402
from .model import GPTModel  # noqa: E402
from .tokenizer import Tokenizer, get_tokenizer  # noqa: E402
from .weights import download, export_hf, load_meta, load_model, load_tokenizer, save_model  # noqa: E402

__all__ = [
    "GPTConfig", "PRESETS", "Trace", "trace", "get_config", "GlassError", "generate", "stream", "GPTModel", "KVCache",
    "Tokenizer", "get_tokenizer", "download", "export_hf", "load_meta", "load_model",
    "load_tokenizer", "save_model", "__version__",
]
