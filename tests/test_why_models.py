"""why on every described model (explain/why.py): GPT-2, Qwen3, Llama 3.2, chapter 4's four variants and the
bonus models (Qwen3 MoE, Gemma 3's sandwich norms, OLMo 3's post-norms, Tiny Aya's parallel block and logit
scale, Qwen3.5's linear and full layers, Gemma 4's per-layer inputs, kv-shared layers and layer_scalar), each a
tiny random model; nothing is downloaded.

Tolerances: the model runs in float32 and the attribution sums in float64, so a sum of parts differs from the
model's own number by float32 rounding of the model's adds: 1e-5 of the largest magnitude involved (at least 1)
for the residual stream and the expert sums, 1e-4 for a logit (the issue's bound, as tests/test_why.py)."""

from __future__ import annotations

import json

import pytest
import torch

import glassgpt
from glassgpt.config import GPTConfig
from glassgpt.explain.why import attribute_parts, record_parts, split_over_sources, stream_writes
from glassgpt.families import (FamilyConfig, Gemma3Config, Gemma4Config, Olmo3Config, Qwen3_5Config, TinyAyaConfig,
                               build_model)
from glassgpt.prompt import encode
from glassgpt.variants import GQAConfig, MLAConfig, MoEConfig, SWAConfig
from glassgpt.variants import build_model as build_variant
from helpers import CHAR_LLAMA, CHAR_QWEN, CHAR_TEXT, CHAR_TOK

V = CHAR_TOK.n_vocab
STREAM = 1e-5  # the writes against the model's own residual, relative to its largest value (at least 1)
LOGIT = 1e-4   # the parts against the model's own logit, relative to it (at least 1)
SLIDING, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
GPT_BASE = dict(vocab_size=V, context_length=32, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=True)
BONUS = dict(vocab_size=V, context_length=32, emb_dim=32, n_heads=4, n_layers=4, hidden_dim=48, head_dim=8,
             n_kv_heads=2, sliding_window=4, layer_types=(SLIDING, FULL, SLIDING, FULL), rope_base=10_000.0)

CONFIGS = {
    "gpt2": GPTConfig(**GPT_BASE),
    "qwen3": CHAR_QWEN,
    "llama3": CHAR_LLAMA,
    "gqa": GQAConfig(**GPT_BASE, n_kv_groups=2),
    "mla": MLAConfig(**GPT_BASE, latent_dim=8),
    "swa": SWAConfig(**GPT_BASE, sliding_window_size=4, sliding_window_stride=2),
    "moe": MoEConfig(**GPT_BASE, num_experts=4, num_experts_per_tok=2, hidden_dim=24),
    "qwen3_moe": FamilyConfig(family="qwen3", vocab_size=V, context_length=32, emb_dim=32, n_heads=4, n_layers=2,
                              hidden_dim=48, n_kv_groups=2, rope_base=1_000_000.0, head_dim=8, qk_norm=True,
                              num_experts=8, num_experts_per_tok=3, moe_hidden_dim=24),
    "gemma3": Gemma3Config(vocab_size=V, context_length=32, emb_dim=32, n_heads=4, n_layers=4, hidden_dim=48,
                           head_dim=8, n_kv_groups=2, rope_local_base=10_000.0, rope_base=1_000_000.0, sliding_window=4,
                           layer_types=(SLIDING, FULL, SLIDING, FULL), query_pre_attn_scalar=24),
    "olmo3": Olmo3Config(**BONUS),
    "tiny_aya": TinyAyaConfig(**BONUS, logit_scale=0.0625),
    "qwen3_5": Qwen3_5Config(family="qwen3_5", vocab_size=V, context_length=32, emb_dim=32, n_heads=4, n_layers=3,
                             hidden_dim=48, head_dim=8, n_kv_groups=2, rope_base=10_000.0, qk_norm=True,
                             linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                             linear_num_value_heads=4, layer_types=(LINEAR, FULL, LINEAR)),
    "gemma4": Gemma4Config(vocab_size=V, emb_dim=32, hidden_dim=48, n_layers=4, n_heads=4, head_dim=8, n_kv_heads=2,
                           global_head_dim=16, context_length=32, sliding_window=4, layer_types=(SLIDING, FULL) * 2,
                           vocab_size_per_layer_input=V, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                           use_double_wide_mlp=True, final_logit_softcap=30.0),
}
MOE = ["moe", "qwen3_moe"]


def model_of(name: str, seed: int = 0) -> torch.nn.Module:
    """The glass model, every matrix random and every vector (norm weights, biases) away from its start, so that a
    norm read in the wrong place, or a part left out, shows."""
    torch.manual_seed(seed)
    cfg = CONFIGS[name]
    if name == "gpt2":
        model = glassgpt.GPTModel(cfg)
    elif name in ("gqa", "mla", "swa", "moe"):
        model = build_variant(cfg)
    else:
        model = build_model(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)  # in [0.5, 1.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for path, b in model.named_buffers():
            if path.endswith("layer_scalar"):  # Gemma 4's stored number per block: a buffer, not a parameter
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    return model.eval()


def own_logits(model: torch.nn.Module, text: str = CHAR_TEXT) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([encode(CHAR_TOK, text)]))[0, -1].double()  # [V], the model's own forward


@pytest.mark.parametrize("name", CONFIGS)
def test_the_parts_writes_and_the_embedding_sum_to_the_final_residual(name):
    """Whatever the norms' placement (pre, post, sandwich, parallel), the stream is a sum of what the parts wrote."""
    model = model_of(name)
    with torch.inference_mode():
        seen, _ = record_parts(model, encode(CHAR_TOK, CHAR_TEXT), None)
    for position in (0, 5, -1):
        writes = stream_writes(model, seen, position)
        total = sum(v for _, v in writes)
        x = seen["final_norm"][0, position].double()  # final_norm's input: the residual at the end
        assert float((total - x).abs().max()) <= STREAM * max(1.0, float(x.abs().max()))
    anatomy = glassgpt.describe(model)  # tok_emb (and pos_emb), then each block's attention, feed-forward (and
    per_layer = sum(b.per_layer_input is not None for b in anatomy.blocks)  # Gemma 4's per-layer input)
    assert len(writes) == (2 if anatomy.positions.kind == "learned" else 1) + 2 * anatomy.n_layers + per_layer


def test_gemma4s_layer_scalars_multiply_every_write_before_them():
    """Gemma 4's blocks return (x + att + ff + per-layer input) * layer_scalar: the stream at the end is each write
    times the scalars of its block and every block after it. Without those factors the writes do not sum to the
    residual (the scalars here are in [0.5, 1.5)), so the test tells the two apart."""
    from glassgpt.explain.why import gains
    model = model_of("gemma4")
    with torch.inference_mode():
        seen, _ = record_parts(model, encode(CHAR_TOK, CHAR_TEXT), None)
    scalars = [float(b.layer_scalar) for b in model.blocks]
    assert gains(model, glassgpt.describe(model)) == pytest.approx(
        [scalars[0] * scalars[1] * scalars[2] * scalars[3], scalars[1] * scalars[2] * scalars[3],
         scalars[2] * scalars[3], scalars[3]], rel=1e-12)
    x = seen["final_norm"][0, -1].double()
    scaled = sum(v for _, v in stream_writes(model, seen))
    unscaled = seen["trf_blocks.0"][0, -1].double() + sum(
        seen[f"trf_blocks.{i}.{n}.write"][0, -1].double() for i in range(4) for n in ("att", "ff", "per_layer"))
    assert float((scaled - x).abs().max()) <= STREAM * max(1.0, float(x.abs().max()))
    assert float((unscaled - x).abs().max()) > 0.1
    w = glassgpt.why(model, CHAR_TOK, CHAR_TEXT)
    assert [p["name"] for p in w.parts if p["name"].endswith("per_layer")] == [f"trf_blocks.{i}.per_layer"
                                                                              for i in range(4)]


@pytest.mark.parametrize("name", CONFIGS)
def test_the_parts_sum_to_the_models_own_logit_and_its_difference_to_the_runner_up(name):
    model = model_of(name)
    logits = own_logits(model)
    w = glassgpt.why(model, CHAR_TOK, CHAR_TEXT)
    a = int(logits.argmax())
    assert w.target["id"] == a
    assert abs(sum(p["value"] for p in w.parts) - float(logits[a])) <= LOGIT * max(1.0, abs(float(logits[a])))
    r = w.contrast["versus"]["id"]
    difference = float(logits[a] - logits[r])
    assert abs(sum(p["value"] for p in w.contrast["parts"]) - difference) <= LOGIT * max(1.0, abs(difference))
    other = glassgpt.why(model, CHAR_TOK, CHAR_TEXT, target=3)  # another target's logit splits as exactly
    assert abs(sum(p["value"] for p in other.parts) - float(logits[3])) <= LOGIT * max(1.0, abs(float(logits[3])))


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "gpt2"])
def test_each_heads_shares_of_the_prompt_sum_to_its_term(name):
    """The direct split, read from the model by one masked-value pass, adds up to each head's term; a linear
    attention's heads are not split (zeros), and a note says so."""
    model = model_of(name)
    w = glassgpt.why(model, CHAR_TOK, CHAR_TEXT)
    linear = [b.attention.kind == "linear" for b in glassgpt.describe(model).blocks]
    for i, layer in enumerate(w.by_source):
        for j, shares in enumerate(layer):
            assert len(shares) == len(CHAR_TEXT)
            expected = 0.0 if linear[i] else w.heads[i][j]
            assert abs(sum(shares) - expected) <= 1e-5 * max(1.0, abs(w.heads[i][j])), (i, j)
    assert any("linear attention" in n for n in w.notes) == any(linear)


def test_a_post_norm_heads_terms_sum_to_the_attention_write_read_through_its_frozen_norm():
    """OLMo 3: the attention's write is post_attention_layernorm(att(x)); with that norm's rms frozen at its input,
    the heads' terms sum to the write's share of the logit (the write's dot with the final direction)."""
    model = model_of("olmo3")
    with torch.inference_mode():
        seen, last = record_parts(model, encode(CHAR_TOK, CHAR_TEXT), None)
        a = int(last.argmax())
        result = attribute_parts(model, seen, a, None, split_over_sources(model, seen, encode(CHAR_TOK, CHAR_TEXT),
                                                                          None))
        from glassgpt.explain.why import readout
        c, _, _ = readout(model, seen["final_norm"][0, -1], a, None)
        for i in range(glassgpt.describe(model).n_layers):
            write = seen[f"trf_blocks.{i}.att.write"][0, -1].double()
            assert write is not seen[f"trf_blocks.{i}.att"]  # a post-norm's output, not the attention's
            assert abs(sum(result["heads"][i]) - float(write @ c)) <= 1e-5 * max(1.0, float(write.abs().max()))


@pytest.mark.parametrize("name", MOE)
def test_the_routed_experts_contributions_sum_to_the_blocks_feed_forward_part(name):
    model = model_of(name)
    w = glassgpt.why(model, CHAR_TOK, CHAR_TEXT)
    anatomy = glassgpt.describe(model)
    k = anatomy.blocks[0].ff.experts.per_token
    for i, block in enumerate(w.experts):
        experts = [p for p in w.parts if p["name"].startswith(f"trf_blocks.{i}.ff.expert.")]
        assert len(experts) == k and f"trf_blocks.{i}.ff" not in {p["name"] for p in w.parts}
        assert abs(sum(p["value"] for p in experts) - w.ff[i]) <= STREAM * max(1.0, abs(w.ff[i]))
        assert [p["name"] for p in experts] == [f"trf_blocks.{i}.ff.expert.{r['expert']}" for r in block[-1]]
        assert len(block) == len(CHAR_TEXT)  # every token's route
        for route in block:  # k distinct experts, their renormalised weights summing to one, best first
            weights = [r["weight"] for r in route]
            assert len({r["expert"] for r in route}) == k and abs(sum(weights) - 1) < 1e-6
            assert weights == sorted(weights, reverse=True)


@pytest.mark.parametrize("name", MOE)
def test_the_routes_are_the_routers_own_choice(name):
    """The routes why reports are the experts the model ran: each expert's output, as the mixture weighs it, adds
    up to the feed-forward's own output at every token."""
    model = model_of(name)
    ids = encode(CHAR_TOK, CHAR_TEXT)
    w = glassgpt.why(model, CHAR_TOK, CHAR_TEXT)
    with torch.inference_mode():
        seen, _ = record_parts(model, ids, None)
    ff = model.trf_blocks[1].ff
    x, out = seen["trf_blocks.1.ff.in"][0], seen["trf_blocks.1.ff"][0]  # [t, d]
    with torch.inference_mode():
        for j, route in enumerate(w.experts[1]):
            mixed = sum(r["weight"] * ff.fc3[r["expert"]](torch.nn.functional.silu(ff.fc1[r["expert"]](x[j]))
                                                           * ff.fc2[r["expert"]](x[j])) for r in route)
            torch.testing.assert_close(mixed, out[j], atol=1e-5, rtol=1e-5)


def test_a_logit_scale_multiplies_every_part():
    """Tiny Aya's logits are out_head's times logit_scale (0.0625 here): the parts of a model with the scale are
    the parts of the same weights without it, times the scale."""
    import dataclasses
    scaled = model_of("tiny_aya")
    plain = build_model(dataclasses.replace(CONFIGS["tiny_aya"], logit_scale=1.0))
    plain.load_state_dict(scaled.state_dict())
    a = glassgpt.why(scaled.eval(), CHAR_TOK, CHAR_TEXT)
    b = glassgpt.why(plain.eval(), CHAR_TOK, CHAR_TEXT, target=a.target["id"])
    assert [p["name"] for p in a.parts] == [p["name"] for p in b.parts]
    assert [p["value"] for p in a.parts] == pytest.approx([0.0625 * p["value"] for p in b.parts], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_moe", "qwen3_5", "gemma4"])
def test_the_text_and_the_json_show_every_models_why(name):
    w = glassgpt.why(model_of(name), CHAR_TOK, CHAR_TEXT, versus="e", patch="every effort moves yoa")
    text = w.to_text()
    assert "why" in text and f"= sum of {len(w.parts)} parts" in text
    data = json.loads(json.dumps(w.to_dict()))
    assert abs(sum(p["value"] for p in data["parts"]) - data["metric"]) <= LOGIT * max(1.0, abs(data["metric"]))
    assert len(data["patch"]["grid"]) == glassgpt.describe(model_of(name)).n_layers + 1
    if name == "qwen3_moe":
        assert "experts (per block" in text and len(data["experts"]) == 2


@pytest.mark.parametrize("name", ["olmo3", "tiny_aya", "gemma3", "qwen3_5", "gemma4"])
def test_patching_gives_the_logits_of_a_rerun_with_a_block_input_replaced(name):
    model = model_of(name)
    clean, bad = encode(CHAR_TOK, CHAR_TEXT), encode(CHAR_TOK, "every effort moves yoa")
    w = glassgpt.why(model, CHAR_TOK, CHAR_TEXT, versus="e", patch="every effort moves yoa")
    a, b, m_clean, m_bad = (w.patch["clean_top"]["id"], w.patch["versus"]["id"], w.patch["m_clean"],
                            w.patch["m_corrupted"])
    block = model.get_submodule(glassgpt.describe(model).blocks[1].path)  # (OLMo 3 and Tiny Aya: `blocks`)
    seen = {}
    handle = block.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0].clone()))  # (None: no swap)
    with torch.no_grad():
        model(torch.tensor([clean]))
    handle.remove()

    def swap(m, args):
        x = args[0].clone()
        x[:, -1] = seen["x"][:, -1]
        return (x, *args[1:])
    handle = block.register_forward_pre_hook(swap)
    with torch.no_grad():
        logits = model(torch.tensor([bad]))[0, -1].double()
    handle.remove()
    restored = (float(logits[a] - logits[b]) - m_bad) / (m_clean - m_bad)
    assert abs(w.patch["grid"][1][-1] - restored) < 1e-4


def test_a_softcap_scales_each_part_so_the_parts_still_sum_to_the_capped_logit(monkeypatch):
    """A head with a softcap (cap * tanh(z / cap), Gemma 2's and Gemma 4's): each part is scaled by its logit's
    capped / uncapped ratio, so the parts sum to the capped logit, and to the capped difference against B.
    The description of a Qwen3 model is given a cap of 2 (the parts are read through the description only)."""
    import dataclasses
    import importlib

    why_module = importlib.import_module("glassgpt.explain.why")  # (glassgpt.explain.why is the function)
    model = model_of("qwen3")
    capped = dataclasses.replace(glassgpt.describe(model), head=dataclasses.replace(glassgpt.describe(model).head,
                                                                                   softcap=2.0))
    monkeypatch.setattr(why_module, "describe", lambda m: capped)
    z = own_logits(model)  # the uncapped logits
    cap = 2.0 * torch.tanh(z / 2.0)
    with torch.inference_mode():
        seen, _ = record_parts(model, encode(CHAR_TOK, CHAR_TEXT), None)
        a, b = int(z.argmax()), int(z.argmin())
        alone = attribute_parts(model, seen, a, None, {})["parts"]
        against = attribute_parts(model, seen, a, b, {})["parts"]
    assert abs(sum(p["value"] for p in alone) - float(cap[a])) <= LOGIT
    assert abs(sum(p["value"] for p in against) - float(cap[a] - cap[b])) <= LOGIT
    assert abs(float(cap[a]) - float(z[a])) > 0.1  # the cap changed the logit: the test tells the two apart
