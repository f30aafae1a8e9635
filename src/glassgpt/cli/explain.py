"""`glassgpt explain`: the live trace of one prompt, as text, JSON, SVG or PNG."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import GlassError
from ..explain import trace
from ..explain.diagram import save_attention_png, save_png, to_svg
from ..formats import is_random_init, load_meta, read_config
from .common import add_model_args, load, nonneg_int, positive_float, positive_int

DEFAULT_PROMPT = "Every effort moves you"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show every shape from text to the next token, and the weights behind them",
                       description="Run PROMPT through the model once and show each stage from the real tensors: "
                                   "where vocab_size becomes emb_dim (tok_emb) and back (out_head), and which "
                                   "weights do it.")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"the text to trace (default: {DEFAULT_PROMPT!r})")
    add_model_args(p)
    p.add_argument("--format", choices=("txt", "json", "svg", "png"), default="txt",
                   help="txt: the flow in the terminal; json: the whole trace; svg/png: the picture (default: txt)")
    p.add_argument("--out", metavar="FILE", help="write to FILE (default: explain.png for png, else stdout)")
    p.add_argument("--top-k", type=positive_int, default=10, help="how many next tokens to list (default: 10)")
    p.add_argument("--temperature", type=positive_float, default=1.0,
                   help="divides the last logits before the softmax that gives probs (default: 1)")
    p.add_argument("--block", type=nonneg_int, default=0,
                   help="which of the trf_blocks the flow opens up to show its norms, heads and feed-forward "
                        "(default: 0); --layer picks the attention that --attention shows")
    p.add_argument("--embedding-vs-linear", action="store_true",
                   help="print only the proof that tok_emb(ids) == one_hot(ids) @ tok_emb.weight, with timings "
                        "(default: off)")
    p.add_argument("--logit-lens", action="store_true",
                   help="also the top token at every position after every block (default: off)")
    p.add_argument("--attention", action="store_true",
                   help="also one layer's attention (--layer): a per-head table in the text, every layer's weights "
                        "in the JSON, and a heatmap PNG (default: off)")
    p.add_argument("--layer", type=nonneg_int, default=0,
                   help="which block's attention --attention shows (default: 0); independent of --block")
    p.add_argument("--attention-out", metavar="FILE",
                   help="where --attention writes the heatmap PNG (default: attention-L<layer>.png)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the text view (default: auto, when stdout is a terminal)")
    p.set_defaults(run=run_explain)


def run_explain(args: argparse.Namespace) -> int:
    cfg = read_config(args.model)
    if cfg is not None:  # a preset or local checkpoint: check the flags before the slow load
        _check_layers(args, cfg.n_layers)
    model, tok = load(args)
    _check_layers(args, model.cfg.n_layers)
    tr = trace(model, tok, args.prompt, top_k=args.top_k, temperature=args.temperature, block=args.block,
               logit_lens=args.logit_lens, attention=args.attention, model_name=args.model,
               random_weights=is_random_init(args.model), labels=load_meta(args.model).get("labels"))
    heat = None
    if args.attention:
        heat = args.attention_out or f"attention-L{args.layer}.png"
        w, h = save_attention_png(tr, args.layer, heat)
        print(f"wrote {heat} ({w}x{h}): attention weights of trf_blocks.{args.layer}", file=sys.stderr)

    if args.embedding_vs_linear:
        check = tr.embedding_check
        if args.format == "json":
            return _emit(json.dumps(check, indent=2), args.out)
        from ..explain.text import _embedding
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
    return _emit(tr.to_text(color=color, attention_layer=args.layer if args.attention else None, heatmap=heat),
                 args.out)


def _check_layers(args: argparse.Namespace, n_layers: int) -> None:
    for flag, value in (("--block", args.block), ("--layer", args.layer)):
        if value >= n_layers:
            raise GlassError(f"{flag} {value} does not exist: {args.model} has {n_layers} blocks, "
                             f"choose 0..{n_layers - 1}")


def _emit(text: str, out: str | None) -> int:
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)
    return 0
