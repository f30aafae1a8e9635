"""Issue 49 point 1 for the described models' whole-model stages: where no catalogue entry reproduces the first
stage that differs, check names the property of the description's formula that the stage breaks, measured on the
reader's own module run again through its own call (the mask, cos and sin its model handed it):

  attention     nothing read from a later position; nothing outside a sliding layer's window; every earlier
                position read in a full layer; weights summing to 1; the scale (fitted); RoPE (a score depends on
                i - j alone), or no position signal where the description gives none (Tiny Aya's full layers)
  shortcut      present around the attention and the feed-forward (the two factors fitted)
  a post-norm   (post and sandwich blocks) reads the sublayer's output, not the stream after the add
  feed-forward  the activation between its layers, on its own hidden numbers

Each case plants one line into the book's Qwen3 or Llama 3.2 (llms_from_scratch), glassgpt's Gemma 3, OLMo 3, Tiny
Aya, Gemma 4 and Qwen3.5 (its linear attention: nothing read later), or transformers' Qwen3 and OLMo 3, and asserts the stage, the position and the property; OUTSIDE_CATALOGUE marks the ones no catalogue entry
of verify.py reproduces (result.mistake is None). A clean model of every described kind keeps every property.

Tolerances: a position "changes" beyond 1e-5 of the output's largest value (pieces/stages.py CHANGES); two scores
are the same within 1e-4 of the largest (SAME_SCORE); the scale is fitted within 1e-4; the activation within 1e-5.
"""

from __future__ import annotations

import math
from types import MethodType

import pytest
import torch
from torch import nn

import glassgpt
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt.explain.pieces import LLAMA3_TINY, QWEN3_TINY
from helpers import DESCRIBED, tiny_described as tiny, tiny_gemma4, tiny_transformers

TEXT = "Every effort moves you"  # 22 ids (its bytes): past every window of 4


def book(cls, cfg):
    torch.manual_seed(123)
    return cls(cfg).eval()


def each(modules, forward):
    for m in modules:
        m.forward = MethodType(forward, m)


# --- the planted lines --------------------------------------------------------------------------------------

def qwen3_mask_one_late(model):
    """Qwen3Model.forward's mask made with diagonal=2: each token also sees the next one."""
    def forward(self, in_idx):
        x = self.tok_emb(in_idx)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=2)  # planted: diagonal=1
        for block in self.trf_blocks:
            x = block(x, mask, self.cos, self.sin)
        return self.out_head(self.final_norm(x))
    model.forward = MethodType(forward, model)
    return model


def gqa_forward(scale=None, rope_keys=True, plus_one=False):
    """The book's GroupedQueryAttention.forward with one line changed (its default: the book's own)."""
    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if getattr(self, "q_norm", None):
            q, k = self.q_norm(q), self.k_norm(k)
        q = book_qwen.apply_rope(q, cos, sin)
        k = book_qwen.apply_rope(k, cos, sin) if rope_keys else k  # planted (rope_keys=False): keys not turned
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        scores = (q @ k.transpose(2, 3)).masked_fill(mask[:t, :t], -torch.inf)
        scores = scores / (scale(self) if scale else self.head_dim ** 0.5)  # planted (scale): another root
        if plus_one:  # planted: softmax with a 1 added to its denominator, so no row sums to 1
            e = torch.exp(scores - scores.amax(-1, keepdim=True))
            weights = e / (e.sum(-1, keepdim=True) + torch.exp(-scores.amax(-1, keepdim=True)))
        else:
            weights = torch.softmax(scores, dim=-1)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, self.d_out))
    return forward


def book_attention(model, **planted):
    each([blk.att for blk in model.trf_blocks], gqa_forward(**planted))
    return model


def llama_no_ff_shortcut(model):
    def forward(self, x, mask, cos, sin):
        x = self.att(self.norm1(x), mask, cos, sin) + x
        return self.ff(self.norm2(x))  # planted: + x left out
    each(model.trf_blocks, forward)
    return model


def llama_gelu(model):
    def forward(self, x):
        return self.fc3(nn.functional.gelu(self.fc1(x)) * self.fc2(x))  # planted: silu
    each([blk.ff for blk in model.trf_blocks], forward)
    return model


def gemma3_attention(model, scaling=None, window_edge=None):
    """Gemma 3's attention weights with its scale or its window's edge changed."""
    def weights(self, q, k):
        t, s = q.shape[-2], k.shape[-2]
        scores = (q * (scaling(self) if scaling else self.scaling)) @ k.transpose(-2, -1)
        query, key = torch.arange(t)[:, None], torch.arange(s)[None, :]
        hidden = key > query
        if self.window is not None:
            hidden |= (query - key > self.window) if window_edge else (query - key >= self.window)
        return torch.softmax(scores.masked_fill(hidden, -torch.inf), dim=-1)
    for blk in model.blocks:
        blk.att.attention_weights = MethodType(weights, blk.att)
    return model


def gemma3_exact_gelu(model):
    def forward(self, x):
        return self.fc3(nn.functional.gelu(self.fc1(x)) * self.fc2(x))  # planted: approximate="tanh" left out
    each([blk.ff for blk in model.blocks], forward)
    return model


def olmo3_norm_after_add(model):
    """OLMo 3's block written as the original Transformer's post-LN: norm(x + att(x))."""
    def forward(self, x, cos, sin, cache=None):
        x = self.post_attention_layernorm(x + self.att(x, cos, sin, cache))  # planted: x + norm(att(x))
        return x + self.post_feedforward_layernorm(self.ff(x))
    each(model.blocks, forward)
    return model


def gemma3_post_norm_after_add(model):
    """Gemma 3's sandwich block with its attention's post-norm taken after the add: post(x + att(pre(x)))."""
    def forward(self, x, cos, sin, cache=None):
        x = self.post_attention_layernorm(x + self.att(self.input_layernorm(x), cos, sin, cache))  # planted
        return x + self.post_feedforward_layernorm(self.ff(self.pre_feedforward_layernorm(x)))
    each(model.blocks, forward)
    return model


def qwen35_conv_centred(model):
    """Qwen3.5's short convolution centred on its token (padded on both sides), so it taps two later tokens."""
    def causal_conv(self, x, before):
        width = self.conv_kernel_size - 1
        padded = nn.functional.pad(x, (1, width - 1))  # planted: (width, 0), every tap on this or earlier tokens
        out = nn.functional.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)
        return nn.functional.silu(out), padded[:, :, -width:]
    for blk in model.trf_blocks:
        if hasattr(blk.token_mixer, "causal_conv"):
            blk.token_mixer.causal_conv = MethodType(causal_conv, blk.token_mixer)
    return model


def olmo3_full_layers_windowed(model):
    for blk in model.blocks:
        blk.att.sliding_window = 4  # planted: the window on every layer, the full ones too
    return model


def tiny_aya_rope_everywhere(model):
    from glassgpt.families import tiny_aya
    from glassgpt.families.sliding import attention_weights

    def forward(self, x, cos, sin, cache=None):
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        q, k = tiny_aya.apply_rope(q, cos, sin), tiny_aya.apply_rope(k, cos, sin)  # planted: in the full layers too
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        weights = attention_weights(q, k, self.sliding_window)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, self.d_out))
    each([blk.att for blk in model.trf_blocks], forward)
    return model


def llama_tables_reversed(model):
    """Llama3Model.forward handing every block the RoPE tables' rows in reverse: the last position's angles first."""
    def forward(self, in_idx):
        x = self.tok_emb(in_idx)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        for block in self.trf_blocks:
            x = block(x, mask, self.cos.flip(0), self.sin.flip(0))  # planted: .flip(0)
        return self.out_head(self.final_norm(x))
    model.forward = MethodType(forward, model)
    return model


def qwen3_tables_base(model, base):
    """Qwen3Model's RoPE tables computed with another theta_base than the config's rope_base."""
    model.cos, model.sin = book_qwen.compute_rope_params(16, base, 24)  # planted: theta_base=cfg["rope_base"]
    return model


def tiny_aya_no_shortcut(model):
    def forward(self, x, cos, sin, cache=None):
        normed = self.input_layernorm(x)
        return self.att(normed, cos, sin, cache) + self.ff(normed)  # planted: x + left out
    each(model.trf_blocks, forward)
    return model


def gemma4_window_one_wider(model):
    for blk in model.blocks:
        blk.att.window = blk.att.window and blk.att.window + 1  # planted: sliding_window + 1 in the sliding layers
    return model


QWEN3, LLAMA = (book_qwen.Qwen3Model, QWEN3_TINY), (book_llama.Llama3Model, LLAMA3_TINY)

PLANTED = {  # id: (the model, the first stage, where, the property, words the finding holds)
    "qwen3_mask_made_one_late": (lambda: qwen3_mask_one_late(book(*QWEN3)), "trf_blocks.0.att", "position 0",
                                 "no_future", "position 0's output changes when the input at position 1, a later "
                                 "one, changes: it reads a later position; the mask handed to it from outside (its argument `mask`"),
    "qwen3_keys_not_turned": (lambda: book_attention(book(*QWEN3), rope_keys=False), "trf_blocks.0.att",
                              "position 1", "rope_positions", "with RoPE a score depends only on how far apart"),
    "qwen3_rows_do_not_sum_to_1": (lambda: book_attention(book(*QWEN3), plus_one=True), "trf_blocks.0.att",
                                   "row 0 of head 0", "rows_sum_to_1", "row 0 of head 0's attention weights sum to "
                                   "0.7669, not 1"),
    "llama_scaled_by_emb_dim": (lambda: book_attention(book(*LLAMA), scale=lambda att: att.d_out ** 0.5),
                                "trf_blocks.0.att", "position 0", "scale",
                                "times 1/sqrt(emb_dim) = 1/sqrt(32) (q k^T from the description"),
    "llama_rope_tables_reversed": (lambda: llama_tables_reversed(book(*LLAMA)), "trf_blocks.0.att", "position 1",
                                   "rope_positions", "the queries and keys are turned by their positions in reverse "
                                   "order (the last position's angles first); the tables handed to it from outside (its "
                                   "arguments `cos` and `sin`"),
    "qwen3_tables_of_another_base": (lambda: qwen3_tables_base(book(*QWEN3), 12_345.0), "trf_blocks.0.att",
                                     "position 1", "rope_positions", "the angles they are turned by are not the "
                                     "description's (position p turns pair k by p * 1e+06^(-2k/16)); the tables "
                                     "handed to it"),
    "tiny_aya_parallel_shortcut_missing": (lambda: tiny_aya_no_shortcut(tiny("tiny-aya")), "trf_blocks.0.shortcut",
                                           "position 0", "shortcut", "the shortcut around the attention and the "
                                           "feed-forward is missing"),
    "llama_no_ff_shortcut": (lambda: llama_no_ff_shortcut(book(*LLAMA)), "trf_blocks.0.shortcut2", "position 0",
                             "shortcut", "the shortcut around the feed-forward is missing"),
    "llama_gelu_for_silu": (lambda: llama_gelu(book(*LLAMA)), "trf_blocks.0.ff", "position 0", "activation",
                            "it is the exact GELU (erf, nn.GELU())"),
    "gemma3_scaled_by_head_dim": (lambda: gemma3_attention(tiny("gemma3"), scaling=lambda att: att.head_dim ** -0.5),
                                  "blocks.0.att", "position 0", "scale",
                                  "times 1/sqrt(head_dim) = 1/sqrt(8) (q k^T"),
    "gemma3_window_one_wider": (lambda: gemma3_attention(tiny("gemma3"), window_edge=True), "blocks.0.att",
                                "position 4", "window", "the input at position 0, 4 back, changes: this sliding layer "
                                "reads outside its window of 4"),
    "gemma4_window_one_wider": (lambda: gemma4_window_one_wider(tiny_gemma4()), "blocks.0.att", "position 4",
                                "window", "the input at position 0, 4 back, changes: this sliding layer reads outside "
                                "its window of 4"),
    "gemma3_exact_gelu": (lambda: gemma3_exact_gelu(tiny("gemma3")), "blocks.0.ff", "position 0", "activation",
                          "the description's feed-forward is fc3(act(fc1(x)) * fc2(x)) with act = GELU (the tanh form)"),
    "olmo3_norm_after_the_add": (lambda: olmo3_norm_after_add(tiny("olmo3")), "blocks.0.post_attention_layernorm "
                                 "(input)", "position 0", "placement", "post_attention_layernorm reads x + att(x), "
                                 "the stream after the shortcut"),
    "gemma3_post_norm_after_the_add": (lambda: gemma3_post_norm_after_add(tiny("gemma3")),
                                       "blocks.0.post_attention_layernorm (input)", "position 0", "placement",
                                       "this sandwich-norm block norms att's output before adding it"),
    "qwen35_linear_attention_conv_centred": (lambda: qwen35_conv_centred(tiny("qwen3.5")), "trf_blocks.0.token_mixer",
                                             "position 0", "no_future", "position 0's output changes when the input "
                                             "at position 1, a later one, changes: it reads a later position: a "
                                             "linear attention reads each token's own and earlier inputs only"),
    "olmo3_full_layer_windowed": (lambda: olmo3_full_layers_windowed(tiny("olmo3")), "blocks.2.att", "position 4",
                                  "reads_its_past", "this full layer hides an earlier position"),
    "tiny_aya_rope_on_a_full_layer": (lambda: tiny_aya_rope_everywhere(tiny("tiny-aya")), "trf_blocks.2.att",
                                      "position 1", "position_signal", "where the description gives it no positions"),
}


def transformers_scaled_by_emb_dim(name: str, attn: str):
    model = tiny_transformers(name, attn)
    for layer in model.model.layers:
        layer.self_attn.scaling = model.config.hidden_size ** -0.5  # planted: the whole width's root
    return model


PLANTED |= {  # transformers' own modules: the scores captured from its softmax (eager) or its sdpa call's q, k, scale
    f"transformers_{name}_{attn}_scaled_by_emb_dim": (
        lambda name=name, attn=attn: transformers_scaled_by_emb_dim(name, attn), "model.layers.0.self_attn",
        "position 0", "scale", "times 1/sqrt(emb_dim) = 1/sqrt(32) (q k^T from the description")
    for name, attn in (("qwen3", "sdpa"), ("olmo3", "eager"))}
OUTSIDE_CATALOGUE = set(PLANTED)  # every case here: no DESCRIBED_MISTAKES entry reproduces it


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_described_models_unlisted_mistake_is_named_by_its_stage_position_and_property(case):
    build, stage, where, prop, words = PLANTED[case]
    result = glassgpt.check(build(), TEXT)
    assert not result.ok, result.to_text()
    assert (result.first.name, result.prop_where, result.prop) == (stage, where, prop), result.to_text()
    assert words in result.finding and "no known mistake" not in result.finding, result.finding
    assert case in OUTSIDE_CATALOGUE and result.mistake is None, result.to_text()
    assert all(s.ok for s in result.stages[:result.stages.index(result.first)])


def test_the_mask_is_named_only_where_the_right_mask_in_its_place_fixes_the_position():
    """The same reading of a later position, made inside the attention (its own triu(diagonal=2)), with the model's
    mask right: the finding names no handed-in mask."""
    def forward(self, x, mask, cos, sin):
        return gqa_forward()(self, x, torch.ones_like(mask).triu(2), cos, sin)  # planted: the module's own mask
    model = book(*QWEN3)
    each([blk.att for blk in model.trf_blocks], forward)
    result = glassgpt.check(model, TEXT)
    assert (result.first.name, result.prop, result.prop_where) == ("trf_blocks.0.att", "no_future", "position 0")
    assert "handed to it from outside" not in result.finding and "torch.triu(..., diagonal=1)" in result.finding


def test_the_docs_described_property_example_is_what_check_finds():
    """docs/check.md's example (the book's Qwen3, its mask made with diagonal=2): its code run, its finding printed."""
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text(encoding="utf-8")
    code = next(b.split("\n```")[0] for b in docs.split("```python\n")[1:] if "class MyQwen3" in b)
    space: dict = {}
    exec(compile(code, "check.md", "exec"), space)  # noqa: S102 - our own docs' example
    result = glassgpt.check(space["model"], TEXT)
    assert (result.prop, result.prop_where) == ("no_future", "position 0")
    assert f"\n{result.finding}\n```" in docs, result.finding
    assert result.kind == "MyQwen3 (Qwen3)" and "glassgpt check: MyQwen3 (Qwen3)" in docs


def test_values_scaled_alike_everywhere_are_a_factor_not_a_row_sum():
    """Every row's context twice the formula's (W_value's output doubled): one factor everywhere, so no row's sum is
    claimed; the stage's factor is named instead."""
    model = book(*QWEN3)
    for blk in model.trf_blocks:
        blk.att.W_value.register_forward_hook(lambda mod, args, out: out * 2)  # planted: the values doubled
    result = glassgpt.check(model, TEXT)
    assert (result.first.name, result.prop, result.mistake) == ("trf_blocks.0.att", "factor", None), result.to_text()
    assert "trf_blocks.0.att's output is 2 times the formula's at every position" in result.finding


def test_the_cases_cover_each_new_property_and_four_described_kinds():
    props = {case[3] for case in PLANTED.values()}
    assert {"no_future", "window", "reads_its_past", "rows_sum_to_1", "scale", "rope_positions", "position_signal",
            "shortcut", "placement", "activation"} <= props
    assert len(PLANTED) >= 8
    kinds = {case.split("_")[0] for case in PLANTED}
    assert {"qwen3", "llama", "gemma3"} <= kinds and kinds & {"olmo3", "tiny"}


# --- no false findings: a correct model keeps every property ------------------------------------------------

CLEAN = {"qwen3": lambda: book(*QWEN3), "llama3.2": lambda: book(*LLAMA)} | {
    name: (lambda name=name: tiny(name)) for name in DESCRIBED} | {"gemma4": tiny_gemma4} | {
    f"transformers {name} {attn}": (lambda name=name, attn=attn: tiny_transformers(name, attn))
    for name in ("qwen3", "llama", "gemma3", "olmo3", "cohere2") for attn in ("sdpa", "eager")}


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_a_correct_model_keeps_every_property_at_every_stage(name):
    """Every attention, feed-forward, shortcut and wiring stage of a correct model, its properties measured as if it
    differed: none is broken (and the model matches its description)."""
    from glassgpt.explain.verify import stage_properties
    model = CLEAN[name]()
    broken = stage_properties(model, TEXT)
    assert broken and all(b is None for b in broken.values()), {k: v for k, v in broken.items() if v is not None}
    blocks = glassgpt.describe(model).blocks
    assert {b.attention.path for b in blocks} | {b.ff.path for b in blocks} <= set(broken)
    assert glassgpt.check(model, TEXT).ok
