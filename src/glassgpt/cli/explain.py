"""`glassgpt explain`: the live trace of one prompt, as text, JSON, SVG or PNG; `--passage` scores
every token of a text; `--compare B` sets a second model's next tokens beside the first's; `--why`
attributes the next token to the model's parts and the prompt's tokens (flags from explain/options.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import GlassError
from ..explain import About, trace
from ..explain.views import draw
from ..explain.compare import changes_of, compare, same_tokenizer
from ..explain.views.compare import comparison_layout, comparison_text
from ..explain.views.diagram import layout, save_attention_png
from ..explain.trace import changes_from_gpt2
from ..explain.options import TRACE_OPTIONS, WHY_OPTIONS, add_flags
from ..explain.pieces import sliding_windows
from ..explain.passage import passage
from ..explain.views.passage import passage_layout, passage_text
from ..explain.why import why
from ..explain.views.why import why_layout
from ..explain.views.text import embedding_section
from ..explain.trace import trace_options
from .. import formats
from ..formats import Source
from ..kinds import describe
from ..model import GPTModel
from ..prompt import BOOK_FILE_HINT
from ..tokenizer import Tokenizer
from .common import (add_model_args, add_reading_args, add_special_arg, class_names, classifier_reading_of,
                     encode_prompt, load, open_model, positive_int, say_opened, special_reading)
from .progress import StepBar

DEFAULT_PROMPT = "Every effort moves you"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="show every shape from text to the next token, and the weights behind them",
                       description="Run PROMPT through the model once and show each stage from the real tensors: "
                                   "where vocab_size becomes emb_dim (tok_emb) and back (out_head), which weights "
                                   "do it, and each top logit as the dot product h · W[id] that it is.")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help=f"the text to trace (default: {DEFAULT_PROMPT!r})")
    add_model_args(p)
    p.add_argument("--format", choices=("txt", "json", "svg", "png"), default="txt",
                   help="txt: the flow in the terminal; json: the whole trace; svg/png: the picture (default: txt)")
    p.add_argument("--out", metavar="FILE", help="write to FILE (default: explain.png for png, else stdout)")
    add_flags(p, TRACE_OPTIONS)
    p.add_argument("--embedding-vs-linear", action="store_true",
                   help="print only the proof that tok_emb(ids) == one_hot(ids) @ tok_emb.weight, with timings "
                        "(default: off)")
    p.add_argument("--attention-out", metavar="FILE",
                   help="where --attention writes the heatmap PNG (default: attention-L<layer>.png)")
    p.add_argument("--passage", nargs="?", const="", default=None, metavar="FILE",
                   help="score a whole text instead: the probability the model gave each true next token, and the "
                        "positions it got most wrong; FILE holds the text (without FILE: the PROMPT itself)")
    p.add_argument("--compare", metavar="SPEC",
                   help="a second model (any --model spec) traced on the same prompt: both next-token "
                        "distributions side by side, their KL divergence, and each block's logit lens")
    add_flags(p, WHY_OPTIONS)
    p.add_argument("--windows", action="store_true",
                   help="show the PROMPT's sliding windows as the book's GPTDatasetV1 cuts them (no model needed): "
                        "each window's inputs and targets, the stride and the overlap")
    p.add_argument("--window-length", type=positive_int, default=4, metavar="N",
                   help="--windows: tokens per window, the book's max_length (default: 4)")
    p.add_argument("--stride", type=positive_int, default=None, metavar="N",
                   help="--windows: tokens from one window's start to the next (default: the window length)")
    add_reading_args(p)
    add_special_arg(p)
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the text view (default: auto, when stdout is a terminal and NO_COLOR is unset or empty)")
    p.set_defaults(run=run_explain)


def read_as(args: argparse.Namespace, source: Source, model: GPTModel) -> About:
    """What `source` says of the model that its weights cannot, with `--recipe book` / `--max-length`: a classifier
    the book's code saved, read at its padded length and named "not spam" / "spam" as classify_review names its
    classes (unless its .json names them)."""
    if args.recipe is None and args.max_length is None:
        return source.about()
    if model.cfg.num_classes is None:
        raise GlassError(f"--recipe book and --max-length read a classifier as the book's classify_review does, and "
                         f"{args.model} is a language model: drop them")
    reading, notes = classifier_reading_of(source, args.recipe, args.max_length)
    for note in notes:
        print(f"note: {args.model}: {note}", file=sys.stderr)
    return source.about(reading, class_names(source, model.cfg.num_classes, reading.padded))


def run_explain(args: argparse.Namespace) -> int:
    if (args.versus is not None or args.patch is not None) and not args.why:
        raise GlassError("--versus and --patch belong to --why: add --why")
    if args.allow_special and (args.passage is not None or args.compare or args.patch is not None):
        raise GlassError("--allow-special reads the prompt traced or explained (--why); --passage, --compare and "
                         "--patch read their texts as plain text: drop --allow-special")
    if args.passage is not None:
        return _run_passage(args, open_model(args))
    if args.windows:
        w = sliding_windows(args.prompt, args.window_length, args.stride)
        return emit(json.dumps(w.to_dict(), indent=2) if args.format == "json" else w.to_text(), args.out)
    source = open_model(args)
    cfg = source.local_config()
    if cfg is not None:  # a preset or local checkpoint: check the flags before the slow load
        _check_layers(args, cfg.n_layers)
    model, tok = load(args, source, tokens=len(args.prompt.encode("utf-8")))  # (its bytes bound its tokens)
    _check_layers(args, model.cfg.n_layers)
    if rotary(model):  # Qwen3, Llama 3.2, OLMo 3, ...: the rotary trace's text view
        return _run_family(args, model, tok, source)
    about = read_as(args, source, model)
    allowed, special_note = special_reading(tok, args.prompt, args.allow_special)
    ids = encode_prompt(tok, args.prompt, allowed) if allowed and special_note else None
    if args.compare:
        return _run_compare(args, model, tok, about)
    if args.why:
        return _run_why(args, model, tok, about, ids, special_note)
    options = trace_options(args, embedding_check=args.embedding_check or args.embedding_vs_linear)
    tr = trace(model, tok, None if ids else args.prompt, ids=ids, options=options, about=about)
    if special_note:  # how <|endoftext|> in the prompt was read: in the trace, as its other notes
        tr.notes.append(special_note)
    for note in tr.notes:
        print(f"note: {note}", file=sys.stderr)
    if model.cfg.num_classes is not None and not about.reading.padded and source.kind == "state_dict":
        print(f"note: {BOOK_FILE_HINT}", file=sys.stderr)
    heat = None
    if args.attention:
        heat = args.attention_out or f"attention-L{args.layer}.png"
        w, h = save_attention_png(tr, args.layer, heat)
        print(f"wrote {heat} ({w}x{h}): attention weights of trf_blocks.{args.layer}", file=sys.stderr)
    if args.embedding_vs_linear:
        if args.format == "json":
            return emit(json.dumps(tr.embedding_check, indent=2), args.out)
        return emit(embedding_section(tr), args.out)
    return _show(args, tr.to_dict(), lambda: layout(tr),
                 lambda color: tr.to_text(color=color, attention_layer=args.layer if args.attention else None,
                                          heatmap=heat))


def rotary(model) -> bool:
    """Whether the model's description puts its positions inside the attention (RoPE), as the trace reads it:
    then its trace is the rotary one, with its own text view and picture; learned positions (GPT-2 and chapter
    4's variants on its base) take GPT-2's."""
    return describe(model).positions.kind != "learned"


def _run_family(args: argparse.Namespace, model, tok: Tokenizer, source: Source) -> int:
    if args.embedding_vs_linear:
        raise GlassError(f"for a {model.cfg.family} model the one-hot proof is the third of the four answers that "
                         "explain prints: drop --embedding-vs-linear")
    if args.why:  # the same answer as GPT-2's (its JSON under "why"), and the same picture
        result = why(model, tok, args.prompt, versus=args.versus, patch=args.patch, top_k=args.top_k)
        for note in result.notes[:-1]:  # (the last, on attention, is in every view)
            print(f"note: {note}", file=sys.stderr)
        return _show(args, {"why": result.to_dict()}, lambda: why_layout(result), lambda color: result.to_text())
    if args.compare:
        gpt2, second = load_second(args, args.compare, None, dtype=model.tok_emb.weight.dtype)
        if rotary(gpt2):  # two Qwen3/Llama models: their next tokens side by side
            if {model.cfg.family, gpt2.cfg.family} - {"qwen3", "llama3"}:
                raise GlassError(f"--compare sets two Qwen3 or Llama models' next tokens side by side, not a "
                                 f"{model.cfg.family} and a {gpt2.cfg.family}: --compare gpt2 gives what changed "
                                 "from GPT-2, and `glassgpt compare --models` the architectures side by side")
            return _run_compare(args, model, tok, source.about(), (gpt2, second))
        # Qwen3 and Llama: the book's GPT-to-Llama stages with their parameter counts; any other model: every
        # change its description holds (compare.py)
        changes = changes_from_gpt2(model, gpt2) if model.cfg.family in ("qwen3", "llama3") and not \
            model.cfg.moe else changes_of(model, gpt2)
        if args.format in ("svg", "png"):
            raise GlassError("what changed from GPT-2 is text (or --format json): drop --format " + args.format)
        if args.format == "json":
            return emit(json.dumps(changes.to_dict(), indent=2), args.out)
        return emit(changes.to_text(), args.out)
    # every trace option, as GPT-2's path reads them; the one-hot proof is always the third answer
    tr = trace(model, tok, args.prompt, options=trace_options(args, embedding_check=True), about=source.about())
    for note in tr.notes:
        print(f"note: {note}", file=sys.stderr)
    heat = None
    if args.attention:  # every query head of --layer, each titled with the key/value group it reads
        heat = args.attention_out or f"attention-L{args.layer}.png"
        w, h = save_attention_png(tr, args.layer, heat)
        print(f"wrote {heat} ({w}x{h}): attention weights of trf_blocks.{args.layer}", file=sys.stderr)
    return _show(args, tr.to_dict(), tr.picture,
                 lambda color: tr.to_text(attention_layer=args.layer if args.attention else None, heatmap=heat))


def _run_passage(args: argparse.Namespace, source: Source) -> int:
    text = args.prompt if not args.passage else _read_text(args.passage)
    model, tok = load(args, source, tokens=len(text.encode("utf-8")))
    with StepBar("passage") as bar:  # a long text runs window after window
        result = passage(model, tok, text, about=source.about(), worst=args.top_k, progress=bar)
    return _show(args, result.to_dict(), lambda: passage_layout(result), lambda color: passage_text(result, color))


def _run_compare(args: argparse.Namespace, model: GPTModel, tok: Tokenizer, spec: About,
                 loaded: tuple[GPTModel, Source] | None = None) -> int:
    """Both models' next tokens side by side; the second reads the text with its own tokenizer."""
    other, second = loaded or load_second(args, args.compare, None)
    result = compare(model, other, tok, args.prompt, spec, second.about(), top_k=args.top_k,
                     tokenizer_b=second.tokenizer())
    return _show(args, result.to_dict(), lambda: comparison_layout(result), lambda color: comparison_text(result))


def _run_why(args: argparse.Namespace, model: GPTModel, tok: Tokenizer, spec: About, ids: list[int] | None,
             special_note: str | None) -> int:
    """The attribution; its JSON is the trace's with `why` added. `ids`: the prompt's, when --allow-special
    read <|endoftext|> in it as its token (`special_note` says so)."""
    result = why(model, tok, None if ids else args.prompt, versus=args.versus, patch=args.patch,
                 ids=ids, labels=spec.labels, top_k=args.top_k, reading=spec.reading)
    for note in result.notes[:-1] + ([special_note] if special_note else []):  # (the last, on attention,
        print(f"note: {note}", file=sys.stderr)                                      #  is in every view)
    data = None
    if args.format == "json":
        tr = trace(model, tok, None if ids else args.prompt, ids=ids,
                   options=trace_options(args, embedding_check=False), about=spec)
        if special_note:
            tr.notes.append(special_note)
        data = tr.to_dict()
        data["why"] = result.to_dict()
    return _show(args, data, lambda: why_layout(result), lambda color: result.to_text(color=color))


def load_second(args: argparse.Namespace, spec: str | Source, tok: Tokenizer | None,
                dtype=None) -> tuple[GPTModel, Source]:
    """The model a second spec names (diff's B, explain's --compare), on the same device and dtype as the
    first (or `dtype`), and its source; its tokenizer must be the first's (`tok`; None: not checked, a
    family model's --compare), or the two would not read the prompt alike."""
    source = spec if isinstance(spec, Source) else formats.open(spec)
    if not isinstance(spec, Source):
        say_opened(source)
    spec = source.name
    model = source.load(args.device, dtype or args.dtype, seed=args.seed if args.seed is not None else 0)
    if tok is None:
        return model, source
    other = source.tokenizer()
    if not same_tokenizer(other, tok):
        first = getattr(args, "model", None) or args.a  # explain's --model, diff's A
        raise GlassError(f"{spec} has another tokenizer ({other.name}, {other.n_vocab:,} tokens) than {first} "
                         f"({tok.name}, {tok.n_vocab:,}): compare models that read text alike")
    return model, source


def _show(args: argparse.Namespace, data: dict, drawing, text) -> int:
    """Write one result as the --format asks: text (text(color)), JSON (data) or a picture (drawing())."""
    if args.format == "json":
        return emit(json.dumps(data, indent=2, ensure_ascii=False), args.out)
    if args.format == "svg":
        return emit(draw.to_svg(drawing()), args.out)
    if args.format == "png":
        path = args.out or "explain.png"
        w, h = draw.save_png(drawing(), path)
        print(f"wrote {path} ({w}x{h})", file=sys.stderr)
        return 0
    # auto: on a terminal, unless NO_COLOR is set and not empty (no-color.org)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty() and not args.out
                                       and not os.environ.get("NO_COLOR"))
    return emit(text(color), args.out)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except IsADirectoryError:
        raise GlassError(f"--passage {path} is a directory: give a text file") from None


def _check_layers(args: argparse.Namespace, n_layers: int) -> None:
    for flag, value in (("--block", args.block), ("--layer", args.layer)):
        if value >= n_layers:
            raise GlassError(f"{flag} {value} does not exist: {args.model} has {n_layers} blocks, "
                             f"choose 0..{n_layers - 1}")


def emit(text: str, out: str | None) -> int:
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(text)
    return 0
