"""The text of explain's Qwen3/Llama results (explain/family.py): a FamilyTrace and what changed from GPT-2."""

from __future__ import annotations

import html

from ..family import FAMILY_NAMES, FamilyTrace, GPT2Changes


def _shape(shape) -> str:
    return "[" + ", ".join(f"{s:,}" for s in shape) + "]"


def render_family_text(tr: FamilyTrace, **_options) -> str:
    cfg, a, att = tr.config, tr.answers, tr.attention
    V, d, h, g = cfg["vocab_size"], cfg["emb_dim"], cfg["n_heads"], cfg["n_kv_groups"]
    name = FAMILY_NAMES[tr.family]
    lines = [f"{name}: {cfg['n_layers']} blocks, d {d:,}, V {V:,}, {h} query heads, {g} key/value groups",
             "tokens: " + " ".join(repr(t) for t in tr.tokens), ""]
    for s in tr.stages:
        lines.append(f"  {s['name']:<18} {_shape(s['shape']):<24} {s['module']:<34} {s['note']}")
    lines += ["", "the four questions"]
    lines.append(f"  1. Where does {V:,} become {d:,}?  At tok_emb: ids -> {_shape(tr.stages[1]['shape'])}, a lookup "
                 f"in the {_shape(a['vocab_to_hidden']['weight_shape'])} weight. Every block then stays {d:,} wide.")
    lines.append(f"  2. Where does {d:,} become {V:,}?  At out_head: -> logits {_shape(tr.stages[-1]['shape'])}, "
                 f"x @ W.T with W {_shape(a['hidden_to_vocab']['weight_shape'])}.")
    e = a["one_hot"]
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
    lines += ["", "where positions enter"]
    scaled = ", with Llama 3's frequency scaling" if att["rope_scaled"] else ""
    lines.append(f"  No pos_emb: tok_emb's output is the same for a token wherever it stands. Inside every attention "
                 f"the queries and keys (not the values) are rotated by RoPE, base {att['rope_base']:,.0f}{scaled}, "
                 "each pair of dimensions (i, i + hd/2) turning by an angle that grows with the position.")
    if att["qk_norm"]:
        lines.append("  QK-norm: each query and key head is RMS-normed before the rotation.")
    lines += ["", "the heads"]
    lines.append(f"  queries {_shape(att['q_shape'])}, keys and values {_shape(att['kv_shape'])}: {h} query heads "
                 f"share {g} key/value heads, {att['group_size']} each (repeat_interleave):")
    lines.append("  " + "  ".join(f"kv{j}: q{grp[0]}..q{grp[-1]}" for j, grp in enumerate(att["groups"])))
    if tr.next_tokens:
        lines += ["", "next token"]
        lines += [f"  {t['text']!r:<16} {t['prob']:.4f}" for t in tr.next_tokens]
    return "\n".join(lines)


def render_changes_text(changes: GPT2Changes, **_options) -> str:
    rows, family = changes.rows, changes.family
    lines = [f"what changed from GPT-2 to {FAMILY_NAMES[family]} (the book's ch05/07_gpt_to_llama order)", ""]
    for r in rows:
        lines.append(f"{r['change']}")
        lines.append(f"  GPT-2   {r['gpt2_params']:>13,}  {r['gpt2']}")
        lines.append(f"  {FAMILY_NAMES[family]:<7} {r['family_params']:>13,}  {r['family']}")
    return "\n".join(lines)


def family_html(result: FamilyTrace | GPT2Changes) -> str:
    """A notebook cell: the text view, as it reads in the terminal (no picture for these families yet)."""
    return f"<pre>{html.escape(result.to_text())}</pre>"
