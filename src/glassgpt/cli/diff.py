"""`glassgpt diff A B`: which weights training or finetuning moved, by how much, and what it did to one prompt."""

from __future__ import annotations

import argparse
import json
import sys

from ..explain.views import draw
from ..explain.compare import compare
from ..explain.diff import check_same_shapes, diff_weights
from ..explain.views.compare import comparison_text
from ..explain.views.diff import diff_layout, diff_text
from .common import add_source_args, add_threads_arg, load, open_model, positive_int, seed
from .explain import DEFAULT_PROMPT, emit, load_second


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diff", help="compare two models of the same shapes: which tensors moved, and by how much",
                       description="For every tensor of A and B (any two --model specs of the same shapes, e.g. a "
                                   "model before and after finetuning), the relative change ||B - A|| / ||A||, "
                                   "grouped as the book draws the model, and which tensors did not move at all; then "
                                   "both models' next-token distributions for one prompt and their KL divergence.")
    p.add_argument("a", metavar="A", help="the first model (a --model spec: preset, checkpoint, run directory, .pth, ...)")
    p.add_argument("b", metavar="B", help="the second model, of the same shapes (a classifier's new head is allowed)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 for both (default: float32: "
                                                      "a bfloat16 copy would differ from float32 weights everywhere)")
    p.add_argument("--seed", type=seed, default=None, help="seed of a preset's random weights (default: 0)")
    add_threads_arg(p)
    add_source_args(p)  # for two .pth state dicts: both have the same shapes, so the same head count
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"the prompt both models continue (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--top-k", type=positive_int, default=5, help="next tokens listed for each model (default: 5)")
    p.add_argument("--format", choices=("txt", "json", "svg", "png"), default="txt",
                   help="txt: the table; json: every tensor's change; svg/png: the picture (default: txt)")
    p.add_argument("--out", metavar="FILE", help="write to FILE (default: diff.png for png, else stdout)")
    p.set_defaults(run=run_diff)


def run_diff(args: argparse.Namespace) -> int:
    a, b = open_model(args, spec=args.a), open_model(args, spec=args.b)
    cfg_a, cfg_b = a.local_config(), b.local_config()
    if cfg_a is not None and cfg_b is not None:  # models of other shapes are refused before either loads
        check_same_shapes(cfg_a, cfg_b, args.a, args.b)
    model_a, tok = load(args, a)
    model_b, _ = load_second(args, b, tok)
    weights = diff_weights(model_a, model_b, args.a, args.b)
    comparison = compare(model_a, model_b, tok, args.prompt, a.about(), b.about(), top_k=args.top_k)
    if args.format == "json":
        return emit(json.dumps({"weights": weights.to_dict(), "next_token": comparison.to_dict()}, indent=2,
                                ensure_ascii=False), args.out)
    if args.format in ("svg", "png"):
        drawing = diff_layout(weights, comparison)
        if args.format == "svg":
            return emit(draw.to_svg(drawing), args.out)
        path = args.out or "diff.png"
        w, h = draw.save_png(drawing, path)
        print(f"wrote {path} ({w}x{h})", file=sys.stderr)
        return 0
    return emit(diff_text(weights) + "\n\n" + comparison_text(comparison), args.out)

