"""`glassgpt compare --models gpt2 qwen3 gemma3 ...`: the architecture gallery, one card per model at its real shape."""

from __future__ import annotations

import argparse
import json
import sys

from ..explain.gallery import SHAPES, gallery
from ..explain.views import draw
from .common import positive_int
from .explain import emit


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="the architecture gallery: the book's models side by side, one card each",
                       description="One card per model at its real shape, read from the model's own description "
                                   "(nothing is downloaded or built): where its norms sit, its attention (heads, "
                                   "groups, sliding window, linear attention), its feed-forward, its position "
                                   "signal, its parameters, the bytes its KV cache (or state) keeps per token, and "
                                   "what changed from GPT-2. Models: " + ", ".join(SHAPES) + ".")
    p.add_argument("--models", nargs="+", metavar="MODEL", default=None,
                   help="the models to set side by side (default: all of them)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="the cache's dtype (default: bfloat16, as the notebooks run them)")
    p.add_argument("--tokens", type=positive_int, default=8192,
                   help="the sequence length the cache is shown at (default: 8192)")
    p.add_argument("--format", choices=("txt", "json", "svg", "png"), default="txt",
                   help="txt: the cards as text; json: every figure; svg/png: the cards drawn (default: txt)")
    p.add_argument("--out", metavar="FILE", help="write to FILE (default: gallery.png for png, else stdout)")
    p.set_defaults(run=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    result = gallery(args.models or list(SHAPES), args.dtype, args.tokens)
    if args.format == "json":
        return emit(json.dumps(result.to_dict(), indent=2), args.out)
    if args.format == "svg":
        return emit(draw.to_svg(result.picture()), args.out)
    if args.format == "png":
        path = args.out or "gallery.png"
        w, h = draw.save_png(result.picture(), path)
        print(f"wrote {path} ({w}x{h})", file=sys.stderr)
        return 0
    return emit(result.to_text(), args.out)
