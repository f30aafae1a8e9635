"""The terminal view of a Trace: a vertical flow from text to the next token.

The two stages where the width changes (vocab->hidden at tok_emb, hidden->vocab at
out_head) are framed and highlighted; the head's logits are shown as the dot products they
are (head.py); the section at the end answers the four questions a reader of the book asks,
with the numbers of the live model. With an attention layer chosen, a table shows, per head,
where each token looks most.

A Trace of a model whose positions are rotated inside the attention (RoPE: Qwen3, Llama 3.2) holds the
rotary flow, written at the end: its stages, the four answers, RoPE and the key/value groups,
then the same panels (the head's dot products, the attention table, the logit lens); and what changed from
GPT-2 (`explain --compare gpt2`).
"""

from __future__ import annotations

from ...formats.book import layout_note
from ...config import GPTConfig
from ..trace import FAMILY_NAMES, GPT2Changes, Stage, Trace
from ..notation import clip, numel, rank, shape as _shape, sizes, token

RESET, BOLD, DIM = "\033[0m", "\033[1m", "\033[2m"
BLUE, ORANGE, GREEN, RED = "\033[38;5;33m", "\033[38;5;208m", "\033[38;5;35m", "\033[38;5;160m"


def painter(color: bool):
    """c(code, text): `text` in an ANSI colour, or as it is."""
    return (lambda code, text: f"{code}{text}{RESET}") if color else (lambda code, text: text)


def render_text(tr: Trace, color: bool = False, attention_layer: int | None = None,
                heatmap: str | None = None) -> str:
    if tr.rotary:  # positions inside the attention: the rotary flow, its four answers, RoPE and the groups
        return render_family_text(tr, attention_layer=attention_layer, heatmap=heatmap)
    c = painter(color)
    lines: list[str] = []
    _header(tr, lines, c)
    _flow(tr, lines, c)
    _next_token(tr, lines, c)
    if tr.head:
        head_lines(tr.head, tr.stage("out_head").weight_shape, tr.stage("probs").shape[-1], lines, c)
    if attention_layer is not None and tr.attention:
        opened = next((s.parent for s in tr.stages if s.parent), "trf_blocks.0")
        attention_lines(tr.attention, attention_layer, heatmap, lines, c,
                        f"--layer {attention_layer} chose this block's attention; --block {opened.split('.')[-1]} "
                        f"chose which block the flow above opens up ({opened}). The two are independent.")
    if tr.logit_lens:
        lens_lines(tr.logit_lens, [t["text"] for t in tr.tokens], lines, c)
    if tr.embedding_check:
        _embedding(tr, lines, c)
    _params(tr, lines, c)
    _answers(tr, lines, c)
    return "\n".join(lines)


def _header(tr: Trace, lines: list[str], c) -> None:
    cfg, m = tr.model["config"], tr.model
    out = lines.append
    out(c(BOLD, f"glassgpt explain · model {m['name']} · {m['dtype']} on {m['device']}"))
    if m["random_weights"]:
        out(c(RED, "RANDOM WEIGHTS: the shapes below are real; the probabilities and tokens are not."))
        if m.get("init"):
            out(c(DIM, f"initialisation: {m['init']}"))
    out(c(DIM, f"vocab_size {cfg['vocab_size']:,} · emb_dim {cfg['emb_dim']:,} · context_length "
               f"{cfg['context_length']:,} · n_heads {cfg['n_heads']} · n_layers {cfg['n_layers']}"
               f" · tie_embeddings {cfg['tie_embeddings']}"))
    for note in m.get("notes", []):  # where a value the file does not hold came from (its Source's notes)
        out(c(DIM, note))
    variant = set(cfg) - set(GPTConfig.__dataclass_fields__)  # chapter 4's variants: their parts are in the notes
    layout = None if variant else layout_note(GPTConfig.from_dict(cfg))  # how it differs from GPT-2, OpenAI's, ...
    out(c(DIM, layout if layout is not None else m["layout"]))
    for note in tr.notes:
        out(c(ORANGE, f"note: {note}"))
    if m.get("trained"):
        out(c(GREEN, f"its training run (as its checkpoint records): {m['trained']['line']}"))
    out("")


def _flow(tr: Trace, lines: list[str], c) -> None:
    out = lines.append
    out(f"text {tr.prompt!r}")
    out("   │")
    for stage in tr.stages:
        if stage.parent is not None:
            continue
        if stage.transition:
            _transition(stage, lines, c)
        elif stage.name == "tokens":
            _row(stage, lines, c)
            pieces = " · ".join(f"{tok['id']} {tok['text']!r}" for tok in tr.tokens)
            out(f"   │   {c(DIM, pieces)}")
        else:
            _row(stage, lines, c)
            if stage.name.startswith("trf_blocks.") and any(s.parent == stage.name for s in tr.stages):
                _block(stage.name, tr, lines, c)
            elif stage.name.startswith("trf_blocks."):
                continue  # consecutive blocks read best as one column, without connectors
        out("   │")
    out("   ▼")


def _next_token(tr: Trace, lines: list[str], c) -> None:
    nt, out = tr.next_token, lines.append
    what = "class" if nt["kind"] == "class" else "next token"
    out(c(BOLD, f"{what}: id {nt['id']} {nt['text']!r}  (p = {nt['prob']:.4f})"))
    if nt["kind"] == "token":
        out(f"text after one step: {nt['text_after']!r}")
    out("")
    out(c(BOLD, f"top {len(nt['top'])} {'classes' if nt['kind'] == 'class' else 'next tokens'}"
                f" (softmax of the logits at temperature {nt['temperature']:g})"))
    for k, cand in enumerate(nt["top"], 1):
        bar = "█" * round(30 * cand["prob"]) or "▏"  # 30 characters is probability 1, so noise stays small
        out(f"  {k:>2}. {cand['text']!r:<18} {cand['id']:>6}  {cand['prob']:.4f}  {c(ORANGE, bar)}")
    V = tr.stage("probs").shape[-1]
    out(c(DIM, f"  (a bar of 30 is probability 1; all {V:,} equally likely would be {1 / V:.2g} each)"))


def head_lines(hd: dict, weight_shape: list[int], n_out: int, lines: list[str], c) -> None:
    """The logits as dot products (head.py's `hd`): h · W[id] (+ bias), |h|, |W[id]|, the cosine; tying; nearest by
    cosine. weight_shape: out_head.weight's; n_out: how many logits (V, or the classes)."""
    out = lines.append
    is_class = hd["kind"] == "classes"
    bias = " + bias[id]" if hd["has_bias"] else ""
    out("")
    out(c(BOLD, f"why this {'class' if is_class else 'token'}: each logit is a dot product, "
                f"logit[id] = h · W[id]{bias}"))
    out(f"  h = final_norm's output at the last position [{weight_shape[-1]}], |h| = {hd['h_norm']:.3f}; "
        f"W = out_head.weight {_shape(weight_shape)}, one row per {'class' if is_class else 'token'}")
    if not is_class:
        out("  " + hd["tying_note"])
    untied = "cos_emb_head" in (hd["rows"][0] if hd["rows"] else {})
    header = f"  {'rank':>4}  {'token' if not is_class else 'class':<18} {'id':>6}  {'logit':>9} = {'h · W[id]':>9}"
    header += (f" + {'bias':>7}" if hd["has_bias"] else "") + f"   {'|W[id]|':>7}  {'cos(h, W[id])':>13}"
    out(c(DIM, header + ("   cos(tok_emb[id], out_head[id])" if untied else "")))
    for k, row in enumerate(hd["rows"], 1):
        line = f"  {k:>4}  {token(row['text']):<18} {row['id']:>6}  {row['logit']:>9.3f} = {row['dot']:>9.3f}"
        line += (f" + {row['bias']:>7.3f}" if hd["has_bias"] else "") + f"   {row['w_norm']:>7.3f}  {row['cos']:>13.4f}"
        out(line + (f"   {row['cos_emb_head']:>+.4f} (|tok_emb[id]| {row['emb_norm']:.3f})" if untied else ""))
    ok = GREEN if hd["max_abs_diff"] <= 1e-3 * max(1.0, abs(hd["rows"][0]["logit"])) else RED
    out("  " + c(ok, f"checked: all {n_out:,} dot products equal out_head's logits (max |diff| {hd['max_abs_diff']:.1e})"))
    nearest = " · ".join(f"{token(t['text'], 14)} {t['cos']:.3f} (logit rank {t['logit_rank']:,})" for t in hd["nearest"])
    out(f"  nearest to h by cosine: {nearest}")
    out(c(DIM, "  (another order than the logits': a logit is |h| · |W[id]| · cos, and |h| is the same for every id, "
               "so a longer row wins the logits with a smaller cosine)"))
    if hd.get("prompt_ranks"):
        ranks = " · ".join(f"{token(t['text'], 14)} {rank(t['rank'])}" for t in hd["prompt_ranks"][:8])
        out(f"  the prompt's own tokens rank: {ranks}")


def _row(stage: Stage, lines: list[str], c) -> None:
    shape = _shape(stage.shape)
    if stage.input_shape and stage.name.startswith("trf_blocks."):
        shape = f"{_shape(stage.input_shape)} -> {shape}"
    weight = f"weight {_shape(stage.weight_shape)}" if stage.weight_shape else ""
    params = f"{stage.params:,} params" if stage.params else ""
    lines.append(f"{c(BOLD, f'{stage.name:<13}')} {shape:<27} {stage.module:<34} {weight:<20} {params}".rstrip())
    if stage.note and not stage.name.startswith("trf_blocks."):
        lines.append(f"   │   {c(DIM, stage.note)}")


def _transition(stage: Stage, lines: list[str], c) -> None:
    tint = BLUE if stage.transition == "vocab->hidden" else ORANGE
    width = 100
    out = "logits " if stage.name == "out_head" else ""
    label = f"══ {stage.transition}: {_shape(stage.input_shape)} -> {out}{_shape(stage.shape)} "
    lines.append(c(tint, "╔" + label + "═" * (width - len(label))))
    body = (f"{stage.name}  {stage.module}  weight {_shape(stage.weight_shape)} = "
            f"{numel(stage.weight_shape):,} numbers")
    bias = stage.params - numel(stage.weight_shape)
    if bias > 0:  # a classifier's head has a bias: count it, as info does
        body += f" + bias [{bias}] = {stage.params:,} parameters"
    lines.append(c(tint, "║ ") + c(BOLD, body))
    lines.append(c(tint, "║ ") + stage.note)
    if stage.shared_with:
        lines.append(c(tint, "║ ") + c(GREEN, f"tied: out_head.weight is {stage.shared_with} "
                                                "(one tensor, counted once in the total)"))
    elif stage.name == "out_head" and stage.transition == "hidden->vocab":
        lines.append(c(tint, "║ ") + "untied: out_head.weight is its own tensor, separate from tok_emb.weight")
    lines.append(c(tint, "╚" + "═" * (width + 1)))


def _block(name: str, tr: Trace, lines: list[str], c) -> None:
    inner = [s for s in tr.stages if s.parent == name]
    for k, s in enumerate(inner):
        branch = "└" if k == len(inner) - 1 else "├"
        short = s.name[len(name) + 1:]
        shape = _shape(s.shape)
        if s.input_shape and s.name.endswith((".heads", ".context")):
            shape = f"{_shape(s.input_shape)} -> {shape}"
        params = f"{s.params:,}" if s.params else ""
        lines.append(f"   {branch} {short:<18} {shape:<31} {s.module:<42} {params:>10}  {c(DIM, s.note)}".rstrip())


def lens_lines(lens: dict, tokens: list[str], lines: list[str], c) -> None:
    """The logit lens (trace.py's logit_lens_of): after each block, the top token at each position."""
    lines.append("")
    lines.append(c(BOLD, "logit lens: the top token at each position after each block, and its probability "
                         "(softmax(out_head(final_norm(residual))))"))
    header = " ".join(f"{tok[:10]!r:<20}" for tok in tokens)
    lines.append(f"  {'after':<14} {header}")
    for layer in lens["layers"]:
        cells = " ".join(f"{_lens_cell(cell):<20}" for cell in layer["top"])
        lines.append(f"  trf_blocks.{layer['layer']:<3} {cells}")


def _lens_cell(cell: dict) -> str:
    """' know' 20.2%: two significant digits below 1%, as the page writes them."""
    p = cell["prob"]
    prob = f"{100 * p:.1f}%" if p >= 0.1 else f"{100 * p:.2f}%" if p >= 0.01 else f"{100 * p:.2g}%"
    return f"{cell['text'][:10]!r} {prob}"


def attention_lines(att: dict, layer: int, heatmap: str | None, lines: list[str], c, note: str,
                    max_tokens: int = 12) -> None:
    """Per head of one layer: the earlier token that each token attends to most, and its weight. `att`: a trace's
    attention weights (tokens, layers; a Qwen3/Llama model's also `groups`, each query head's key/value group)."""
    heads, tokens, groups = att["layers"][layer], att["tokens"], att.get("groups")
    shown = range(min(len(tokens), max_tokens))
    cell = lambda text: f"{text:<15}"  # noqa: E731
    lines.append("")
    lines.append(c(BOLD, f"attention in trf_blocks.{layer}: for each head, the token that each token attends to most"))
    lines.append(c(DIM, f"  {note}"))
    lines.append(("  " + cell("query token") + "".join(cell(clip(repr(tokens[j]), 14)) for j in shown)).rstrip())
    for h, weights in enumerate(heads):
        cells = []
        for j in shown:
            row = weights[j][: j + 1]  # token j sees tokens 0..j
            k = max(range(j + 1), key=row.__getitem__)
            cells.append(cell(f"{clip(repr(tokens[k]), 9)} {row[k]:.2f}"))
        name = f"head {h}" if groups is None else f"head {h} kv{groups[h]}"
        lines.append(("  " + cell(name) + "".join(cells)).rstrip())
    if len(tokens) > max_tokens:
        lines.append(c(DIM, f"  (the first {max_tokens} of {len(tokens)} tokens; the heatmap has them all)"))
    if heatmap:
        lines.append(f"  heatmap of every head, with a colour bar: {heatmap}")


def embedding_section(tr: Trace) -> str:
    """Only the one-hot proof (`explain --embedding-vs-linear`)."""
    lines: list[str] = []
    _embedding(tr, lines, painter(False))
    return "\n".join(lines).strip("\n")


def _embedding(tr: Trace, lines: list[str], c) -> None:
    e = tr.embedding_check
    V, d = e["weight_shape"]
    ok = lambda flag: c(GREEN, "exactly equal") if flag else c(RED, "NOT equal")  # noqa: E731
    lines.append("")
    lines.append(c(BOLD, "nn.Embedding = nn.Linear on one-hot vectors (checked on this model and prompt)"))
    lines.append(f"  tok_emb(ids) vs one_hot(ids, {V}) @ tok_emb.weight        : {ok(e['equal_one_hot_matmul'])}"
                 f" (max |diff| {e['max_abs_diff']:g})")
    lines.append(f"  tok_emb(ids) vs {e['linear']}: {ok(e['equal_linear'])}")
    timed = "lookup_ms" in e
    lines.append(f"  lookup : " + (f"{e['lookup_ms']:.3f} ms, " if timed else "")
                 + f"reads {e['lookup_bytes']:,} bytes (one row per token)")
    lines.append(f"  matmul : " + (f"{e['matmul_ms']:.3f} ms, " if timed else "")
                 + f"builds a {e['one_hot_bytes']:,}-byte one-hot matrix and does "
                 f"{e['matmul_flops']:,} FLOPs, all but 1 in {V:,} of them multiplying by zero")
    lines.append(c(DIM, "  same numbers, so the lookup is used: it skips the zeros."))


def _params(tr: Trace, lines: list[str], c) -> None:
    p = tr.params
    lines.append("")
    lines.append(c(BOLD, "parameters"))
    lines.append(f"  total as stored      {p['total']:>15,}" + ("   (out_head.weight is tok_emb.weight)" if p["tied"] else ""))
    lines.append(f"  total if untied      {p['total_untied']:>15,}")
    if p.get("note"):
        lines.append(c(DIM, f"  {p['note']}"))


def _answers(tr: Trace, lines: list[str], c) -> None:
    emb, head = tr.stage("tok_emb"), tr.stage("out_head")
    cfg = tr.model["config"]
    V, d = cfg["vocab_size"], cfg["emb_dim"]
    out_w = head.shape[-1]
    lines.append("")
    lines.append(c(BOLD, "the four questions"))
    lines.append(f"  1. Where does {V:,} become {d}?  At tok_emb: ids {_shape(emb.input_shape)} -> "
                 f"{_shape(emb.shape)}, a lookup in the {_shape(emb.weight_shape)} weight. Every block then stays {d} wide.")
    last = _shape(tr.stage("last_logits").shape)
    gives = (f"the last position's logits {last} give the class (argmax)" if head.transition == "hidden->classes"
             else f"the last position's logits {last} give the next token")
    lines.append(f"  2. Where does {d} become {out_w:,}?  At out_head: {_shape(head.input_shape)} -> logits "
                 f"{_shape(head.shape)}, x @ W.T with W {_shape(head.weight_shape)}; {gives}.")
    e = tr.embedding_check
    same = "yes: the numbers above are identical" if e and e["equal_one_hot_matmul"] and e["equal_linear"] else \
        "yes, mathematically (run with the embedding check to see it on this model)"
    lines.append(f"  3. Is nn.Embedding an nn.Linear on one-hot vectors?  {same}; the lookup just skips the zeros.")
    if head.transition == "hidden->classes":
        tied = f"no sharing: the classifier head has its own {_shape(head.weight_shape)} weight"
    elif tr.params["tied"]:
        tied = (f"yes, both are {_shape(emb.weight_shape)}, and here they are one tensor (tied): "
                f"{tr.params['total']:,} parameters, {tr.params['total_untied']:,} if untied")
    else:
        tied = (f"yes, both are {_shape(emb.weight_shape)}, and here they are two separate tensors (untied): "
                f"{tr.params['total']:,} parameters")
    lines.append(f"  4. Are there weight matrices for both, and are they shared?  {tied}.")


# --- a model whose positions are rotated inside the attention (RoPE: Qwen3, Llama 3.2) ---------------

def render_family_text(tr: Trace, attention_layer: int | None = None, heatmap: str | None = None,
                       **_options) -> str:
    """The flow, the four answers, RoPE and the groups, the next tokens; then, as GPT-2's text view has them,
    the head's dot products, `attention_layer`'s heads (if the trace has the weights) and the logit lens."""
    cfg, a, att = tr.config, tr.answers, tr.attention
    V, d, h, g = cfg["vocab_size"], cfg["emb_dim"], cfg["n_heads"], len(att["groups"])
    name = FAMILY_NAMES[tr.family]
    lines = [f"{name}: {cfg['n_layers']} blocks, d {d:,}, V {V:,}, {h} query heads, {g} key/value groups"]
    about = tr.about
    if about.get("name", "custom") != "custom":
        lines.append(f"model {about['name']}")
    if about.get("random_weights"):
        lines.append("RANDOM WEIGHTS: the shapes below are real; the probabilities and tokens are not.")
    lines += [f"  {note}" for note in about.get("notes", [])]
    if tr.block:
        lines.append(_opened_line(tr.block, att))
    lines += ["tokens: " + " ".join(repr(t["text"]) for t in tr.tokens), ""]
    for s in tr.stages:
        lines.append(f"  {s.name:<18} {sizes(s.shape):<24} {s.module:<34} {s.note}")
    lines += ["", "the four questions"]
    lines.append(f"  1. Where does {V:,} become {d:,}?  At tok_emb: ids -> {sizes(tr.stages[1].shape)}, a lookup "
                 f"in the {sizes(a['vocab_to_hidden']['weight_shape'])} weight. Every block then stays {d:,} wide.")
    lines.append(f"  2. Where does {d:,} become {V:,}?  At out_head: -> logits {sizes(tr.stages[-1].shape)}, "
                 f"x @ W.T with W {sizes(a['hidden_to_vocab']['weight_shape'])}.")
    e = a["one_hot"]
    if e is None:
        proof = "not checked on this prompt (embedding_check is off)"
    else:
        proof = "yes: the lookup and one_hot(ids) @ W are identical here" if e["equal_one_hot_matmul"] and \
            e["equal_linear"] else f"not bit for bit here (max difference {e['max_abs_diff']:.3g})"
    lines.append(f"  3. Is nn.Embedding an nn.Linear on one-hot vectors?  {proof}; the lookup skips the zeros.")
    if a["tied"]:
        tie = (f"one tensor: out_head.weight and tok_emb.weight share their storage (the same data_ptr), "
               f"{tr.params['total']:,} parameters, {tr.params['total_untied']:,} if untied")
    elif a["equal_values"]:
        tie = ("two tensors with equal values: a copy, not a tie (different data_ptr; the book's loader copies "
               "the embedding), so training would move them apart")
    else:
        tie = f"two separate tensors (untied): {tr.params['total']:,} parameters"
    lines.append(f"  4. Are there weight matrices for both, and are they shared?  {tie}.")
    position_lines(tr, lines)
    lines += ["", "the heads"]
    lines.append(f"  queries {sizes(att['q_shape'])}, keys and values {sizes(att['kv_shape'])}: {h} query heads "
                 f"share {g} key/value heads, {att['group_size']} each (repeat_interleave):")
    lines.append("  " + "  ".join(f"kv{j}: q{grp[0]}..q{grp[-1]}" for j, grp in enumerate(att["groups"])))
    if tr.experts:
        experts_lines(tr.experts, lines)
    if tr.next_tokens:
        lines += ["", "next token" + (f" (softmax(last_logits / {tr.temperature:g}))" if tr.temperature != 1 else "")]
        lines += [f"  {t['text']!r:<16} {t['prob']:.4f}" for t in tr.next_tokens]
    c = painter(False)
    if tr.head:
        head_lines(tr.head, a["hidden_to_vocab"]["weight_shape"], V, lines, c)
    if attention_layer is not None and tr.attention_weights:
        attention_lines(tr.attention_weights, attention_layer, heatmap, lines, c,
                        "kvN: the key/value group the query head reads (repeat_interleave); " + _rotated_note(att))
    if tr.logit_lens:
        lens_lines(tr.logit_lens, [t["text"] for t in tr.tokens], lines, c)
    return "\n".join(lines)


def _opened_line(block: int, att: dict) -> str:
    """The block `--block` opened: every block alike, or this one's own kind (sliding or full, with or without RoPE;
    a linear block's table shows the first block with keys and values)."""
    said = f"the shapes below are read in trf_blocks.{block} (--block {block})"
    if att.get("blocks_alike", True):
        return said + "; every block's are the same"
    opened = att["opened"]
    if opened["kind"] == "linear":
        return (said + f", a linear-attention block (no keys or values: the rows of keys and values are "
                f"trf_blocks.{opened['keyed_block']}'s); the blocks are not all alike")
    kind = (f"a sliding-window attention ({opened['window']:,} positions)" if opened["kind"] == "sliding"
            else "a full attention") + (", with RoPE" if opened["rope"] else ", without RoPE")
    return said + f", {kind}; the blocks are not all alike"


def _rotated_note(att: dict) -> str:
    """What was done to the queries and keys before the softmax, from the description: QK-norm where the model has
    it, RoPE in the layers it turns (Tiny Aya's full layers: none)."""
    normed = "QK-normed, then " if att["qk_norm"] else ""
    bare = att.get("unrotated_layers")
    return (f"its queries and keys were {normed}RoPE-rotated before the softmax"
            + (f" (not in layer{'s' if len(bare) > 1 else ''} {', '.join(map(str, bare))}, which RoPE does not turn)"
               if bare else ""))


def experts_lines(ex: dict, lines: list[str]) -> None:
    """A mixture's routing in the opened block: each token's top-k experts and their weights."""
    lines += ["", f"the experts ({ex['module']}: each token's top {ex['per_token']} of {ex['n_experts']}, "
                  "weighted by the softmax of their router scores)"]
    lines += [f"  {t['text']!r:<16} " + " + ".join(f"{w:.3f} * expert {e}" for e, w in zip(t["experts"], t["weights"]))
              for t in ex["tokens"]]


def position_lines(tr: Trace, lines: list[str]) -> None:
    """Where positions enter a rotary model: no pos_emb, RoPE's base and reach, the sliding layers, QK-norm."""
    att = tr.attention
    lines += ["", "where positions enter"]
    scaled = _scaling_words(att)
    layers, dims, hd = att.get("rope_layers"), att.get("rope_dims"), att["q_shape"][-1]
    inside = "every attention" if layers is None or len(layers) == tr.config["n_layers"] else _rotated_layers(att)
    pairs = "each pair of dimensions (i, i + hd/2)" if not dims or dims == hd else (
        f"each pair (i, i + {dims // 2}) of the first {dims} of {hd} dimensions (the other {hd - dims} unturned)")
    lines.append(f"  No pos_emb: tok_emb's output is the same for a token wherever it stands. Inside {inside} "
                 f"the queries and keys (not the values) are rotated by RoPE, base {att['rope_base']:,.0f}{scaled}, "
                 f"{pairs} turning by an angle that grows with the position.")
    if att.get("sliding_layers"):  # Gemma 3: the base above is the full layers'
        lines.append(f"  Sliding layers {att['sliding_layers']}: each query sees only the last {att['window']:,} "
                     f"positions, and RoPE turns them with base {att['rope_local_base']:,.0f}; the other layers see "
                     "every earlier position.")
    if att["qk_norm"] and att.get("qk_norm_per_head", True):
        lines.append("  QK-norm: each query and key head is RMS-normed before the rotation.")
    elif att["qk_norm"]:  # OLMo 3: one norm over all heads of a token
        q_dim, k_dim = att["qk_norm_dims"]
        lines.append(f"  QK-norm: the whole query projection ({q_dim:,} wide) and the whole key projection "
                     f"({k_dim:,} wide) are each RMS-normed at once, across all heads, before the split into heads "
                     "and the rotation.")
    if att.get("kv_shared_from"):  # Gemma 4's last layers
        lines.append("  KV-shared layers: " + ", ".join(f"{i} reads {j}'s" for i, j in att["kv_shared_from"].items())
                     + " keys and values (they compute none and keep no cache of their own).")


def _rotated_layers(att: dict) -> str:
    """The layers RoPE turns and what the others see, from the description: Qwen3.5's full attentions (its linear
    ones see the order through their state), Tiny Aya's sliding ones (its full ones have no position signal)."""
    listed = lambda layers: ", ".join(map(str, layers))  # noqa: E731
    kind = {"sliding": "the sliding attentions", "full": "the full attentions"}.get(att.get("rope_layer_kind"),
                                                                                     "the attentions")
    others = []
    if att.get("linear_layers"):
        others.append("the linear ones have no position signal: their convolution and state see the order itself")
    if att.get("unrotated_layers"):
        bare = att["unrotated_layers"]
        named = f"layer{'s' if len(bare) > 1 else ''} {listed(bare)}"
        which = f"the full ones, {named}," if att.get("rope_layer_kind") == "sliding" else named
        verb = "have" if len(bare) > 1 or which.startswith("the") else "has"
        others.append(f"{which} {verb} no position signal: no RoPE turns their queries and keys, and only the "
                      "causal mask orders what they see")
    return f"{kind} (layers {listed(att['rope_layers'])}" + ("; " + "; ".join(others) if others else "") + ")"


def _scaling_words(att: dict) -> str:
    """How RoPE's frequencies are changed, by name: Llama 3's scaling, OLMo 3's YaRN, Gemma 4's proportional RoPE."""
    if not att.get("rope_scalings") or att["rope_scalings"] == ["llama3"]:
        return ", with Llama 3's frequency scaling" if att["rope_scaled"] else ""
    turned = att.get("proportional_dims")
    return ", with " + " and ".join(
        f"proportional partial RoPE in the full layers ({turned[0]} of their {turned[1]} dimensions turn: the "
        f"pairs (i, i + {turned[1] // 2}) for i < {turned[0] // 2}, the others stay as they are)"
        if name == "proportional" else {"yarn": "YaRN", "llama3": "Llama 3's"}.get(name, name) + " frequency scaling"
        for name in att["rope_scalings"])


def render_changes_text(changes: GPT2Changes, **_options) -> str:
    rows, family = changes.rows, changes.family
    lines = [f"what changed from GPT-2 to {FAMILY_NAMES[family]} (the book's ch05/07_gpt_to_llama order)", ""]
    for r in rows:
        lines.append(f"{r['change']}")
        lines.append(f"  GPT-2   {r['gpt2_params']:>13,}  {r['gpt2']}")
        lines.append(f"  {FAMILY_NAMES[family]:<7} {r['family_params']:>13,}  {r['family']}")
    return "\n".join(lines)
