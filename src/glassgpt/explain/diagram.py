"""The picture of a Trace, in the style of the book's GPT figure, as SVG or PNG.

One layout (boxes, text, arrows in pixel coordinates) is computed from the live
trace, then drawn by two small backends: plain SVG text, and matplotlib for PNG
(an optional dependency). The picture answers the reader's four questions on its own:
the input box shows ids -> tok_emb -> d and the same numbers as a one-hot matmul; the
output box shows d -> out_head -> V logits -> probabilities (bars on a 0..1 scale, so
random weights look as flat as they are) -> how the next id is picked; a line on the
right joins the two [V, d] weights and says whether they are one tensor (tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

from ..errors import GlassError

if TYPE_CHECKING:
    from .trace import Trace

WIDTH = 1040
BLUE, BLUE_BG = "#1f6fd1", "#e8f1fc"
ORANGE, ORANGE_BG = "#d9631e", "#fdf0e6"
GRAY, GRAY_BG, INK, MUTED, RED, GREEN = "#6b7280", "#f3f4f6", "#111827", "#4b5563", "#b91c1c", "#15803d"


@dataclass
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str = "white"
    stroke: str = GRAY
    dash: bool = False
    width: float = 1.5


@dataclass
class Text:
    x: float
    y: float
    text: str
    size: float = 13
    bold: bool = False
    color: str = INK
    anchor: str = "start"  # start | middle | end
    mono: bool = False


@dataclass
class Line:
    points: list[tuple[float, float]]
    color: str = GRAY
    dash: bool = False
    arrow: bool = True
    width: float = 1.5


def _shape(shape: list[int] | None) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]" if shape else ""


def layout(tr: "Trace") -> tuple[list, int, int]:
    """Primitives for the whole figure, and its width and height in pixels."""
    cfg = tr.model["config"]
    items: list = []
    add = items.append
    cx = 330  # the flow's centre line
    box_x, box_w = 60, 540
    right = box_x + box_w + 30  # the weights column
    y = 34
    add(Text(30, y, f"glassgpt · {tr.model['name']} · {tr.params['total']:,} parameters"
                    + (f" ({tr.params['total_untied']:,} if untied)" if tr.params["tied"] else ""), 18, True))
    y += 22
    add(Text(30, y, f"vocab_size {cfg['vocab_size']:,} · emb_dim {cfg['emb_dim']} · context_length "
                    f"{cfg['context_length']:,} · n_heads {cfg['n_heads']} · n_layers {cfg['n_layers']} · "
                    f"{tr.model['dtype']}", 12, color=MUTED))
    if tr.model["random_weights"]:
        y += 18
        add(Text(30, y, "random weights: the shapes are real, the probabilities are not", 12, True, RED))

    def step(label: str, y0: float, y1: float) -> None:
        add(Line([(cx, y0), (cx, y1)]))
        if label:
            add(Text(cx + 10, (y0 + y1) / 2 + 4, label, 11, color=MUTED))

    # The prompt and its tokens.
    y += 24
    add(Rect(box_x, y, box_w, 34, GRAY_BG))
    add(Text(cx, y + 22, f"“{_clip(tr.prompt, 60)}”", 14, anchor="middle"))
    step(f"tokenizer ({tr.model['tokenizer']})", y + 34, y + 62)
    y += 62
    chips = tr.tokens[:8]
    chip_w = min(120, (box_w - 8 * (len(chips) - 1)) / max(1, len(chips)))
    x = cx - (len(chips) * chip_w + 8 * (len(chips) - 1)) / 2
    for tok in chips:
        add(Rect(x, y, chip_w, 40, "white"))
        add(Text(x + chip_w / 2, y + 17, _clip(repr(tok["text"])[1:-1], 12), 12, anchor="middle", mono=True))
        add(Text(x + chip_w / 2, y + 33, str(tok["id"]), 11, color=MUTED, anchor="middle", mono=True))
        x += chip_w + 8
    if len(tr.tokens) > len(chips):
        add(Text(x, y + 25, f"+{len(tr.tokens) - len(chips)} more", 11, color=MUTED))
    tokens = tr.stage("tokens")
    add(Text(box_x + box_w + 8, y + 25, f"ids {_shape(tokens.shape)}", 12, True, mono=True))
    y += 40

    # Input box: vocab -> hidden.
    emb, pos, embs = tr.stage("tok_emb"), tr.stage("pos_emb"), tr.stage("embeddings")
    step("", y, y + 26)
    y += 26
    top_in = y
    h_in = 226
    add(Rect(box_x - 20, y, box_w + 40, h_in, BLUE_BG, BLUE, width=2))
    add(Text(box_x - 10, y + 18, f"INPUT · {emb.transition}: {_shape(emb.input_shape)} → {_shape(emb.shape)}", 12, True, BLUE))
    y += 28
    add(Rect(box_x, y, box_w, 44, "white", BLUE, width=2))
    add(Text(cx, y + 19, f"Token embedding layer · tok_emb = {emb.module}", 13, True, anchor="middle"))
    add(Text(cx, y + 36, f"row i of W for token id i → {_shape(emb.shape)}", 12, color=MUTED, anchor="middle", mono=True))
    emb_y = y + 22
    _weight_box(items, right, y - 4, emb.weight_shape, "tok_emb.weight", BLUE)
    y += 50
    _one_hot_view(items, tr, box_x, y, box_w)
    step("", y + 42, y + 56)
    y += 56
    add(Rect(box_x, y, box_w, 30, "white"))
    add(Text(cx, y + 20, f"+ positional embedding pos_emb {_shape(pos.shape)} · weight {_shape(pos.weight_shape)}", 12, anchor="middle"))
    step("", y + 30, y + 44)
    y += 44
    add(Rect(box_x, y, box_w, 30, "white"))
    add(Text(cx, y + 20, f"dropout drop_emb → embeddings {_shape(embs.shape)}", 12, anchor="middle"))
    y = top_in + h_in

    # The transformer blocks, one drawn open.
    blk = tr.stage("trf_blocks.0")
    inner = {s.name.split(".", 2)[2]: s for s in tr.stages if s.parent and s.parent.startswith("trf_blocks.")}
    step("", y, y + 26)
    y += 26
    top_blk = y
    rows = [
        ("LayerNorm 1 · norm1", ""),
        ("Masked multi-head attention · att (W_query, W_key, W_value, out_proj)",
         f"{cfg['n_heads']} heads × {cfg['emb_dim'] // cfg['n_heads']}: q, k, v {_shape(inner['att.heads'].shape)} · "
         f"attention weights {_shape(inner['att.attn_weights'].shape)}"
         if "att.heads" in inner else ""),
        ("Dropout + shortcut", ""),
        ("LayerNorm 2 · norm2", ""),
        (f"Feed forward · {cfg['emb_dim']} → {4 * cfg['emb_dim']} → {cfg['emb_dim']} (GELU)",
         f"ff.layers.0 → {_shape(inner['ff.layers.0'].shape)} → GELU → ff.layers.2 → {_shape(inner['ff.layers.2'].shape)}"
         if "ff.layers.0" in inner else ""),
        ("Dropout + shortcut", ""),
    ]
    h_blk = 40 + sum(50 if detail else 38 for _, detail in rows)
    add(Rect(box_x - 20, y, box_w + 40, h_blk, GRAY_BG, GRAY, width=2))
    add(Text(box_x - 10, y + 18, f"TRANSFORMER BLOCK × {cfg['n_layers']} (trf_blocks) · "
                                 f"{_shape(blk.input_shape)} → {_shape(blk.shape)}", 12, True, MUTED))
    y += 30
    for label, detail in rows:
        height = 42 if detail else 30
        add(Rect(box_x, y, box_w, height, "white"))
        add(Text(box_x + 12, y + 19, label, 12))
        if detail:
            add(Text(box_x + 12, y + 35, detail, 11, color=MUTED, mono=True))
        y += height + 8
    y = top_blk + h_blk
    add(Text(right, top_blk + h_blk / 2 - 8, f"width stays {cfg['emb_dim']}", 12, True, MUTED))
    add(Text(right, top_blk + h_blk / 2 + 10, f"{blk.params:,} params per block", 11, color=MUTED))

    fin = tr.stage("final_norm")
    step("", y, y + 20)
    y += 20
    add(Rect(box_x, y, box_w, 30, "white"))
    add(Text(cx, y + 20, f"Final LayerNorm · final_norm → {_shape(fin.shape)}", 12, anchor="middle"))
    y += 30

    # Output box: hidden -> vocab (or classes), then how the id is picked.
    head, last, probs = tr.stage("out_head"), tr.stage("last_logits"), tr.stage("probs")
    nt = tr.next_token
    is_class = nt["kind"] == "class"
    top = nt["top"][:5]
    step("", y, y + 26)
    y += 26
    top_out = y
    out_box = Rect(box_x - 20, y, box_w + 40, 0, ORANGE_BG, ORANGE, width=2)  # its height is known at the end
    add(out_box)
    add(Text(box_x - 10, y + 18, f"OUTPUT · {head.transition}: {_shape(head.input_shape)} → {_shape(head.shape)}", 12, True, ORANGE))
    y += 28
    add(Rect(box_x, y, box_w, 44, "white", ORANGE, width=2))
    add(Text(cx, y + 19, f"Linear output layer · out_head = {head.module}", 13, True, anchor="middle"))
    add(Text(cx, y + 36, f"x @ W.T → logits {_shape(head.shape)}", 12, color=MUTED, anchor="middle", mono=True))
    head_y = y + 22
    _weight_box(items, right, y - 4, head.weight_shape, "out_head.weight", ORANGE)
    step("", y + 44, y + 58)
    y += 58
    add(Rect(box_x, y, box_w, 30, "white"))
    add(Text(cx, y + 20, f"last position: logits[:, -1, :] → {_shape(last.shape)}", 12, anchor="middle", mono=True))
    step("", y + 30, y + 44)
    y += 44
    add(Rect(box_x, y, box_w, 30, "white"))
    add(Text(cx, y + 20, f"{probs.module} → probabilities {_shape(probs.shape)}", 12, anchor="middle", mono=True))
    y += 50
    V = probs.shape[-1]
    add(Text(box_x, y, f"top {len(top)} of {V:,}: bars from probability 0 to 1; all {V:,} equally likely would be "
                       f"{1 / V:.2g} each", 11, color=MUTED))
    y += 10
    if tr.model["random_weights"]:
        add(Text(box_x, y + 8, "random weights: these probabilities are noise, not predictions", 11, True, RED))
        y += 16
    y += 6
    bar_x, bar_w = box_x + 200, box_w - 290
    add(Line([(bar_x + bar_w, y - 2), (bar_x + bar_w, y + 22 * len(top) - 4)], MUTED, dash=True, arrow=False, width=1))
    for cand in top:
        add(Text(bar_x - 10, y + 12, _clip(repr(cand["text"]), 22), 12, anchor="end", mono=True))
        add(Rect(bar_x, y + 1, max(2.0, bar_w * cand["prob"]), 14, ORANGE, ORANGE, width=0))
        add(Text(bar_x + bar_w + 8, y + 12, f"{cand['prob']:.4f}", 11, color=MUTED, mono=True))
        y += 22
    add(Text(bar_x + bar_w, y + 8, "p = 1", 10, color=MUTED, anchor="middle", mono=True))
    y += 16
    for line in _how_picked(tr):
        add(Text(box_x, y + 12, line, 11, color=INK))
        y += 17
    y += 8
    add(Rect(box_x, y, box_w, 32, "white", ORANGE, width=2))
    what = "class" if is_class else "next id"
    add(Text(cx, y + 21, f"{what} {nt['id']} → {_clip(repr(nt['text']), 30)}", 13, True, anchor="middle"))
    y += 44
    out_box.h = y - top_out

    # The two [V, d] matrices: one tensor or two?
    tie_x = right + 215
    if head.transition == "hidden->classes":
        note, color = "separate tensors", GRAY
    elif tr.params["tied"]:
        note, color = "the same tensor (tied)", GREEN
    else:
        note, color = "two separate tensors (untied)", GRAY
    add(Line([(right + 190, emb_y), (tie_x, emb_y), (tie_x, head_y), (right + 190, head_y)], color, dash=True, arrow=False, width=2))
    add(Text(tie_x + 8, (emb_y + head_y) / 2, note, 12, True, color))
    shapes = (f"both {_shape(emb.weight_shape)}" if emb.weight_shape == head.weight_shape
              else f"{_shape(emb.weight_shape)} and {_shape(head.weight_shape)}")
    add(Text(tie_x + 8, (emb_y + head_y) / 2 + 16, shapes, 11, color=MUTED, mono=True))
    return items, WIDTH, int(y + 30)


def _one_hot_view(items: list, tr: "Trace", x: float, y: float, w: float) -> None:
    """tok_emb as a matmul with one-hot rows, and whether the trace found the same numbers."""
    emb = tr.stage("tok_emb")
    b, t = emb.input_shape
    V, d = emb.weight_shape
    items.append(Rect(x, y, w, 40, "white", BLUE, dash=True))
    items.append(Text(x + w / 2, y + 16, f"the same as a matmul: one_hot {_shape([b, t, V])} @ W {_shape([V, d])} = "
                                         f"{_shape([b, t, d])}", 12, anchor="middle", mono=True))
    check = tr.embedding_check
    if check is None:
        note, color = "(trace with the embedding check to compare it with the lookup)", MUTED
    elif check["equal_one_hot_matmul"]:
        note, color = f"the same numbers as the lookup, checked on this prompt (max |diff| {check['max_abs_diff']:g})", GREEN
    else:
        note, color = f"checked on this prompt: NOT the same (max |diff| {check['max_abs_diff']:g})", RED
    items.append(Text(x + w / 2, y + 33, note, 11, color=color, anchor="middle"))


def _how_picked(tr: "Trace") -> list[str]:
    """How the id is chosen from the probabilities, in the words of the book's chapter 5."""
    nt = tr.next_token
    if nt["kind"] == "class":
        return ["the class is the most probable one: argmax(probs); the classifier reads the last position only"]
    return [f"greedy decoding (as here): next id = argmax(probs) → {nt['id']}",
            "sampling instead draws an id at random with these probabilities",
            f"(temperature {nt['temperature']:g} is already applied; top-k would keep only the k largest)"]


def _weight_box(items: list, x: float, y: float, shape: list[int] | None, name: str, color: str) -> None:
    rows, cols = shape or (0, 0)
    items.append(Rect(x, y, 190, 52, "white", color, width=2))
    items.append(Text(x + 95, y + 20, name, 12, True, color, anchor="middle", mono=True))
    items.append(Text(x + 95, y + 38, f"{_shape(shape)} = {rows * cols:,}", 11, color=MUTED, anchor="middle", mono=True))


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


# XML 1.0 forbids the C0 controls other than tab, newline and return, lone surrogates and
# U+FFFE/U+FFFF; a prompt may hold any of them. They are drawn as Python writes them (\x00,
# \ud800), and so are tab, newline, return and DEL, which would break a line or draw nothing.
_DRAWABLE = {c: repr(chr(c))[1:-1] for c in (*range(0x20), 0x7F, *range(0xD800, 0xE000), 0xFFFE, 0xFFFF)}


def _drawable(text: str) -> str:
    """`text` with every control character, and every character XML forbids, written as its escape."""
    return text.translate(_DRAWABLE)


def to_svg(tr: "Trace") -> str:
    items, w, h = layout(tr)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="Helvetica, Arial, sans-serif">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           f'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="{GRAY}"/></marker></defs>',
           f'<rect width="{w}" height="{h}" fill="white"/>']
    for it in items:
        if isinstance(it, Rect):
            dash = ' stroke-dasharray="5 4"' if it.dash else ""
            out.append(f'<rect x="{it.x:.1f}" y="{it.y:.1f}" width="{it.w:.1f}" height="{it.h:.1f}" rx="6" '
                       f'fill="{it.fill}" stroke="{it.stroke}" stroke-width="{it.width}"{dash}/>')
        elif isinstance(it, Text):
            font = ' font-family="Menlo, Consolas, monospace"' if it.mono else ""
            weight = ' font-weight="bold"' if it.bold else ""
            out.append(f'<text x="{it.x:.1f}" y="{it.y:.1f}" font-size="{it.size}" fill="{it.color}" '
                       f'text-anchor="{it.anchor}"{font}{weight}>{escape(_drawable(it.text))}</text>')
        else:
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in it.points)
            dash = ' stroke-dasharray="6 4"' if it.dash else ""
            marker = ' marker-end="url(#arrow)"' if it.arrow else ""
            out.append(f'<polyline points="{pts}" fill="none" stroke="{it.color}" stroke-width="{it.width}"{dash}{marker}/>')
    out.append("</svg>")
    return "\n".join(out)


def save_png(tr: "Trace", path: str, scale: float = 2.0) -> tuple[int, int]:
    """Draw the same layout with matplotlib; the PNG is (width * scale, height * scale) pixels."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import FancyBboxPatch
    except ImportError:
        raise GlassError("PNG output needs matplotlib: pip install 'glassgpt[plot]' (or use --format svg)") from None
    items, w, h = layout(tr)
    fig = Figure(figsize=(w / 100, h / 100), dpi=100 * scale)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.axis("off")
    px_to_pt = 72 / 100  # the figure is 100 px per inch at scale 1
    for it in items:
        if isinstance(it, Rect):
            ax.add_patch(FancyBboxPatch((it.x, it.y), it.w, it.h, boxstyle="round,pad=0,rounding_size=6",
                                        facecolor=it.fill, edgecolor=it.stroke, linewidth=it.width * px_to_pt,
                                        linestyle="--" if it.dash else "-"))
        elif isinstance(it, Text):
            ax.text(it.x, it.y, _drawable(it.text), fontsize=it.size * px_to_pt, color=it.color,
                    ha={"start": "left", "middle": "center", "end": "right"}[it.anchor], va="baseline",
                    fontweight="bold" if it.bold else "normal", family="monospace" if it.mono else "sans-serif",
                    parse_math=False)  # a prompt with two $ signs is text, not a formula
        else:
            xs, ys = zip(*it.points)
            style = "--" if it.dash else "-"
            if it.arrow:
                ax.annotate("", xy=it.points[-1], xytext=it.points[-2],
                            arrowprops={"arrowstyle": "-|>", "color": it.color, "lw": it.width * px_to_pt, "linestyle": style})
            else:
                ax.plot(xs, ys, color=it.color, linewidth=it.width * px_to_pt, linestyle=style)
    fig.savefig(path, dpi=100 * scale)
    return int(round(w * scale)), int(round(h * scale))


def save_attention_png(tr: "Trace", layer: int, path: str) -> tuple[int, int]:
    """A grid of heatmaps, one per head, of layer `layer`'s attention weights, saved as PNG: (width, height)."""
    fig = attention_figure(tr, layer)
    fig.savefig(path)
    width, height = fig.canvas.get_width_height()
    return width, height


def attention_figure(tr: "Trace", layer: int):
    """The matplotlib Figure of `save_attention_png`: one heatmap per head, one colour bar for all."""
    if tr.attention is None:
        raise GlassError("this trace has no attention weights: trace it with attention=True (--attention)")
    n_layers = len(tr.attention["layers"])
    if not 0 <= layer < n_layers:
        raise GlassError(f"layer {layer} does not exist: choose 0..{n_layers - 1}")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise GlassError("attention heatmaps need matplotlib: pip install 'glassgpt[plot]'") from None
    heads = tr.attention["layers"][layer]
    # Tick labels are parsed as mathtext, so a token's $ is escaped to stay a $.
    labels = [_clip(repr(_drawable(t))[1:-1], 10).replace("$", r"\$") for t in tr.attention["tokens"]]
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
        ax.set_title(f"head {k}", fontsize=9)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        axes.append(ax)
    fig.colorbar(image, ax=axes, label="attention weight (each row sums to 1)", shrink=0.8)
    return fig
