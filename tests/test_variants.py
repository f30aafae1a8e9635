"""Chapter 4's variants on the GPT base (src/glassgpt/variants/): each one's cache, generation, its
formula against an independent computation, and its KV-cache bytes against the book repository's
memory_estimator_*.py formulas (quoted here: the repository is not installed, and is not imported).

Tolerances: float32, rtol 1e-5 and atol 1e-5 where two computations add in a different order (a
cache feeds fewer tokens per matmul); exact where the operations are the same.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from glassgpt.config import GPTConfig
from glassgpt.errors import ConfigError, PromptError
from glassgpt.model import GPTModel as GPT2Model
from glassgpt.model import MultiHeadAttention
from glassgpt.variants import (GQAConfig, GroupedQueryAttention, MLAConfig, MoEConfig, MoEFeedForward,
                               MultiHeadAttentionWithSWA, MultiHeadLatentAttention, SWAConfig, build_model,
                               generate_text_simple_cached, gpt2_config, kv_bytes_per_token, kv_cache_bytes)
from glassgpt.variants.moe import ff_parameters
from glassgpt.variants.swa import layer_windows

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: two threads on a busy machine thrash

TINY = dict(vocab_size=101, context_length=32, emb_dim=32, n_heads=4, n_layers=3, qkv_bias=True)
CONFIGS = {
    "gqa": GQAConfig(**TINY, n_kv_groups=2),
    "mla": MLAConfig(**TINY, latent_dim=8),
    "swa": SWAConfig(**TINY, sliding_window_size=4, sliding_window_stride=2),
    "moe": MoEConfig(**TINY, num_experts=4, num_experts_per_tok=2, hidden_dim=24),
}
CLOSE = dict(rtol=1e-5, atol=1e-5)  # float32: the same sums, added in another order


def tiny(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(CONFIGS[name]).eval()


def cache_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a variant's attention keeps between steps."""
    return [t for block in model.trf_blocks for t in (getattr(block.att, "cache_k", None),
            getattr(block.att, "cache_v", None), getattr(block.att, "cache_c_kv", None)) if t is not None]


# --- the cache -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
@torch.no_grad()
def test_cached_logits_equal_the_whole_sequences_over_several_steps(name):
    model = tiny(name)
    ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(1))
    whole = model(ids)
    model.reset_kv_cache()
    # a prompt of 7 (longer than the window of 4), six single tokens, then a chunk of 7
    steps = [model(ids[:, :7], use_cache=True)] + [model(ids[:, i:i + 1], use_cache=True) for i in range(7, 13)]
    steps.append(model(ids[:, 13:], use_cache=True))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, **CLOSE)
    assert model.current_pos == 20


@pytest.mark.parametrize("name", CONFIGS)
@torch.no_grad()
def test_reset_kv_cache_starts_again_at_position_zero(name):
    model = tiny(name)
    ids = torch.randint(0, TINY["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(2))
    model(ids, use_cache=True)
    model.reset_kv_cache()
    assert cache_tensors(model) == [] and model.current_pos == 0
    torch.testing.assert_close(model(ids[:, :5], use_cache=True), model(ids[:, :5]), **CLOSE)


@torch.no_grad()
def test_the_sliding_window_cache_is_trimmed_to_the_window():
    model = tiny("swa")
    w = CONFIGS["swa"].sliding_window_size
    assert layer_windows(CONFIGS["swa"]) == [w, w, None]  # K = 2: two window layers, then a full one
    ids = torch.randint(0, TINY["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3))
    model(ids[:, :7], use_cache=True)
    pos = 7
    for i in range(7, 20):
        lengths = [block.att.cache_k.shape[2] for block in model.trf_blocks]
        assert lengths == [min(pos, w), min(pos, w), pos], f"after {pos} tokens"
        assert [block.att.cache_v.shape[2] for block in model.trf_blocks] == lengths
        model(ids[:, i:i + 1], use_cache=True)
        pos += 1


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_picks_the_same_tokens_with_and_without_the_cache(name):
    model = tiny(name)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(4))
    cached = generate_text_simple_cached(model, prompt, 12)
    uncached = generate_text_simple_cached(model, prompt, 12, use_cache=False)
    assert cached.shape == (2, 18) and torch.equal(cached[:, :6], prompt)
    assert torch.equal(cached, uncached)


def test_a_cached_input_past_the_context_is_refused_in_one_line():
    model = tiny("gqa")
    with pytest.raises(PromptError, match=r"^input reaches position 33 but context_length is 32: shorten it") as err:
        generate_text_simple_cached(model, torch.zeros(1, 30, dtype=torch.long), 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("prompt", [torch.zeros(1, 0, dtype=torch.long), torch.zeros(5, dtype=torch.long)])
def test_a_prompt_that_is_not_a_batch_of_ids_is_refused_in_one_line(prompt):
    with pytest.raises(PromptError, match=r"^the prompt must be ids \[batch, tokens\] with at least one token, got "
                                          rf"shape {re.escape(str(list(prompt.shape)))}$"):
        generate_text_simple_cached(tiny("gqa"), prompt, 3)


# --- each variant against an independent computation ------------------------------------------------


def copy_linear(dst: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    with torch.no_grad():
        dst.weight.copy_(weight)
        if dst.bias is not None:
            dst.bias.copy_(bias if bias is not None else torch.zeros_like(dst.bias))


def mha_like(att: torch.nn.Module, cfg: GPTConfig, key: tuple, value: tuple) -> MultiHeadAttention:
    """glassgpt's GPT-2 attention (model.py) with att's queries and out_proj, and the given key and value maps."""
    mha = MultiHeadAttention(gpt2_config(cfg)).eval()
    copy_linear(mha.W_query, att.W_query.weight, att.W_query.bias)
    copy_linear(mha.W_key, *key)
    copy_linear(mha.W_value, *value)
    copy_linear(mha.out_proj, att.out_proj.weight, att.out_proj.bias)
    return mha


@torch.no_grad()
def test_grouped_query_attention_with_a_group_per_head_is_gpt2_attention():
    cfg = dataclasses.replace(CONFIGS["gqa"], n_kv_groups=TINY["n_heads"])
    torch.manual_seed(5)
    gqa = GroupedQueryAttention(cfg).eval()
    mha = mha_like(gqa, cfg, (gqa.W_key.weight, gqa.W_key.bias), (gqa.W_value.weight, gqa.W_value.bias))
    x = torch.randn(2, 9, TINY["emb_dim"])
    torch.testing.assert_close(gqa(x), mha(x), **CLOSE)  # (not bit for bit: GPT-2's out_proj adds a zero bias)


@torch.no_grad()
def test_grouped_query_attention_is_gpt2_attention_with_each_key_value_head_repeated_for_its_group():
    cfg = CONFIGS["gqa"]  # 4 query heads, 2 key/value heads: heads 0 and 1 share group 0, heads 2 and 3 group 1
    torch.manual_seed(6)
    gqa = GroupedQueryAttention(cfg).eval()
    hd, group = cfg.head_dim, cfg.n_heads // cfg.n_kv_groups

    def per_head(linear):  # [g * hd, d] -> [h * hd, d]: group j's rows for each of its query heads
        w = linear.weight.view(cfg.n_kv_groups, hd, -1).repeat_interleave(group, dim=0).reshape(-1, cfg.emb_dim)
        return w, linear.bias.view(cfg.n_kv_groups, hd).repeat_interleave(group, dim=0).reshape(-1)

    mha = mha_like(gqa, cfg, per_head(gqa.W_key), per_head(gqa.W_value))
    x = torch.randn(2, 9, TINY["emb_dim"])
    torch.testing.assert_close(gqa(x), mha(x), **CLOSE)


@torch.no_grad()
def test_latent_attention_is_gpt2_attention_whose_keys_and_values_pass_through_the_latent():
    # keys = W_UK (W_DKV x + b_DKV) + b_UK: one linear map of rank <= latent_dim, written out uncompressed
    cfg = CONFIGS["mla"]
    torch.manual_seed(7)
    mla = MultiHeadLatentAttention(cfg).eval()

    def through_latent(up):
        return up.weight @ mla.W_DKV.weight, up.weight @ mla.W_DKV.bias + up.bias

    mha = mha_like(mla, cfg, through_latent(mla.W_UK), through_latent(mla.W_UV))
    assert torch.linalg.matrix_rank(mha.W_key.weight) <= cfg.latent_dim
    x = torch.randn(2, 9, TINY["emb_dim"])
    torch.testing.assert_close(mla(x), mha(x), **CLOSE)


@torch.no_grad()
def test_sliding_windows_covering_the_context_are_gpt2_itself():
    cfg = dataclasses.replace(CONFIGS["swa"], sliding_window_size=TINY["context_length"], sliding_window_stride=-1)
    swa = build_model(cfg).eval()
    gpt2 = GPT2Model(gpt2_config(cfg)).eval()
    gpt2.load_state_dict(swa.state_dict(), strict=True)  # the same names, tensor for tensor
    ids = torch.randint(0, TINY["vocab_size"], (2, TINY["context_length"]), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(swa(ids), gpt2(ids), rtol=0, atol=0)


@torch.no_grad()
def test_a_window_query_is_full_attention_over_its_last_window_tokens():
    cfg, w = CONFIGS["swa"], CONFIGS["swa"].sliding_window_size
    torch.manual_seed(9)
    swa = MultiHeadAttentionWithSWA(cfg, sliding_window_size=w).eval()
    mha = mha_like(swa, cfg, (swa.W_key.weight, swa.W_key.bias), (swa.W_value.weight, swa.W_value.bias))
    x = torch.randn(2, 11, TINY["emb_dim"])
    out = swa(x)
    for i in range(11):
        torch.testing.assert_close(out[:, i], mha(x[:, max(0, i - w + 1):i + 1])[:, -1], **CLOSE)


def test_the_window_schedule_is_k_window_layers_then_one_full_layer():
    def windows(stride, n_layers=7):
        return layer_windows(dataclasses.replace(CONFIGS["swa"], sliding_window_stride=stride, n_layers=n_layers))

    assert windows(2) == [4, 4, None, 4, 4, None, 4]
    assert windows(1) == [4, None, 4, None, 4, None, 4]
    assert windows(0) == [None] * 7 and windows(-1) == [4] * 7


def swiglu(x, fc1, fc2, fc3):
    return F.linear(F.silu(F.linear(x, fc1.weight)) * F.linear(x, fc2.weight), fc3.weight)


@torch.no_grad()
def test_one_expert_chosen_from_one_is_its_swiglu_feed_forward():
    torch.manual_seed(10)
    moe = MoEFeedForward(dataclasses.replace(CONFIGS["moe"], num_experts=1, num_experts_per_tok=1))
    x = torch.randn(2, 5, TINY["emb_dim"])
    torch.testing.assert_close(moe(x), swiglu(x, moe.fc1[0], moe.fc2[0], moe.fc3[0]), rtol=0, atol=0)


@torch.no_grad()
def test_each_token_is_the_softmax_weighted_sum_of_its_top_k_experts():
    cfg = CONFIGS["moe"]  # 4 experts, 2 per token
    torch.manual_seed(11)
    moe = MoEFeedForward(cfg)
    x = torch.randn(2, 6, TINY["emb_dim"])
    out = moe(x)
    for b in range(2):
        for t in range(6):
            scores = x[b, t] @ moe.gate.weight.T  # [E]
            best = sorted(range(cfg.num_experts), key=lambda e: -scores[e].item())[:cfg.num_experts_per_tok]
            weights = torch.softmax(scores[best], dim=0)
            expected = sum(wt * swiglu(x[b, t], moe.fc1[e], moe.fc2[e], moe.fc3[e]) for wt, e in zip(weights, best))
            torch.testing.assert_close(out[b, t], expected, **CLOSE)


@torch.no_grad()
def test_every_expert_chosen_is_the_dense_softmax_mixture():
    cfg = dataclasses.replace(CONFIGS["moe"], num_experts_per_tok=4)
    torch.manual_seed(12)
    moe = MoEFeedForward(cfg)
    x = torch.randn(2, 6, TINY["emb_dim"])
    gates = torch.softmax(x @ moe.gate.weight.T, dim=-1)  # [b, t, E]
    expected = sum(gates[..., e:e + 1] * swiglu(x, moe.fc1[e], moe.fc2[e], moe.fc3[e]) for e in range(4))
    torch.testing.assert_close(moe(x), expected, **CLOSE)


@pytest.mark.parametrize("cfg, words", [
    (lambda: GQAConfig(**TINY, n_kv_groups=3), "n_kv_groups must divide n_heads (4), got 3"),
    (lambda: MLAConfig(**TINY, latent_dim=0), "latent_dim must be a positive integer, got 0"),
    (lambda: SWAConfig(**TINY, sliding_window_size=0), "sliding_window_size must be a positive integer, got 0"),
    (lambda: MoEConfig(**TINY, num_experts=4, num_experts_per_tok=5), "num_experts_per_tok must be between 1 and"),
    (lambda: MoEConfig(**TINY, num_experts=0), "num_experts must be a positive integer, got 0"),
])
def test_a_config_that_cannot_be_built_is_refused_naming_the_field(cfg, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        cfg()


# --- KV-cache bytes: the repository's estimators, and what the cache holds ---------------------------

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}  # the estimators' table
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
          "int8": torch.int8}


# ch04/04_gqa/memory_estimator_gqa.py (and 05_mla's, the same function), quoted:
def calc_kv_bytes_total(batch, context_length, emb_dim, n_heads,
                        n_kv_heads, n_layers, bytes_per_elem):
    head_dim = math.ceil(emb_dim / n_heads)
    per_layer = batch * context_length * head_dim * n_kv_heads * 2 * bytes_per_elem
    return per_layer * n_layers


# ch04/05_mla/memory_estimator_mla.py, quoted:
def calc_mla_bytes_total(batch, context_length, n_layers, latent_dim, bytes_per_elem):
    # Simple MLA (per-token compressed latent)
    # bytes ≈ batch × seqlen × n_layers × latent_dim × bytes_per_elem
    return batch * context_length * n_layers * latent_dim * bytes_per_elem


# ch04/06_swa/memory_estimator_swa.py, quoted (estimate_totals' "total_mixed_mha", MHA with SWA):
def calc_kv_bytes_per_layer(batch, context_length, head_dim, n_kv_heads, bytes_per_elem):
    # KV = batch * tokens * head_dim * n_kv_heads * 2 (K,V) * bytes
    return batch * context_length * head_dim * n_kv_heads * 2 * bytes_per_elem


def distribute_layers(n_layers, a, b):
    block = a + b
    blocks = n_layers // block
    rem = n_layers % block
    swa = blocks * a + min(a, rem)
    full = blocks * b + max(0, rem - a)
    return swa, full


def swa_estimate(batch, context_length, sliding_window_size, emb_dim, n_heads, n_layers, bytes_per_elem, a, b):
    head_dim = math.ceil(emb_dim / n_heads)
    n_swa_layers, n_full_layers = distribute_layers(n_layers, a, b)
    eff_W = min(context_length, sliding_window_size)
    per_mha_full = calc_kv_bytes_per_layer(batch, context_length, head_dim, n_heads, bytes_per_elem)
    per_mha_swa = calc_kv_bytes_per_layer(batch, eff_W, head_dim, n_heads, bytes_per_elem)
    return n_swa_layers * per_mha_swa + n_full_layers * per_mha_full


# ch04/07_moe/memory_estimator_moe.py, quoted (ffn_type "swiglu": 3 matrices; match_dense False):
def estimate_moe_params(emb_dim, hidden_dim, num_experts, top_k):
    per_expert_params = 3 * emb_dim * hidden_dim           # calc_ffn_params(emb_dim, moe_hidden_dim, "swiglu")
    R = emb_dim * num_experts                               # calc_router_params
    moe_total = num_experts * per_expert_params + R
    moe_active_params_per_token = R + top_k * per_expert_params
    return per_expert_params, R, moe_total, moe_active_params_per_token


SHAPES = [  # (emb_dim, n_heads, n_layers, context_length): GPT-2 124M, gpt2-medium's width, the GQA README's
    (768, 12, 12, 1024), (1024, 16, 24, 1024), (4096, 32, 32, 32768)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("emb_dim, n_heads, n_layers, ctx", SHAPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_kv_cache_bytes_equal_the_repositorys_estimator_formulas(dtype, emb_dim, n_heads, n_layers, ctx, batch):
    shape = dict(emb_dim=emb_dim, n_heads=n_heads, n_layers=n_layers, context_length=ctx)
    elem, torch_dtype = DTYPE_BYTES[dtype], DTYPES[dtype]
    mha = calc_kv_bytes_total(batch, ctx, emb_dim, n_heads, n_heads, n_layers, elem)
    assert kv_cache_bytes(GPTConfig(**shape), torch_dtype, ctx, batch) == mha
    assert kv_cache_bytes(MoEConfig(**shape), torch_dtype, ctx, batch) == mha  # experts leave attention as it is
    for groups in (1, 2, 4):
        # the cache holds n_kv_groups key/value heads (the model's meaning; the estimator's main() passes
        # n_heads // n_kv_groups instead: see docs/variants.md)
        assert kv_cache_bytes(GQAConfig(**shape, n_kv_groups=groups), torch_dtype, ctx, batch) == \
            calc_kv_bytes_total(batch, ctx, emb_dim, n_heads, groups, n_layers, elem)
    for latent in (None, 512):
        cfg = MLAConfig(**shape, latent_dim=latent)
        assert kv_cache_bytes(cfg, torch_dtype, ctx, batch) == \
            calc_mla_bytes_total(batch, ctx, n_layers, cfg.latent_dim, elem)
    for window, stride in [(256, 2), (128, 5), (4096, 1), (512, -1), (512, 0)]:
        a, b = (stride, 1) if stride > 0 else ((1, 0) if stride < 0 else (0, 1))  # K:1, all windows, none
        cfg = SWAConfig(**shape, sliding_window_size=window, sliding_window_stride=stride)
        assert kv_cache_bytes(cfg, torch_dtype, ctx, batch) == \
            swa_estimate(batch, ctx, window, emb_dim, n_heads, n_layers, elem, a, b)


def test_the_figures_reproduce_the_repositorys_published_totals():
    # ch04/04_gqa/README.md: emb_dim 4096, 32 heads, 32 layers, 32,768 tokens, bf16: "MHA total KV cache :
    # 17.18 GB", "GQA total KV cache : 4.29 GB" (the estimator's --n_kv_groups 4: 32 // 4 = 8 key/value heads)
    shape = dict(emb_dim=4096, n_heads=32, n_layers=32, context_length=32768)
    assert f"{kv_cache_bytes(GPTConfig(**shape), torch.bfloat16, 32768) / 1000**3:,.2f}" == "17.18"
    assert f"{kv_cache_bytes(GQAConfig(**shape, n_kv_groups=8), torch.bfloat16, 32768) / 1000**3:,.2f}" == "4.29"
    # ch04/05_mla/README.md: 8,192 tokens, 48 layers, latent_dim 1024, bf16: "MLA total KV cache : 0.81 GB"
    mla = MLAConfig(emb_dim=2048, n_heads=16, n_layers=48, context_length=8192, latent_dim=1024)
    assert f"{kv_cache_bytes(mla, torch.bfloat16, 8192) / 1000**3:,.2f}" == "0.81"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CONFIGS)
@torch.no_grad()
def test_kv_cache_bytes_equal_what_the_cache_holds(name, dtype):
    model = tiny(name).to(dtype)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(13))
    for i in range(9):  # one token at a time: the window layers' caches stop growing at 4
        model(ids[:, i:i + 1], use_cache=True)
        held = sum(t.nbytes for t in cache_tensors(model))
        assert held == kv_cache_bytes(CONFIGS[name], dtype, i + 1, batch_size=2), f"after {i + 1} tokens"


def test_kv_bytes_per_token_at_gpt2_124m_shape_beside_gpt2s():
    shape = dict(emb_dim=768, n_heads=12, n_layers=12, context_length=1024)
    figures = {name: kv_bytes_per_token(cfg, torch.bfloat16) for name, cfg in {
        "gpt2": GPTConfig(**shape), "gqa": GQAConfig(**shape, n_kv_groups=4), "mla": MLAConfig(**shape),
        "swa": SWAConfig(**shape, sliding_window_size=256, sliding_window_stride=2),
        "moe": MoEConfig(**shape)}.items()}
    # 2 (k, v) x 12 layers x 768 x 2 bytes; g/h = 1/3 of it; 12 layers x 96 latents x 2 bytes; 4 full layers
    # and 8 of a 256-token window over 1,024 tokens: (4 + 8/4) / 12 of GPT-2's; the experts keep GPT-2's
    assert figures == {"gpt2": 36864, "gqa": 12288, "mla": 2304, "swa": 18432, "moe": 36864}


def test_the_variants_page_shows_the_figures_the_functions_give():
    page = (Path(__file__).resolve().parents[1] / "docs" / "variants.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `(\w+)`.*?\| ([\d,]+) \|", page, re.M))
    shape = dict(emb_dim=768, n_heads=12, n_layers=12, context_length=1024)
    expected = {"gpt2": GPTConfig(**shape), "gqa": GQAConfig(**shape, n_kv_groups=4), "mla": MLAConfig(**shape),
                "swa": SWAConfig(**shape, sliding_window_size=256, sliding_window_stride=2), "moe": MoEConfig(**shape)}
    assert {k: int(v.replace(",", "")) for k, v in rows.items()} == \
        {k: int(kv_bytes_per_token(cfg, torch.bfloat16)) for k, cfg in expected.items()}


@pytest.mark.parametrize("emb_dim, hidden_dim, experts, top_k", [(768, 3072, 8, 2), (7168, 1792, 8, 2), (32, 24, 4, 1)])
def test_moe_parameters_equal_the_estimator_and_the_module(emb_dim, hidden_dim, experts, top_k):
    cfg = MoEConfig(emb_dim=emb_dim, n_heads=4, num_experts=experts, num_experts_per_tok=top_k, hidden_dim=hidden_dim)
    per_expert, router, total, active = estimate_moe_params(emb_dim, hidden_dim, experts, top_k)
    assert ff_parameters(cfg) == {"per_expert": per_expert, "router": router, "total": total,
                                  "active_per_token": active}
    if emb_dim <= 768:  # the module itself (7168 x 1792 x 24 matrices would take 1.2 GB)
        assert sum(p.numel() for p in MoEFeedForward(cfg).parameters()) == total


# The tensors of block 0 that the repository's scripts make, as their source builds them (emb_dim 32, 4 heads,
# qkv_bias False, GPT_CONFIG_124M's choice): a state dict their GPTModel saved loads into these strictly.
REPOSITORY_ATTENTION = {
    "gqa": {"W_key.weight": [16, 32], "W_value.weight": [16, 32], "W_query.weight": [32, 32],  # n_kv_groups 2
            "out_proj.weight": [32, 32]},  # (no bias: nn.Linear(d_out, d_out, bias=False))
    "mla": {"W_query.weight": [32, 32], "W_DKV.weight": [8, 32], "W_UK.weight": [32, 8], "W_UV.weight": [32, 8],
            "out_proj.weight": [32, 32], "out_proj.bias": [32]},  # latent_dim 8
    "swa": {"W_query.weight": [32, 32], "W_key.weight": [32, 32], "W_value.weight": [32, 32],
            "out_proj.weight": [32, 32], "out_proj.bias": [32]},
}
SHAPE_ONLY = dict(vocab_size=101, context_length=32, emb_dim=32, n_heads=4, n_layers=1)


@pytest.mark.parametrize("name, cfg", [("gqa", GQAConfig(**SHAPE_ONLY, n_kv_groups=2)),
                                       ("mla", MLAConfig(**SHAPE_ONLY, latent_dim=8)),
                                       ("swa", SWAConfig(**SHAPE_ONLY, sliding_window_size=4))])
def test_the_attention_tensors_have_the_repositorys_names_and_shapes(name, cfg):
    state = build_model(cfg).state_dict()
    att = {k.removeprefix("trf_blocks.0.att."): list(v.shape) for k, v in state.items() if ".att." in k}
    assert att == REPOSITORY_ATTENTION[name]
    assert "out_head.weight" in state and state["out_head.weight"].data_ptr() != state["tok_emb.weight"].data_ptr()


def test_the_experts_have_the_repositorys_names_and_shapes():
    state = build_model(MoEConfig(**SHAPE_ONLY, num_experts=2, hidden_dim=24)).state_dict()
    ff = {k.removeprefix("trf_blocks.0.ff."): list(v.shape) for k, v in state.items() if ".ff." in k}
    assert ff == {"gate.weight": [2, 32], "fc1.0.weight": [24, 32], "fc1.1.weight": [24, 32],
                  "fc2.0.weight": [24, 32], "fc2.1.weight": [24, 32], "fc3.0.weight": [32, 24],
                  "fc3.1.weight": [32, 24]}


@pytest.mark.parametrize("name", CONFIGS)
def test_glassgpt_generate_greedy_gives_the_repositorys_cached_and_uncached_tokens(name):
    # the variant's own cache (reset_kv_cache, use_cache=True) through generate's loop, against the
    # repository's loop with and without it; exact: the same forward calls on the same tokens
    import glassgpt

    model = tiny(name)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    want = generate_text_simple_cached(model, prompt, 20)
    assert torch.equal(want, generate_text_simple_cached(model, prompt, 20, use_cache=False))
    assert torch.equal(glassgpt.generate(model, prompt, 20), want)
    assert torch.equal(glassgpt.generate(model, prompt, 20, use_cache=False), want)


@pytest.mark.parametrize("name", CONFIGS)
def test_glassgpt_generate_sampled_draws_the_same_tokens_with_and_without_the_cache(name):
    import glassgpt

    model = tiny(name)
    kw = dict(temperature=1.5, top_k=20, seed=7)
    cached = glassgpt.generate(model, [1, 2, 3], 20, **kw)
    assert torch.equal(cached, glassgpt.generate(model, [1, 2, 3], 20, use_cache=False, **kw))
    assert not torch.equal(cached, glassgpt.generate(model, [1, 2, 3], 20))  # sampled, not greedy (seed 7, 1.5)


@pytest.mark.parametrize("name", CONFIGS)
def test_glassgpt_generate_past_the_context_slides_its_window_as_the_uncached_loop(name):
    import glassgpt

    model = tiny(name)  # context_length 32: 10 + 40 tokens refill the cache with the last 32 past it
    prompt = torch.randint(0, TINY["vocab_size"], (1, 10), generator=torch.Generator().manual_seed(4))
    assert torch.equal(glassgpt.generate(model, prompt, 40), glassgpt.generate(model, prompt, 40, use_cache=False))


def test_the_sliding_window_cache_stays_trimmed_to_its_window_while_generate_runs():
    from glassgpt.generate import stream

    model = tiny("swa")  # window 4 in layers 0 and 1, layer 2 full
    held = []
    for _ in stream(model, [1, 2, 3, 4, 5, 6], 12):
        held.append([block.att.cache_k.shape[2] for block in model.trf_blocks])
    # after the prompt (6) and each decoded token: the window layers keep 4, the full layer all it was fed
    assert held == [[4, 4, 6 + j] for j in range(12)]
    assert all(block.att.cache_v.shape[2] == (4 if block.att.sliding_window_size else 17) for block in model.trf_blocks)


def test_a_model_with_its_own_forward_but_no_cache_reset_is_refused_in_one_line_with_use_cache():
    import glassgpt

    model = tiny("gqa")
    model.reset_kv_cache = None  # a reader's copy without the repository's reset
    with pytest.raises(glassgpt.GlassError, match=r"no reset_kv_cache\(\).*use_cache=False") as err:
        glassgpt.generate(model, [1, 2, 3], 4)
    assert "\n" not in str(err.value)
    assert glassgpt.generate(model, [1, 2, 3], 4, use_cache=False).shape == (1, 7)


# --- the description (anatomy.py): what each variant file says it is made of --------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_each_variant_describes_itself_and_the_description_agrees_with_its_module(name):
    from helpers import check_description

    anatomy = check_description(tiny(name))
    assert anatomy.positions.kind == "learned" and anatomy.n_layers == 3 and name in VARIANT_NAMES[anatomy.name]


VARIANT_NAMES = {"GPT-2 with grouped-query attention": "gqa", "GPT-2 with multi-head latent attention": "mla",
                 "GPT-2 with sliding-window attention": "swa", "GPT-2 with a mixture of experts": "moe"}


def test_the_descriptions_say_what_each_variant_changes():
    import glassgpt

    gqa, mla, swa, moe = (glassgpt.describe(tiny(n)).blocks for n in ("gqa", "mla", "swa", "moe"))
    assert [(b.attention.n_heads, b.attention.n_kv_groups, b.attention.key.out_features) for b in gqa] == [(4, 2, 16)] * 3
    assert [(b.attention.latent.path, b.attention.latent.out_features, b.attention.key.in_features) for b in mla] == \
        [(f"trf_blocks.{i}.att.W_DKV", 8, 8) for i in range(3)]
    assert [b.attention.window for b in swa] == layer_windows(CONFIGS["swa"]) == [4, 4, None]
    assert [b.layer_type for b in swa] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert [(b.ff.kind, b.ff.experts.n_experts, b.ff.experts.per_token, b.ff.experts.router.path) for b in moe] == \
        [("moe", 4, 2, f"trf_blocks.{i}.ff.gate") for i in range(3)]
    # GPT-2's parts are kept where the variant changes nothing
    assert all(b.attention.n_kv_groups == 4 and b.attention.latent is None for b in (*swa, *moe))
    assert all(b.ff.kind == "gelu_mlp" for b in (*gqa, *mla, *swa))


@pytest.mark.parametrize("name, part", [("gqa", "W_key"), ("mla", "W_DKV"), ("moe", "gate")])
def test_a_description_that_disagrees_with_its_variant_is_named_by_the_part(name, part):
    from glassgpt.kinds import description_mismatches
    import glassgpt

    model = tiny(name)
    anatomy = glassgpt.describe(model)
    holder = model.trf_blocks[1].att if part != "gate" else model.trf_blocks[1].ff
    setattr(holder, part, torch.nn.Linear(32, 5, bias=False))
    assert any(f"trf_blocks.1." in line and part in line for line in description_mismatches(model, anatomy))


# --- glassgpt.check: the cache against no cache ----------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
def test_check_finds_each_variants_cache_changes_nothing(name):
    import glassgpt

    result = glassgpt.check(tiny(name))
    assert result.ok and result.mistake is None and "your cache changes nothing" in result.finding


class _TrimmedTooFar(MultiHeadAttentionWithSWA):
    """A planted mistake: the cache keeps W - 1 keys and the new token attends over the cache alone."""

    def update(self, k_new, v_new):
        from glassgpt.variants.base import append_to_cache

        k, v = append_to_cache(self, k_new, v_new)
        self.cache_k, self.cache_v = k[:, :, -(self.sliding_window_size - 1):], v[:, :, -(self.sliding_window_size - 1):]
        return self.cache_k, self.cache_v


class _NeverTrimmed(MultiHeadAttentionWithSWA):
    """A planted mistake: the cache grows with the text and the window's mask is left out."""

    def update(self, k_new, v_new):
        from glassgpt.variants.base import append_to_cache

        return append_to_cache(self, k_new, v_new)

    def attend(self, q, k, v):
        return MultiHeadAttention.attend(self, q, k, v) if k.shape[2] != q.shape[2] else super().attend(q, k, v)


@pytest.mark.parametrize("planted, words", [
    (_TrimmedTooFar, "reads 3 keys where it should read 4, fewer than its window holds: the cache is trimmed too far"),
    (_NeverTrimmed, "reads 5 keys where it should read 4, more than its window holds: the cache is not trimmed to "
                    "the window"),
])
def test_check_names_a_sliding_window_cache_trimmed_wrongly(planted, words):
    import glassgpt

    model = tiny("swa")
    for block, window in zip(model.trf_blocks, layer_windows(CONFIGS["swa"])):
        if window is None:
            continue  # the full layer keeps every key, rightly
        old = block.att
        block.att = planted(CONFIGS["swa"], window)
        block.att.load_state_dict(old.state_dict())
    result = glassgpt.check(model)
    assert not result.ok
    assert result.prop == "window_trimming" and words in result.finding, result.to_text()


def test_the_cli_checks_a_readers_variant_file_and_names_a_window_trimmed_too_far(tmp_path, capsys):
    from glassgpt.cli import main

    (tmp_path / "my_swa.py").write_text(
        "import torch\nfrom glassgpt.variants import SWAConfig, build_model\nfrom glassgpt.variants import swa\n"
        "from glassgpt.variants.base import append_to_cache\n\n"
        "CFG = SWAConfig(vocab_size=101, context_length=32, emb_dim=32, n_heads=4, n_layers=3, sliding_window_size=4)\n"
        "torch.manual_seed(0)\nright = build_model(CFG)\n\n\n"
        "class Trimmed(swa.MultiHeadAttentionWithSWA):\n"
        "    def update(self, k_new, v_new):\n"
        "        k, v = append_to_cache(self, k_new, v_new)\n"
        "        self.cache_k, self.cache_v = k[:, :, -3:], v[:, :, -3:]  # keeps W - 1\n"
        "        return self.cache_k, self.cache_v\n\n\n"
        "wrong = build_model(CFG)\nfor blk in wrong.trf_blocks:\n"
        "    if blk.att.sliding_window_size:\n        blk.att.__class__ = Trimmed\n")
    assert main(["check", f"{tmp_path / 'my_swa.py'}:right"]) == 0
    assert "your cache changes nothing" in capsys.readouterr().out
    assert main(["check", f"{tmp_path / 'my_swa.py'}:wrong"]) == 1
    assert "whose window is 4, reads 3 keys where it should read 4" in capsys.readouterr().out


# --- glassgpt.trace: the GPT-2 trace, reading what each description changes ------------------------

def char_variant(name: str) -> torch.nn.Module:
    from helpers import CHAR_TOK

    torch.manual_seed(0)
    return build_model(dataclasses.replace(CONFIGS[name], vocab_size=CHAR_TOK.n_vocab)).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_the_trace_of_each_variant_gives_its_own_next_token(name):
    import glassgpt
    from helpers import CHAR_TEXT, CHAR_TOK

    model = char_variant(name)
    result = glassgpt.trace(model, CHAR_TOK, CHAR_TEXT)
    own = model(torch.tensor([CHAR_TOK.encode(CHAR_TEXT)]))[0, -1]
    assert result.next_token["id"] == int(own.argmax())
    assert result.params["total"] == sum(p.numel() for p in model.parameters())


def test_the_trace_shows_what_each_variant_changes():
    import glassgpt
    from helpers import CHAR_TEXT, CHAR_TOK

    t = len(CHAR_TOK.encode(CHAR_TEXT))
    gqa, mla, swa, moe = (glassgpt.trace(char_variant(n), CHAR_TOK, CHAR_TEXT) for n in ("gqa", "mla", "swa", "moe"))
    assert gqa.stage("trf_blocks.0.att.kv_heads").shape == [1, 2, t, 8]  # [b, g, t, hd]
    assert gqa.stage("trf_blocks.0.att.W_key").shape == [1, t, 16]
    assert mla.stage("trf_blocks.0.att.W_DKV").shape == [1, t, 8]  # the latent [b, t, c]
    assert mla.stage("trf_blocks.0.att.W_UK").input_shape == [1, t, 8]
    assert "window 4" in swa.stage("trf_blocks.0.att.attn_weights").module
    assert moe.stage("trf_blocks.0.ff.gate").shape == [1, t, 4] and moe.stage("trf_blocks.0.ff.routing").shape == [1, t, 2]
    for result, name in ((gqa, "gqa"), (mla, "mla"), (swa, "swa"), (moe, "moe")):
        mine = kv_bytes_per_token(CONFIGS[name], torch.float32)
        gpt2 = kv_bytes_per_token(gpt2_config(CONFIGS[name]), torch.float32)
        assert f"KV cache: {mine:,.0f} bytes per token (float32, at 32 tokens) where GPT-2 of this shape keeps " \
               f"{gpt2:,.0f}" in " ".join(result.notes)


def test_the_traced_window_layers_attend_only_inside_their_window_as_the_model_does():
    import glassgpt
    from glassgpt.explain import TraceOptions
    from helpers import CHAR_TEXT, CHAR_TOK

    model = char_variant("swa")
    result = glassgpt.trace(model, CHAR_TOK, CHAR_TEXT, options=TraceOptions(attention=True))
    layers = torch.tensor(result.attention["layers"])  # [n_layers, h, t, t]
    t = layers.shape[-1]
    pos = torch.arange(t)
    too_old = (pos[:, None] - pos[None, :]) >= 4
    assert (layers[0][:, too_old] == 0).all() and (layers[1][:, too_old] == 0).all()
    assert (layers[2][:, too_old] > 0).any()  # the full layer sees past the window
    # the traced weights reproduce the module's own: its softmax over the window, on the same q and k
    from glassgpt.variants.swa import window_attention_weights
    x = model.trf_blocks[0].norm1(model.tok_emb(torch.tensor([CHAR_TOK.encode(CHAR_TEXT)])) + model.pos_emb.weight[:t])
    att = model.trf_blocks[0].att
    q, k = (w(x).view(1, t, 4, 8).transpose(1, 2) for w in (att.W_query, att.W_key))
    torch.testing.assert_close(layers[0], window_attention_weights(q, k, 4)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CONFIGS)
def test_why_splits_a_variants_logit_through_its_own_attention_rather_than_as_gpt2(name):
    import glassgpt
    from helpers import CHAR_TEXT, CHAR_TOK

    model = char_variant(name)
    w = glassgpt.why(model, CHAR_TOK, CHAR_TEXT)
    with torch.no_grad():
        logits = model(torch.tensor([CHAR_TOK.encode(CHAR_TEXT)]))[0, -1]
    a = int(logits.argmax())
    assert w.target["id"] == a and abs(w.total - float(logits[a])) <= 1e-4 * max(1.0, abs(float(logits[a])))
    names = {p["name"] for p in w.parts}
    assert {"tok_emb", "pos_emb"} <= names  # GPT-2's base: learned positions
    out_bias = model.trf_blocks[0].att.out_proj.bias is not None  # out_proj's bias, where it has one, a part
    assert ("trf_blocks.0.att.bias" in names) == out_bias
    assert any(".ff.expert." in n for n in names) == (name == "moe")
