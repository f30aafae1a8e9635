"""glassgpt's web page: `create_app(model, tokenizer, ...)` serves it; `glassgpt serve` runs it.

Needs the `web` extra (FastAPI, uvicorn): pip install 'glassgpt[web]'.
"""

from .app import create_app

__all__ = ["create_app"]
