"""The picture of a Trace, in the style of the book's GPT figure, as SVG or PNG (and, at the end, a rotary
trace's: its stages and the key/value groups).

The layout is built from small named parts, top to bottom: the title (sizes, layout,
initialisation), the prompt and its tokens, the input box (vocab -> hidden), the blocks,
final_norm, the output box (hidden -> vocab), and on the right the two [V, d] weights joined
by a line that says whether they are one tensor. Both boxes are drawn by one function,
`transition_box`, from their rows. The picture answers the reader's questions on its own:
the input box shows ids -> tok_emb -> d and the same numbers as a one-hot matmul; the output
box shows d -> out_head -> logits, as the dot products h · W[id] they are, -> probabilities
(bars on a 0..1 scale, so random weights look as flat as they are) -> how the next id is
picked. draw.py turns the layout into SVG or PNG; the attention heatmaps are matplotlib's.
"""

from __future__ import annotations

from typing import Callable

from ...errors import GlassError
from . import draw
from .draw import (BLUE, BLUE_BG, GRAY, GRAY_BG, GREEN, INK, MUTED, ORANGE, ORANGE_BG, PURPLE, RED, Drawing, Line, Rect,
                   Text, drawable, fit, wrap)
from ..trace import FAMILY_NAMES, Stage, Trace
from ..notation import TRAINED_STATES, clip, shape as _shape, sizes, token, trained_line

# The geometry, named once: every part places itself relative to these.
MIN_WIDTH = 1040
FLOW_X, FLOW_W = 60, 540            # the flow's boxes
CX = FLOW_X + FLOW_W / 2            # the flow's centre line
FRAME = 20                          # how far a section's frame reaches past its boxes
SIDE_X = FLOW_X + FLOW_W + 30       # the weights column
WEIGHT_W, WEIGHT_H = 190, 52
TIE_X = SIDE_X + WEIGHT_W + 25      # the line that joins the two weights
ROW_H, ROW2_H, GAP = 30, 44, 14     # a one-line row, a two-line row, the arrow between rows
TITLE, LABEL, BODY, SMALL, TINY = 18, 13, 12, 11, 10  # font sizes in pixels
BAR_LABEL_W, BAR_END_PAD = 200, 90  # the bars: token labels on the left, the p = 1 scale on the right
MARK_X = 13                         # how far left of the flow a part's trained/frozen mark sits
STATE_COLORS = {"trained": GREEN, "lora": PURPLE, "partly trained": ORANGE, "frozen": GRAY}


class Pen:
    """Where the next part goes (`y`), and the drawing it adds to."""

    def __init__(self, d: Drawing, y: float) -> None:
        self.d, self.y = d, y

    def text(self, x: float, dy: float, text: str, size: float = BODY, **kw) -> None:
        self.d.add(Text(x, self.y + dy, text, size, **kw))

    def arrow(self, length: float = GAP, label: str = "") -> None:
        self.d.add(Line([(CX, self.y), (CX, self.y + length)]))
        if label:
            self.text(CX + 10, length / 2 + 4, label, SMALL, color=MUTED)
        self.y += length

    def row(self, text: str, detail: str = "", stroke: str = GRAY, bold: bool = False, mono: bool = False,
            key: str = "") -> float:
        """A box across the flow with one line (or two), centred; returns its centre's y."""
        h = ROW2_H if detail else ROW_H
        self.d.add(Rect(FLOW_X, self.y, FLOW_W, h, "white", stroke, width=2 if stroke != GRAY else 1.5, key=key))
        size = LABEL if bold else BODY
        self.text(CX, 19 if detail else 20, fit(text, FLOW_W - 16, size, bold, mono), size, bold=bold,
                  anchor="middle", mono=mono)
        if detail:
            self.text(CX, 36, fit(detail, FLOW_W - 16, BODY, mono=True), BODY, color=MUTED, anchor="middle", mono=True)
        centre = self.y + h / 2
        self.y += h
        return centre


def trace_picture(tr: Trace, **options) -> Drawing:
    """A Trace's picture: GPT-2's figure (`layout`), or for positions inside the attention the rotary flow's."""
    return family_layout(tr, **options) if tr.rotary else layout(tr)


def layout(tr: Trace) -> Drawing:
    """The whole figure as a Drawing (primitives in pixels, and the canvas that holds them)."""
    d = Drawing()
    pen = Pen(d, 34)
    _title(pen, tr)
    _prompt(pen, tr)
    emb = tr.stage("tok_emb")
    emb_y = transition_box(pen, emb, "INPUT", BLUE, BLUE_BG, "tok_emb.weight",
                           [_lookup_row, _one_hot_row, _pos_row, _dropout_row], tr)
    _blocks(pen, tr)
    pen.arrow(20)
    top = pen.y
    pen.row(f"Final LayerNorm · final_norm → {_shape(tr.stage('final_norm').shape)}")
    _mark(pen, tr, "final_norm", top)
    head = tr.stage("out_head")
    head_y = transition_box(pen, head, "OUTPUT", ORANGE, ORANGE_BG, "out_head.weight",
                            [_head_row, _dot_products, _last_row, _softmax_row, _bars, _how_picked, _picked_row], tr)
    _tie(d, tr, emb_y, head_y)
    return d.fit_canvas(MIN_WIDTH, pen.y + 10)


def to_svg(tr: Trace) -> str:
    return draw.to_svg(layout(tr))


def save_png(tr: Trace, path: str, scale: float = 2.0) -> tuple[int, int]:
    """Draw the trace's layout with matplotlib; the PNG is (width * scale, height * scale) pixels."""
    return draw.save_png(layout(tr), path, scale)


# --- the parts, top to bottom --------------------------------------------------------------

def _title(pen: Pen, tr: Trace) -> None:
    cfg, m, p = tr.model["config"], tr.model, tr.params
    untied = f" ({p['total_untied']:,} if untied)" if p["tied"] else ""
    own = " (its own)" if p.get("note") else ""
    pen.text(30, 0, f"glassgpt · {m['name']} · {p['total']:,} parameters{own}{untied}", TITLE, bold=True)
    lines = [(f"vocab_size {cfg['vocab_size']:,} · emb_dim {cfg['emb_dim']} · context_length {cfg['context_length']:,}"
              f" · n_heads {cfg['n_heads']} · n_layers {cfg['n_layers']} · {m['dtype']}", MUTED, False),
             (m["layout"], MUTED, False)]
    if p.get("note"):  # a reader's module built without some biases: what the count leaves out
        lines.append((p["note"], MUTED, False))
    if m["random_weights"]:
        lines.append(("random weights: the shapes are real, the probabilities are not", RED, True))
        if m.get("init"):
            lines.append((f"initialisation: {m['init']}", RED, False))
    lines += [(f"note: {note}", ORANGE, False) for note in tr.notes]
    for text, color, bold in lines:
        for line in wrap(text, MIN_WIDTH - 60, BODY, bold):
            pen.y += 18
            pen.text(30, 0, line, BODY, color=color, bold=bold, key="title")
    _legend(pen, tr)
    pen.y += 26


def _legend(pen: Pen, tr: Trace) -> None:
    """What the marks at the left of tok_emb, pos_emb, final_norm and out_head, and beside the blocks, say:
    what the model's training run did to each part, as its checkpoint records it."""
    trained = tr.model.get("trained")
    if not trained:
        return
    pen.y += 22
    title = "its training run, marked beside each part:"
    pen.text(30, 0, title, BODY, bold=True, key="legend")
    x = 30 + draw.text_width(title, BODY, bold=True) + 16
    for state, label in TRAINED_STATES.items():
        if state in trained["parts"].values():
            pen.d.add(Rect(x, pen.y - 10, 6, 12, STATE_COLORS[state], STATE_COLORS[state], width=0, key="legend"))
            pen.text(x + 12, 0, label, BODY, key="legend")
            x += 12 + draw.text_width(label, BODY) + 16
    for line in wrap(trained["line"], MIN_WIDTH - 60, SMALL):
        pen.y += 16
        pen.text(30, 0, line, SMALL, color=MUTED, key="legend")


def _mark(pen: Pen, tr: Trace, part: str, top: float, bottom: float | None = None) -> None:
    """The mark of one part's state in its training run, beside its box from `top` to `bottom` (the pen's y)."""
    trained = tr.model.get("trained")
    state = trained["parts"].get(part) if trained else None
    if state is not None:
        color = STATE_COLORS[state]
        pen.d.add(Rect(FLOW_X - MARK_X, top, 6, (pen.y if bottom is None else bottom) - top, color, color, width=0,
                       key=f"trained:{part}:{state}"))


def _prompt(pen: Pen, tr: Trace) -> None:
    lines = wrap(f"“{tr.prompt}”", FLOW_W - 16, 14, max_lines=4)
    pen.d.add(Rect(FLOW_X, pen.y, FLOW_W, 16 + 18 * len(lines), GRAY_BG))
    for line in lines:
        pen.text(CX, 22, line, 14, anchor="middle", key="prompt")
        pen.y += 18
    pen.y += 16
    pen.arrow(28, f"tokenizer ({tr.model['tokenizer']})")
    chips = tr.tokens[:8]
    chip_w = min(120, (FLOW_W - 8 * (len(chips) - 1)) / max(1, len(chips)))
    x = CX - (len(chips) * chip_w + 8 * (len(chips) - 1)) / 2
    for tok in chips:
        pen.d.add(Rect(x, pen.y, chip_w, 40, "white"))
        pen.text(x + chip_w / 2, 17, fit(repr(tok["text"])[1:-1], chip_w - 6, BODY, mono=True), BODY,
                 anchor="middle", mono=True)
        pen.text(x + chip_w / 2, 33, str(tok["id"]), SMALL, color=MUTED, anchor="middle", mono=True)
        x += chip_w + 8
    if len(tr.tokens) > len(chips):
        pen.text(x, 25, f"+{len(tr.tokens) - len(chips)} more", SMALL, color=MUTED)
    pen.text(FLOW_X + FLOW_W + 8, 25, f"ids {_shape(tr.stage('tokens').shape)}", BODY, bold=True, mono=True)
    pen.y += 40


Row = Callable[[Pen, Trace], "float | None"]


def transition_box(pen: Pen, stage: Stage, title: str, color: str, background: str, weight: str,
                   rows: list[Row], tr: Trace) -> float:
    """A framed section for a transition (vocab->hidden, hidden->vocab): its title, its rows, and
    its weight box on the right beside the first row. Returns the y where the tie line meets it."""
    pen.arrow(26)
    top = pen.y
    frame = Rect(FLOW_X - FRAME, top, FLOW_W + 2 * FRAME, 0, background, color, width=2)  # its height comes last
    pen.d.add(frame)
    logits = "logits " if stage.name == "out_head" else ""
    pen.text(FLOW_X - 10, 18, f"{title} · {stage.transition}: {_shape(stage.input_shape)} → {logits}"
                              f"{_shape(stage.shape)}", BODY, bold=True, color=color)
    pen.y += 28
    _weight_box(pen.d, SIDE_X, pen.y - 4, stage.weight_shape, weight, color)
    weight_y = pen.y + 22
    for k, row in enumerate(rows):
        if k:
            pen.arrow()
        row(pen, tr)
    pen.y += 12
    frame.h = pen.y - top
    return weight_y


def _weight_box(d: Drawing, x: float, y: float, dims: list[int] | None, name: str, color: str) -> None:
    rows, cols = dims or (0, 0)
    d.add(Rect(x, y, WEIGHT_W, WEIGHT_H, "white", color, width=2, key=f"weight:{name}"))
    d.add(Text(x + WEIGHT_W / 2, y + 20, name, BODY, True, color, anchor="middle", mono=True))
    d.add(Text(x + WEIGHT_W / 2, y + 38, f"{_shape(dims)} = {rows * cols:,}", SMALL, color=MUTED, anchor="middle",
               mono=True))


# Input rows.

def _lookup_row(pen: Pen, tr: Trace) -> None:
    emb, top = tr.stage("tok_emb"), pen.y
    pen.row(f"Token embedding layer · tok_emb = {emb.module}", f"row i of W for token id i → {_shape(emb.shape)}",
            BLUE, bold=True)
    _mark(pen, tr, "tok_emb", top)


def _one_hot_row(pen: Pen, tr: Trace) -> None:
    """tok_emb as a matmul with one-hot rows, and whether the trace found the same numbers."""
    emb = tr.stage("tok_emb")
    b, t = emb.input_shape
    V, d = emb.weight_shape
    pen.d.add(Rect(FLOW_X, pen.y, FLOW_W, 40, "white", BLUE, dash=True))
    pen.text(CX, 16, f"the same as a matmul: one_hot {_shape([b, t, V])} @ W {_shape([V, d])} = {_shape([b, t, d])}",
             BODY, anchor="middle", mono=True)
    check = tr.embedding_check
    if check is None:
        note, color = "(trace with the embedding check to compare it with the lookup)", MUTED
    elif check["equal_one_hot_matmul"]:
        note, color = f"the same numbers as the lookup, checked on this prompt (max |diff| {check['max_abs_diff']:g})", GREEN
    else:
        note, color = f"checked on this prompt: NOT the same (max |diff| {check['max_abs_diff']:g})", RED
    pen.text(CX, 33, note, SMALL, color=color, anchor="middle")
    pen.y += 40


def _pos_row(pen: Pen, tr: Trace) -> None:
    pos, top = tr.stage("pos_emb"), pen.y
    pen.row(f"+ positional embedding pos_emb {_shape(pos.shape)} · weight {_shape(pos.weight_shape)}")
    _mark(pen, tr, "pos_emb", top)


def _dropout_row(pen: Pen, tr: Trace) -> None:
    pen.row(f"dropout drop_emb → embeddings {_shape(tr.stage('embeddings').shape)}")


def _blocks(pen: Pen, tr: Trace) -> None:
    """The transformer blocks, as one framed block drawn open."""
    cfg, blk = tr.model["config"], tr.stage("trf_blocks.0")
    inner = {s.name.split(".", 2)[2]: s for s in tr.stages if s.parent and s.parent.startswith("trf_blocks.")}
    heads = (f"{cfg['n_heads']} heads × {cfg['emb_dim'] // cfg['n_heads']}: q, k, v {_shape(inner['att.heads'].shape)} "
             f"· attention weights {_shape(inner['att.attn_weights'].shape)}" if "att.heads" in inner else "")
    ff = (f"ff.layers.0 → {_shape(inner['ff.layers.0'].shape)} → GELU → ff.layers.2 → "
          f"{_shape(inner['ff.layers.2'].shape)}" if "ff.layers.0" in inner else "")
    rows = [("LayerNorm 1 · norm1", ""),
            ("Masked multi-head attention · att (W_query, W_key, W_value, out_proj)", heads),
            ("Dropout + shortcut", ""), ("LayerNorm 2 · norm2", ""),
            (f"Feed forward · {cfg['emb_dim']} → {4 * cfg['emb_dim']} → {cfg['emb_dim']} (GELU)", ff),
            ("Dropout + shortcut", "")]
    pen.arrow(26)
    top = pen.y
    frame = Rect(FLOW_X - FRAME, top, FLOW_W + 2 * FRAME, 0, GRAY_BG, GRAY, width=2)
    pen.d.add(frame)
    pen.text(FLOW_X - 10, 18, f"TRANSFORMER BLOCK × {cfg['n_layers']} (trf_blocks) · {_shape(blk.input_shape)} → "
                              f"{_shape(blk.shape)}", BODY, bold=True, color=MUTED)
    pen.y += 30
    for label, detail in rows:
        height = 42 if detail else ROW_H
        pen.d.add(Rect(FLOW_X, pen.y, FLOW_W, height, "white"))
        pen.text(FLOW_X + 12, 19, fit(label, FLOW_W - 24, BODY), BODY)
        if detail:
            pen.text(FLOW_X + 12, 35, fit(detail, FLOW_W - 24, SMALL, mono=True), SMALL, color=MUTED, mono=True)
        pen.y += height + 8
    pen.y += 2
    frame.h = pen.y - top
    pen.d.add(Text(SIDE_X, top + frame.h / 2 - 8, f"width stays {cfg['emb_dim']}", BODY, True, MUTED))
    pen.d.add(Text(SIDE_X, top + frame.h / 2 + 10, f"{blk.params:,} params per block", SMALL, color=MUTED))
    _block_marks(pen, tr, top + frame.h / 2 + 22)


def _block_marks(pen: Pen, tr: Trace, y: float) -> None:
    """One mark per block beside the frame (trf_blocks.0 first, rows of 20), then what they say in words."""
    trained = tr.model.get("trained")
    if not trained:
        return
    n = tr.model["config"]["n_layers"]
    for i in range(n):
        state = trained["parts"].get(f"trf_blocks.{i}", "frozen")
        color = STATE_COLORS[state]
        pen.d.add(Rect(SIDE_X + 10 * (i % 20), y + 12 * (i // 20), 7, 9, color, color, width=0,
                       key=f"trained:trf_blocks.{i}:{state}"))
    y += 12 * -(-n // 20) + 12
    blocks = {p: s for p, s in trained["parts"].items() if p.startswith("trf_blocks.")}
    for k, line in enumerate(wrap(trained_line(blocks), TIE_X - SIDE_X - 10, SMALL, max_lines=4)):
        pen.d.add(Text(SIDE_X, y + 15 * k, line, SMALL, color=MUTED, key="trained:blocks"))


# Output rows.

def _head_row(pen: Pen, tr: Trace) -> None:
    head, top = tr.stage("out_head"), pen.y
    pen.row(f"Linear output layer · out_head = {head.module}", f"x @ W.T → logits {_shape(head.shape)}", ORANGE,
            bold=True)
    _mark(pen, tr, "out_head", top)


def _dot_products(pen: Pen, tr: Trace) -> None:
    """The top logits as the dot products they are: h · W[id] (+ bias), |W[id]|, cos; the check; the nearest rows."""
    hd = tr.head
    if not hd:
        return
    rows = hd["rows"][:3]
    untied = bool(rows) and "cos_emb_head" in rows[0]
    height = 92 + 16 * len(rows)
    pen.d.add(Rect(FLOW_X, pen.y, FLOW_W, height, "white", ORANGE, dash=True, key="dot_products"))
    bias = " + bias[id]" if hd["has_bias"] else ""
    pen.text(CX, 16, f"each logit is a dot product: logit[id] = h · W[id]{bias}, |h| = {hd['h_norm']:.2f}", BODY,
             anchor="middle", mono=True)
    y = 34
    extra = f"{'cos(tok_emb[id], W[id])':>25}" if untied else ""
    pen.text(FLOW_X + 12, y, f"{'':<16}{'logit':>9}{'|W[id]|':>10}{'cos(h, W[id])':>15}{extra}", SMALL, color=MUTED,
             mono=True)
    for row in rows:
        y += 16
        extra = f"{row['cos_emb_head']:>+25.4f}" if untied else ""
        pen.text(FLOW_X + 12, y, f"{clip(repr(row['text']), 15):<16}{row['logit']:>9.3f}{row['w_norm']:>10.3f}"
                                 f"{row['cos']:>15.4f}{extra}", SMALL, mono=True, key="dot_row")
    near = ", ".join(token(t["text"], 14) for t in hd["nearest"][:4])
    for text, color in ((hd["tying_note"], MUTED), (f"checked: every logit equals out_head's (max |diff| {hd['max_abs_diff']:.0e})",
                                         GREEN), (f"nearest to h by cosine (not the logits' order): {near}", MUTED)):
        y += 18
        pen.text(FLOW_X + 12, y, fit(text, FLOW_W - 24, SMALL), SMALL, color=color)
    pen.y += height


def _last_row(pen: Pen, tr: Trace) -> None:
    pen.row(f"last position: logits[:, -1, :] → {_shape(tr.stage('last_logits').shape)}", mono=True)


def _softmax_row(pen: Pen, tr: Trace) -> None:
    probs = tr.stage("probs")
    pen.row(f"{probs.module} → probabilities {_shape(probs.shape)}", mono=True)


def _bars(pen: Pen, tr: Trace) -> None:
    """The top 5 probabilities as bars from 0 to 1 (keys bar:N, and bar_scale for the p = 1 line)."""
    top, V = tr.next_token["top"][:5], tr.stage("probs").shape[-1]
    pen.y += 20
    pen.text(FLOW_X, 0, f"top {len(top)} of {V:,}: bars from probability 0 to 1; all {V:,} equally likely would be "
                        f"{1 / V:.2g} each", SMALL, color=MUTED)
    pen.y += 10
    if tr.model["random_weights"]:
        pen.text(FLOW_X, 8, "random weights: these probabilities are noise, not predictions", SMALL, bold=True,
                 color=RED)
        pen.y += 16
    pen.y += 6
    bar_x, full = FLOW_X + BAR_LABEL_W, FLOW_W - BAR_LABEL_W - BAR_END_PAD
    pen.d.add(Line([(bar_x + full, pen.y - 2), (bar_x + full, pen.y + 22 * len(top) - 4)], MUTED, dash=True,
                   arrow=False, width=1, key="bar_scale"))
    for k, cand in enumerate(top):
        pen.text(bar_x - 10, 12, clip(repr(cand["text"]), 22), BODY, anchor="end", mono=True)
        pen.d.add(Rect(bar_x, pen.y + 1, max(2.0, full * cand["prob"]), 14, ORANGE, ORANGE, width=0, key=f"bar:{k}"))
        pen.text(bar_x + full + 8, 12, f"{cand['prob']:.4f}", SMALL, color=MUTED, mono=True)
        pen.y += 22
    pen.text(bar_x + full, 8, "p = 1", TINY, color=MUTED, anchor="middle", mono=True)
    pen.y += 16


def _how_picked(pen: Pen, tr: Trace) -> None:
    """How the id is chosen from the probabilities, in the words of the book's chapter 5."""
    nt = tr.next_token
    if nt["kind"] == "class":
        lines = ["the class is the most probable one: argmax(probs); the classifier reads the last position only"]
    else:
        lines = [f"greedy decoding (as here): next id = argmax(probs) → {nt['id']}",
                 "sampling instead draws an id at random with these probabilities",
                 f"(temperature {nt['temperature']:g} is already applied; top-k would keep only the k largest)"]
    for line in lines:
        pen.text(FLOW_X, 12, line, SMALL)
        pen.y += 17


def _picked_row(pen: Pen, tr: Trace) -> None:
    nt = tr.next_token
    what = "class" if nt["kind"] == "class" else "next id"
    pen.row(f"{what} {nt['id']} → {clip(repr(nt['text']), 30)}", stroke=ORANGE, bold=True)


def _tie(d: Drawing, tr: Trace, emb_y: float, head_y: float) -> None:
    """The line joining the two [V, d] weights, and whether they are one tensor."""
    emb, head = tr.stage("tok_emb"), tr.stage("out_head")
    if head.transition == "hidden->classes":
        note, color = "separate tensors", GRAY
    elif tr.params["tied"]:
        note, color = "the same tensor (tied)", GREEN
    else:
        note, color = "two separate tensors (untied)", GRAY
    d.add(Line([(SIDE_X + WEIGHT_W, emb_y), (TIE_X, emb_y), (TIE_X, head_y), (SIDE_X + WEIGHT_W, head_y)], color,
               dash=True, arrow=False, width=2, key="tie"))
    d.add(Text(TIE_X + 8, (emb_y + head_y) / 2, note, BODY, True, color, key="tie_label"))
    shapes = (f"both {_shape(emb.weight_shape)}" if emb.weight_shape == head.weight_shape
              else f"{_shape(emb.weight_shape)} and {_shape(head.weight_shape)}")
    d.add(Text(TIE_X + 8, (emb_y + head_y) / 2 + 16, shapes, SMALL, color=MUTED, mono=True, key="tie_label"))


# --- attention heatmaps ------------------------------------------------------------------------

def save_attention_png(tr: Trace, layer: int, path: str) -> tuple[int, int]:
    """A grid of heatmaps, one per head, of layer `layer`'s attention weights, saved as PNG: (width, height)."""
    fig = attention_figure(tr, layer)
    fig.savefig(path)
    width, height = fig.canvas.get_width_height()
    return width, height


def attention_figure(tr: Trace, layer: int):
    """The matplotlib Figure of `save_attention_png`: one heatmap per head, one colour bar for all (a Qwen3/Llama
    model's query heads each titled with the key/value group it reads)."""
    att = tr.attention_weights
    if att is None:
        raise GlassError("this trace has no attention weights: trace it with attention=True (--attention)")
    n_layers = len(att["layers"])
    if not 0 <= layer < n_layers:
        raise GlassError(f"layer {layer} does not exist: choose 0..{n_layers - 1}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise GlassError("attention heatmaps need matplotlib: pip install 'glassgpt[plot]'") from None
    heads, groups = att["layers"][layer], att.get("groups")
    labels = [clip(repr(drawable(t))[1:-1], 10) for t in att["tokens"]]
    cols = min(4, len(heads))
    rows = -(-len(heads) // cols)
    random_note = tr.model["random_weights"]
    fig = Figure(figsize=(3.2 * cols + 1.0, 3.0 * rows + (0.9 if random_note else 0.6)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    title = f"trf_blocks.{layer} attention weights [heads, t, t]: row = query token, column = key token"
    if random_note:
        title += "\nrandom weights: the shapes are real, the pattern is noise"
    fig.suptitle(title)
    axes = []
    for k, weights in enumerate(heads):
        ax = fig.add_subplot(rows, cols, k + 1)
        image = ax.imshow(weights, cmap="Oranges", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {k}" if groups is None else f"query head {k}, kv group {groups[k]}", fontsize=9)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        for label in ax.get_xticklabels() + ax.get_yticklabels():
            label.set_parse_math(False)  # a token's $ is a dollar sign, not the start of a formula
        axes.append(ax)
    fig.colorbar(image, ax=axes, label="attention weight (each row sums to 1)", shrink=0.8)
    return fig


# --- the picture of a rotary trace (RoPE: Qwen3, Llama 3.2) -------------------------------------------

TRANSITION = "#b45309"  # the two stages where the width changes (V -> d, d -> V), as the GPT-2 picture marks them


def family_layout(tr: Trace, width: float = 980, **_options) -> Drawing:
    """The flow top to bottom, one box per stage with its shape, and the key/value groups beside the attention."""
    cfg, att = tr.config, tr.attention
    d = Drawing()
    d.add(Text(20, 30, f"{FAMILY_NAMES[tr.family]}: {cfg['n_layers']} blocks, d {cfg['emb_dim']:,}, "
                       f"V {cfg['vocab_size']:,}", size=16, bold=True, color=INK))
    x, y, w, h = 20.0, 50.0, 560.0, 40.0
    for i, s in enumerate(tr.stages):
        changes_width = s.name in ("tok_emb", "out_head")
        d.add(Rect(x, y, w, h, fill="white", stroke=TRANSITION if changes_width else GRAY, key=f"stage:{s.name}"))
        d.add(Text(x + 10, y + 17, f"{s.name}  {sizes(s.shape)}", size=13, bold=True, mono=True))
        d.add(Text(x + 10, y + 33, draw.fit(s.note, w - 20, 11), size=11, color=MUTED))
        if i:
            d.add(Line([(x + w / 2, y - 14), (x + w / 2, y)]))
        y += h + 14
    # the groups: each key/value head and the query heads that read it (repeat_interleave)
    gx, gy = x + w + 40, 50.0
    d.add(Text(gx, gy + 12, f"{cfg['n_heads']} query heads, {len(att['groups'])} key/value heads", size=13, bold=True))
    for j, group in enumerate(att["groups"]):
        row = gy + 28 + j * 26
        d.add(Rect(gx, row, 52, 20, fill="#eef2ff", key=f"kv:{j}"))
        d.add(Text(gx + 26, row + 14, f"kv{j}", size=11, anchor="middle", mono=True))
        d.add(Text(gx + 62, row + 14, "  ".join(f"q{q}" for q in group), size=11, mono=True, color=MUTED))
    d.add(Text(gx, gy + 48 + len(att["groups"]) * 26, "RoPE turns q and k in every block; no pos_emb", size=11,
               color=MUTED))
    if tr.head:
        y = _rotary_dot_products(d, tr.head, x, y, w)
    return d.fit_canvas(width, y)


def _rotary_dot_products(d: Drawing, hd: dict, x: float, y: float, w: float) -> float:
    """The top logits as the dot products they are, h · W[id] with h final_norm's (RMSNorm) output, under the flow."""
    rows = hd["rows"][:3]
    height = 74 + 16 * len(rows)
    d.add(Rect(x, y, w, height, fill="white", stroke=TRANSITION, dash=True, key="dot_products"))
    d.add(Text(x + 10, y + 17, f"each logit is a dot product: logit[id] = h · W[id], |h| = {hd['h_norm']:.2f}", size=12,
               bold=True, mono=True))
    d.add(Text(x + 10, y + 33, f"{'':<16}{'logit':>9}{'|W[id]|':>10}{'cos(h, W[id])':>15}", size=11, color=MUTED,
               mono=True))
    row_y = y + 33
    for row in rows:
        row_y += 16
        d.add(Text(x + 10, row_y, f"{clip(repr(row['text']), 15):<16}{row['logit']:>9.3f}{row['w_norm']:>10.3f}"
                                  f"{row['cos']:>15.4f}", size=11, mono=True, key="dot_row"))
    d.add(Text(x + 10, row_y + 18, draw.fit(hd["tying_note"], w - 20, 11), size=11, color=MUTED))
    d.add(Text(x + 10, row_y + 34, f"checked: every logit equals out_head's (max |diff| {hd['max_abs_diff']:.0e})",
               size=11, color=GREEN))
    return y + height + 14
