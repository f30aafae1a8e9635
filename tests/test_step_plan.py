"""The native step's plan is read from the model's description (engine/step.py): one step for every model.

These run on any CPU: a stand-in for glassgpt's library answers the scratch sizes, and nothing is stepped
(tests/test_step.py and tests/test_family_step.py step the real kernels where they load). What is checked is
what the kernels read: each plan field holds the address of the very tensor the C++ enums name
(kernels/step.cpp's and family_step.cpp's layouts, written here from the glass model's own attributes),
and a model neither plan computes is refused in one line naming the part that differs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glassgpt import GPTConfig
from glassgpt.engine import KVCache, native, quantize_int4, quantize_int8
from glassgpt.engine import step as plans
from glassgpt.families import build_model
from glassgpt.formats import random_model
from glassgpt.variants import GQAConfig, MLAConfig, MoEConfig, SWAConfig
from glassgpt.variants import build_model as build_variant

from helpers import TINY, V, randomize_, tiny_described
from glassgpt.engine.hybrid_cache import cache_for

GPT2 = GPTConfig(vocab_size=V, context_length=24, emb_dim=32, n_heads=4, n_layers=2)


class StandIn:
    """glassgpt's library as far as planning goes: the scratch each thread needs."""

    def gg_step_scratch_bytes(self, *args):
        return 256

    def gg_family_step_scratch_bytes(self, *args):
        return 256


@pytest.fixture
def library(monkeypatch):
    monkeypatch.setattr(native, "library", lambda: StandIn())


def ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def gpt2_of(precision: str):
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    model = random_model(GPT2, torch.device("cpu"), dtype)
    if precision == "int8":
        model = quantize_int8(model)
    elif precision == "int4":
        model = quantize_int4(model, group_size=32)
    return model.eval()


def weights(m) -> list[int]:
    """(weight, scales, bias) as kernels/step.cpp reads one Linear of each kind."""
    if hasattr(m, "packed"):
        return [ptr(m.packed), ptr(m.scales_mins), ptr(m.bias)]
    return [ptr(m.weight), ptr(getattr(m, "scales", None)), ptr(m.bias)]


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8", "int4"])
def test_gpt2s_plan_holds_the_tensors_step_cpp_reads(precision, library):
    model = gpt2_of(precision)
    cache = KVCache(GPT2, 2, 8, dtype=model.tok_emb.weight.dtype)
    assert plans.why_not(model, cache) is None
    step = plans.native_step(model, cache)
    assert type(step) is plans.NativeStep
    plan = step.plan.tolist()
    header = dict(zip(plans.HEADER_FIELDS, plan))
    assert (header["layers"], header["d"], header["heads"], header["vocab"], header["batch"]) == (2, 32, 4, V, 2)
    assert header["kind"] == plans.KINDS[precision]
    assert [header[f] for f in ("tok_emb", "pos_emb", "fn_scale", "fn_shift")] == [
        ptr(model.tok_emb.weight), ptr(model.pos_emb.weight), ptr(model.final_norm.scale), ptr(model.final_norm.shift)]
    assert [header["head_w"], header["head_s"], header["head_b"]] == weights(model.out_head)
    for i, block in enumerate(model.trf_blocks):
        fields = plan[plans.HEADER + i * plans.LAYER_FIELDS:plans.HEADER + (i + 1) * plans.LAYER_FIELDS]
        want = [ptr(block.norm1.scale), ptr(block.norm1.shift), ptr(block.norm2.scale), ptr(block.norm2.shift)]
        for m in (block.att.W_query, block.att.W_key, block.att.W_value, block.att.out_proj, block.ff.layers[0],
                  block.ff.layers[2]):
            want += weights(m)
        assert fields == want + [ptr(cache.k[i]), ptr(cache.v[i])], f"block {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["qwen3", "llama3", "tied"])
def test_ropes_plan_holds_the_tensors_family_step_cpp_reads(shape, dtype, library):
    cfg = dataclasses.replace(TINY["qwen3"], tie_embeddings=True) if shape == "tied" else TINY[shape]
    model = randomize_(build_model(cfg))
    model.tie_weights() if shape == "tied" else None
    model = model.to(dtype)
    cache = KVCache(cfg, 1, 8, dtype=dtype)
    step = plans.native_step(model, cache)
    assert type(step) is plans.RopeStep, plans.why_not(model, cache)
    plan = step.plan.tolist()
    header = dict(zip(plans.ROPE_HEADER_FIELDS, plan))
    hd = cfg.head_dim_value
    assert (header["layers"], header["d"], header["heads"], header["groups"], header["head_dim"], header["hidden"],
            header["vocab"]) == (2, 32, 4, 2, hd, 48, V)
    assert header["qk_norm"] == int(cfg.qk_norm)

    def weight(norm):  # the book's Qwen3 names it `scale`, its Llama 3 (torch.nn.RMSNorm) `weight`
        return norm.scale if hasattr(norm, "scale") else norm.weight
    assert [header[f] for f in ("tok_emb", "rope_cos", "rope_sin", "fn_scale", "head_w")] == [
        ptr(model.tok_emb.weight), ptr(model.rope.cos), ptr(model.rope.sin), ptr(weight(model.final_norm)),
        ptr(model.out_head.weight)]
    assert (header["head_w"] == header["tok_emb"]) == (shape == "tied")
    for i, block in enumerate(model.trf_blocks):
        att, ff = block.att, block.ff
        fields = plan[plans.ROPE_HEADER + i * plans.ROPE_LAYER_FIELDS:plans.ROPE_HEADER + (i + 1) * plans.ROPE_LAYER_FIELDS]
        want = [ptr(weight(block.norm1)), ptr(weight(block.norm2)),
                ptr(weight(att.q_norm)) if att.q_norm is not None else 0,
                ptr(weight(att.k_norm)) if att.k_norm is not None else 0]
        for m in (att.W_query, att.W_key, att.W_value, att.out_proj, ff.fc1, ff.fc2, ff.fc3):
            want += [ptr(m.weight), 0, 0]
        assert fields == want + [ptr(cache.k[i]), ptr(cache.v[i])], f"block {i}"


VARIANT = dict(vocab_size=V, context_length=24, emb_dim=32, n_heads=4, n_layers=2)


@pytest.mark.parametrize("case, words", [
    ("grouped-query attention (chapter 4)", "block 0's attention is not multi-head attention"),
    ("a sliding window (chapter 4)", "block 0's attention is not multi-head attention"),
    ("latent attention (chapter 4)", "block 0's attention has parts GPT-2's has not"),
    ("experts on GPT-2 (chapter 4)", "block 0's feed-forward is moe"),
    ("Gemma 4's per-layer inputs", "Gemma 4's embedding has per-layer embeddings"),
    ("a module glassgpt does not describe", "it runs the models glassgpt describes, not Linear"),
])
def test_a_model_no_plan_computes_is_refused_by_the_part_that_differs(case, words, library):
    cfg = None
    if case.startswith("grouped"):
        cfg = GQAConfig(**VARIANT, n_kv_groups=2)
    elif case.startswith("a sliding"):
        cfg = SWAConfig(**VARIANT, sliding_window_size=4, sliding_window_stride=2)
    elif case.startswith("latent"):
        cfg = MLAConfig(**VARIANT, latent_dim=8)
    elif case.startswith("experts on GPT-2"):
        cfg = MoEConfig(**VARIANT, num_experts=4, num_experts_per_tok=2, hidden_dim=24)
    if cfg is not None:
        model = build_variant(cfg).eval()
    elif case.startswith("Gemma 4"):
        from glassgpt.families import Gemma4Config
        cfg = Gemma4Config(vocab_size=50, emb_dim=16, hidden_dim=32, n_layers=2, n_heads=2, head_dim=8, n_kv_heads=1,
                           global_head_dim=16, context_length=64, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=50,
                           hidden_size_per_layer_input=4)
        model = build_model(cfg).eval()
    else:
        model, cfg = torch.nn.Linear(2, 2), GPT2
    cache = model.kv_cache(1, 8) if hasattr(model, "kv_cache") else cache_for(cfg, 1, 8)
    reason = plans.why_not(model, cache)
    assert reason is not None and words in reason and "\n" not in reason
    assert plans.native_step(model, cache) is None
