"""`glassgpt explain`: the live trace of one prompt, as text, JSON, SVG or PNG."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..explain import trace
from ..explain_diagram import save_attention_png, save_png, to_svg
from ..weights import is_random_init, load_meta
from .common import add_model_args, load, nonneg_int, positive_float, positive_int

DEFAULT_PROMPT = "Every effort moves you"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show every shape from text to the next token, and the weights behind them",
                       description="Run PROMPT through the model once and show each stage from the real tensors: "
                                   "where vocab_size becomes emb_dim (tok_emb) and back (out_head), and which "
                                   "weights do it.")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"default: {DEFAULT_PROMPT!r}")
    add_model_args(p)
    p.add_argument("--format", choices=("txt", "json", "svg", "png"), default="txt")
    p.add_argument("--out", metavar="FILE", help="write to FILE (png default: explain.png; others: stdout)")
    p.add_argument("--top-k", type=positive_int, default=10, help="next tokens to list (default 10)")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="softmax temperature for probs (default 1)")
    p.add_argument("--block", type=nonneg_int, default=0, help="which of the trf_blocks to open up (default 0)")
    p.add_argument("--embedding-vs-linear", action="store_true",
                   help="only the proof that tok_emb(ids) == one_hot(ids) @ tok_emb.weight, with timings")
    p.add_argument("--logit-lens", action="store_true", help="top token at every position after every block")
    p.add_argument("--attention", action="store_true", help="per-layer, per-head attention weights (JSON) and a heatmap PNG")
    p.add_argument("--layer", type=nonneg_int, default=0, help="layer for the attention heatmap (default 0)")
    p.add_argument("--attention-out", metavar="FILE", help="heatmap PNG path (default attention-L<layer>.png)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    p.set_defaults(run=run_explain)


def run_explain(args: argparse.Namespace) -> int:
    model, tok = load(args)
    tr = trace(model, tok, args.prompt, top_k=args.top_k, temperature=args.temperature, block=args.block,
               logit_lens=args.logit_lens, attention=args.attention, model_name=args.model,
               random_weights=is_random_init(args.model), labels=load_meta(args.model).get("labels"))
    if args.attention:
        if args.layer >= model.cfg.n_layers:
            from ..errors import GlassError
            raise GlassError(f"--layer {args.layer} does not exist: choose 0..{model.cfg.n_layers - 1}")
        heat = args.attention_out or f"attention-L{args.layer}.png"
        w, h = save_attention_png(tr, args.layer, heat)
        print(f"wrote {heat} ({w}x{h}): attention weights of trf_blocks.{args.layer}", file=sys.stderr)

    if args.embedding_vs_linear:
        check = tr.embedding_check
        if args.format == "json":
            return _emit(json.dumps(check, indent=2), args.out)
        from ..explain_text import _embedding
        lines: list[str] = []
        _embedding(tr, lines, lambda code, text: text)
        return _emit("\n".join(lines).strip("\n"), args.out)
    if args.format == "json":
        return _emit(json.dumps(tr.to_dict(), indent=2, ensure_ascii=False), args.out)
    if args.format == "svg":
        return _emit(to_svg(tr), args.out)
    if args.format == "png":
        path = args.out or "explain.png"
        w, h = save_png(tr, path)
        print(f"wrote {path} ({w}x{h})", file=sys.stderr)
        return 0
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not args.out)
    return _emit(tr.to_text(color=color), args.out)


def _emit(text: str, out: str | None) -> int:
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)
    return 0
