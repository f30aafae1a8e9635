"""The layer debugger for every model glassgpt describes beyond GPT-2, Qwen3 and Llama 3.2 (test_debugger.py).

The bonus models (Qwen3 MoE, Gemma 3, OLMo 3, Tiny Aya, Qwen3.5, Gemma 4) are held against their transformers
classes, chapter 4's variants (GQA, MLA, SWA, MoE) against glassgpt's glass variant of the same config,
since transformers has no class for them: every layer matches at rtol = atol = 1e-5, the maintainer's.
Then one planted mistake per model, each a reader's port in memory (glassgpt's class with one piece
rewritten), named at its layer, the part inside it and the property it breaks. All but one are outside
the catalogue, so the property alone carries the finding; the MoE's unrenormalised routing is also
verify.py's described catalogue entry, which then names the line as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import glassgpt
from glassgpt import kinds
from glassgpt.explain.debugger import LayerReport, debug, tiny_config
from glassgpt.variants import gqa, swa
from glassgpt.variants.swa import window_attention_weights

BONUS = {"qwen3_moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM", "olmo3": "Olmo3ForCausalLM",
         "tiny_aya": "Cohere2ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "gemma4": "Gemma4ForCausalLM"}
VARIANTS = ("gqa", "mla", "swa", "moe")


def glass(key: str) -> nn.Module:
    torch.manual_seed(0)
    return kinds.glass_model(tiny_config(key)).eval()


# --- the table: each model against its reference ---------------------------------------------------------

@pytest.mark.parametrize("key", list(BONUS))
def test_every_layer_of_each_bonus_model_matches_its_transformers_class(key):
    cfg = tiny_config(key)
    report = glassgpt.check(kinds.glass_class(cfg), args=cfg, against="transformers")
    assert isinstance(report, LayerReport)
    assert report.reference == f"transformers' {BONUS[key]}"
    blocks = [b.path for b in kinds.glass_description(cfg).blocks]
    assert [line.name for line in report.layers] == ["embedding", *blocks, "final_norm", "logits"]
    assert [line.status for line in report.layers] == ["OK"] * (len(blocks) + 3), report.to_text()
    assert all(line.max_diff < 1e-5 for line in report.layers)
    assert report.ok and report.finding.startswith(f"every layer matches transformers' {BONUS[key]}")


@pytest.mark.parametrize("key", VARIANTS)
def test_each_chapter_4_variant_matches_glassgpts_glass_variant_and_says_transformers_has_none(key):
    report = debug(glass(key))
    assert report.reference == (f"glassgpt's variants.{key} GPTModel (chapter 4's {key.upper()} has no "
                                "transformers class)")
    assert report.to_text().splitlines()[0].endswith("(chapter 4's " + key.upper() + " has no transformers class)")
    assert [line.status for line in report.layers] == ["OK"] * 5, report.to_text()


def test_the_variant_table_can_fail():
    # a port whose weights the map never reached differs from the reference's: the [OK] above are earned
    from glassgpt.explain import debugger
    original = debugger.map_weights
    try:
        debugger.map_weights = lambda port, ref: None
        assert [line.status for line in debug(glass("gqa")).layers] == ["DIFF"] * 5
    finally:
        debugger.map_weights = original


# --- one planted mistake per model: the layer, the part, the property ----------------------------------------

def swap(module: nn.Module, **methods) -> None:
    """A reader's rewrite of one method of one module (the rest of the glass model kept)."""
    module.__class__ = type(f"My{type(module).__name__}", (type(module),), methods)


def unrenormalised_route(self, x):
    scores = self.gate(x)
    probs = torch.softmax(scores, dim=-1)  # over all experts, then the top k kept: they no longer sum to 1
    top_probs, top_ids = torch.topk(probs, self.num_experts_per_tok, dim=-1)
    return top_ids, top_probs


def test_qwen3_moe_routing_weights_not_renormalised_are_named_at_the_feed_forward():
    model = glass("qwen3_moe")
    for blk in model.trf_blocks:
        swap(blk.ff, route=unrenormalised_route)
    report = debug(model)
    # the property names it, and verify's catalogue of the described models (its MoE entry) names the line too
    assert (report.layer, report.part, report.mistake) == ("trf_blocks.0", "ff", "moe_not_renormalised")
    assert [p.status for p in report.parts][:8] == ["OK"] * 8  # norm1, q, k, v, q_norm, k_norm, att, the sum
    assert report.broken.startswith("each token's 2 routing weights sum to ")
    assert "not 1: the softmax runs over all 4 experts before the top 2 are kept" in report.broken


def test_gemma3_rmsnorm_without_one_plus_weight_is_named_at_its_first_norm():
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale  # not (1 + scale)
    model = glass("gemma3")
    for blk in model.blocks:
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            swap(getattr(blk, name), forward=forward)
    report = debug(model)
    assert (report.layer, report.part) == ("blocks.0", "input_layernorm")
    assert report.broken == ("it computes RMSNorm, x / rms(x) * weight, where the description has Gemma's RMSNorm, "
                             "x / rms(x) * (1 + weight) (its weights stored around 0)")


def test_olmo3_norm_before_the_attention_instead_of_after_is_named_by_what_the_attention_reads():
    def forward(self, x, cos, sin, cache=None):
        x = x + self.att(self.post_attention_layernorm(x), cos, sin, cache)  # pre-norm, as Llama's
        return x + self.ff(self.post_feedforward_layernorm(x))
    model = glass("olmo3")
    for blk in model.blocks:
        swap(blk, forward=forward)
    report = debug(model)
    assert (report.layer, report.part) == ("blocks.0", "att.W_query")
    assert report.broken == ("att reads post_attention_layernorm's output: the norm runs before the sublayer, where "
                             "this block's norms come after it (post): x + post_attention_layernorm(att(x)), the "
                             "sublayer reading x itself")


def test_tiny_aya_sequential_instead_of_parallel_is_named_at_the_feed_forward():
    def forward(self, x, cos, sin, cache=None):
        x = x + self.att(self.input_layernorm(x), cos, sin, cache)
        return x + self.ff(self.input_layernorm(x))  # after the attention's sum, as GPT-2's blocks
    model = glass("tiny_aya")
    for blk in model.trf_blocks:
        swap(blk, forward=forward)
    report = debug(model)
    assert (report.layer, report.part) == ("trf_blocks.0", "ff")
    assert [p.name for p in report.parts] == ["input_layernorm", "att.W_query", "att.W_key", "att.W_value", "att",
                                              "ff", "output"]
    assert report.broken.startswith("ff reads another input than the attention: the block runs them one after the "
                                    "other, where its described placement is parallel")


def test_qwen35_convolution_without_causal_padding_is_named_as_not_causal():
    def causal_conv(self, x, before):
        width = self.conv_kernel_size - 1
        padded = F.pad(x, (width // 2, width - width // 2))  # centred: each output sees a later input
        out = F.conv1d(padded, self.conv1d.weight, groups=self.conv_dim)
        return F.silu(out), padded[:, :, padded.shape[-1] - width:]
    model = glass("qwen3_5")
    swap(model.trf_blocks[0].token_mixer, causal_conv=causal_conv)
    report = debug(model)
    assert (report.layer, report.part) == ("trf_blocks.0", "token_mixer")
    assert report.broken.startswith("it is not causal: its output at position 6 moves (by ")
    assert "when only position 7's input changes" in report.broken
    assert report.broken.endswith("its short convolution (token_mixer.conv1d, kernel 3) must see its own token and "
                                  "the 2 before it only: pad 2 zeros on the left and none on the right, keeping the "
                                  "first t outputs")


def gemma4_block_forward(scaled: bool):
    def forward(self, x, per_layer_input, cos, sin, cache=None, shared_kv=None):
        x = x + self.post_attention_layernorm(self.att(self.input_layernorm(x), cos, sin, cache, shared_kv))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        gate = F.gelu(self.per_layer_input_gate(x)) if scaled else F.gelu(self.per_layer_input_gate(x),
                                                                          approximate="tanh")
        x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate * per_layer_input))
        return x * self.layer_scalar if scaled else x  # scaled: layer_scalar kept, the exact GELU instead
    return forward


def test_gemma4_kv_shared_layers_and_per_layer_inputs_are_parts_of_the_table():
    report = glassgpt.check(kinds.glass_class(tiny_config("gemma4")), args=tiny_config("gemma4"),
                            against="transformers")
    assert report.ok and [line.name for line in report.layers][1:5] == [f"blocks.{i}" for i in range(4)]
    from glassgpt.families.bonus_hf import gemma4_config_from_hf, gemma4_config_to_hf
    assert gemma4_config_from_hf(gemma4_config_to_hf(tiny_config("gemma4"))) == tiny_config("gemma4")
    model = glass("gemma4")
    assert [b.att.kv_shared_layer_index for b in model.blocks] == [None, None, 0, 1]
    for blk in model.blocks:
        swap(blk, forward=gemma4_block_forward(scaled=False))
    report = debug(model)
    names = [p.name for p in report.parts]
    assert names[-4:] == ["per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm", "output"]


def test_gemma4_layer_scalar_left_out_is_named_at_the_blocks_output():
    # layer_scalar has no place in the description: the finding names it only because the numbers show it
    model = glass("gemma4")
    for blk in model.blocks:
        swap(blk, forward=gemma4_block_forward(scaled=False))
    report = debug(model)
    assert (report.layer, report.part) == ("blocks.0", "output")
    assert [p.status for p in report.parts][:-1] == ["OK"] * (len(report.parts) - 1), report.to_text()
    assert report.broken.startswith("its output times blocks.0.layer_scalar (")
    assert report.broken.endswith("is transformers': the block's last step, x * layer_scalar (one stored number per "
                                  "block), is left out")


def test_gemma4_per_layer_gate_without_tanh_is_named_at_its_part_and_no_cause_is_invented():
    model = glass("gemma4")
    for blk in model.blocks:
        swap(blk, forward=gemma4_block_forward(scaled=True))
    report = debug(model)
    assert (report.layer, report.part) == ("blocks.0", "per_layer_projection")
    assert report.broken is None and report.finding.endswith("inside it, per_layer_projection first.")


def test_gemma4_kv_shared_layer_computing_its_own_keys_is_named_at_its_attention():
    model = glass("gemma4")
    for blk in model.blocks:
        blk.att.is_kv_shared_layer = False  # every layer computes its keys and values from its own k_proj, v_proj
    report = debug(model)
    assert (report.layer, report.part) == ("blocks.2", "att")
    assert [p.name for p in report.parts][:3] == ["input_layernorm", "att.q_proj", "att.q_norm"]
    assert report.broken == ("blocks.2 is kv-shared: it attends over the keys and values blocks.0 computed, but your "
                             "forward calls its own att.k_proj: it computes keys of its own (transformers' blocks.2 "
                             "has no k_proj)")


def test_gqa_groups_expanded_with_repeat_are_named_at_the_attention():
    def forward(self, x, use_cache=False):
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        k, v = k.repeat(1, self.group_size, 1, 1), v.repeat(1, self.group_size, 1, 1)  # [K1, K2, K1, K2]
        weights = gqa.attention_weights(q, k)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, self.d_out))
    model = glass("gqa")
    for blk in model.trf_blocks:
        swap(blk.att, forward=forward)
    report = debug(model)
    assert (report.layer, report.part) == ("trf_blocks.0", "att")
    assert report.broken == ("query head h reads key/value group h % 2, where the 2 query heads of a group share one: "
                             "group h // 2; expand the groups with repeat_interleave(2, dim=1), not repeat")
    assert "glassgpt's variant" not in report.broken and report.finding.endswith(report.broken + ".")


def test_mla_scores_not_scaled_are_named_at_the_attention():
    def forward(self, x, use_cache=False):
        b, t, _ = x.shape
        q = self.split_heads(self.W_query(x))
        latent = self.W_DKV(x)
        k, v = self.split_heads(self.W_UK(latent)), self.split_heads(self.W_UV(latent))
        scores = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        weights = torch.softmax(scores, dim=-1)  # never divided by sqrt(head_dim)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, self.d_out))
    model = glass("mla")
    for blk in model.trf_blocks:
        swap(blk.att, forward=forward)
    report = debug(model)
    assert (report.layer, report.part) == ("trf_blocks.0", "att")
    assert report.broken == ("the scores are divided by 1 (not scaled at all) where the head size was meant: divide "
                             "by sqrt(head_dim) = sqrt(8)")


def test_swa_window_off_by_one_is_named_by_the_positions_each_query_sees():
    def attend(self, q, k, v):
        if self.sliding_window_size is None:  # a full layer
            return swa.MultiHeadAttentionWithSWA.attend(self, q, k, v)
        return window_attention_weights(q, k, self.sliding_window_size + 1) @ v  # one position too many
    model = glass("swa")
    assert model.trf_blocks[0].att.sliding_window_size == 4
    for blk in model.trf_blocks:
        swap(blk.att, attend=attend)
    report = debug(model)
    assert (report.layer, report.part) == ("trf_blocks.0", "att")
    assert report.broken == ("position 4 sees the last 5 positions, itself included, where the window is 4: off by "
                             "one; query i sees key j when 0 <= i - j < 4")


def test_moe_variant_routing_weights_not_renormalised_are_named_at_the_feed_forward():
    def forward(self, x):
        b, t, d = x.shape
        probs, chosen = torch.softmax(self.gate(x), dim=-1).topk(self.num_experts_per_tok, dim=-1)
        out = torch.zeros_like(x)
        for slot in range(self.num_experts_per_tok):
            for e in range(self.num_experts):
                rows = chosen[..., slot] == e
                out[rows] += probs[..., slot][rows, None] * self.expert(e, x[rows])
        return out
    model = glass("moe")
    for blk in model.trf_blocks:
        swap(blk.ff, forward=forward)
    report = debug(model)
    assert (report.layer, report.part) == ("trf_blocks.0", "ff")
    assert "routing weights sum to" in report.broken and "over all 4 experts before the top 2" in report.broken


def test_the_command_checks_a_bonus_port_in_a_file(tmp_path, capsys):
    from helpers import run
    (tmp_path / "my_aya.py").write_text(
        "from glassgpt.families import tiny_aya\n\n\n"
        "class TransformerBlock(tiny_aya.TransformerBlock):\n"
        "    def forward(self, x, cos, sin, cache=None):\n"
        "        x = x + self.att(self.input_layernorm(x), cos, sin, cache)\n"
        "        return x + self.ff(self.input_layernorm(x))\n\n\n"
        "class TinyAyaModel(tiny_aya.TinyAyaModel):\n"
        "    def __init__(self, cfg):\n"
        "        super().__init__(cfg)\n"
        "        for block in self.trf_blocks:\n"
        "            block.__class__ = TransformerBlock\n")
    code, out, _ = run(["check", f"{tmp_path / 'my_aya.py'}:TinyAyaModel", "--against", "transformers"], capsys)
    assert code == 1
    assert out.splitlines()[0] == ("glassgpt check: TinyAyaModel (your subclass of glassgpt's "
                                  "TinyAyaModel) against transformers' Cohere2ForCausalLM")
    assert "[DIFF] trf_blocks.0: max=" in out and "inside it, ff first: ff reads another input than the attention" in out


def test_the_command_checks_a_gemma4_port_in_a_file(tmp_path, capsys):
    from helpers import run
    (tmp_path / "my_gemma4.py").write_text(
        "from glassgpt.families import gemma4\n\n\n"
        "class Gemma4DenseModel(gemma4.Gemma4DenseModel):\n"
        "    def __init__(self, cfg):\n"
        "        super().__init__(cfg)\n"
        "        for block in self.blocks:\n"
        "            block.att.is_kv_shared_layer = False\n")
    code, out, _ = run(["check", f"{tmp_path / 'my_gemma4.py'}:Gemma4DenseModel", "--against", "transformers"], capsys)
    assert code == 1
    assert out.splitlines()[0] == ("glassgpt check: Gemma4DenseModel (your subclass of glassgpt's Gemma4DenseModel) "
                                  "against transformers' Gemma4ForCausalLM")
    assert "[OK] blocks.1: max=" in out and "[DIFF] blocks.2: max=" in out
    assert "inside it, att first: blocks.2 is kv-shared: it attends over the keys and values blocks.0 computed" in out
