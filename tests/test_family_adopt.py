"""adopt() of the book's Qwen3Model and Llama3Model (plain, KV-cache and batched KV-cache files) and of
transformers' Qwen3ForCausalLM / LlamaForCausalLM: read in place, nothing copied, their own logits.

Tolerances: the book's classes bit for bit in float32 (torch.equal: the glass formulas are the book's,
operation for operation); transformers' within 1e-5 (its RMSNorm and RoPE order the products otherwise).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import llms_from_scratch.kv_cache.generate as book_kv_generate
import llms_from_scratch.kv_cache.llama3 as book_kv_llama
import llms_from_scratch.kv_cache.qwen3 as book_kv_qwen
import llms_from_scratch.kv_cache_batched.generate as book_batched_generate
import llms_from_scratch.kv_cache_batched.qwen3 as book_batched_qwen
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt.adopt import adopt, adopted_from
from glassgpt.errors import GlassError
from glassgpt.families import Llama3Model, Qwen3Model
from glassgpt.generate import generate

from conftest import needs_kernels
from helpers import TINY, ids, randomize_, transformers_config

BOOK_CLASSES = {
    "qwen3": book_qwen.Qwen3Model, "llama3": book_llama.Llama3Model,
    "kv_cache.qwen3": book_kv_qwen.Qwen3Model, "kv_cache.llama3": book_kv_llama.Llama3Model,
    "kv_cache_batched.qwen3": book_batched_qwen.Qwen3Model,
}


def family_of(kind: str) -> str:
    return kind.rpartition(".")[2]


def book_module(kind: str, tie: bool = False, seed: int = 0) -> nn.Module:
    cfg = TINY[family_of(kind)]
    torch.manual_seed(seed)
    module = BOOK_CLASSES[kind](cfg.to_book_dict(torch.float32))
    if tie:
        module.out_head.weight = module.tok_emb.weight  # the published models' tie: one Parameter
    return randomize_(module, seed)


def hf_module(family: str, tie: bool = False) -> nn.Module:
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM
    cfg = dataclasses.replace(TINY[family], tie_embeddings=tie)
    torch.manual_seed(0)
    cls = Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM
    return randomize_(cls(transformers_config(family, cfg)))


def own_logits(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = module(x)
    return getattr(out, "logits", out)


def pointers(module: nn.Module) -> set[int]:
    return {p.data_ptr() for p in module.parameters()}


@pytest.mark.parametrize("kind", list(BOOK_CLASSES))
@pytest.mark.parametrize("tie", [False, True])
def test_the_books_classes_are_read_in_place_and_give_their_logits_bit_for_bit(kind, tie):
    module = book_module(kind, tie)
    glass = adopt(module, ids())
    assert isinstance(glass, Qwen3Model if family_of(kind) == "qwen3" else Llama3Model)
    assert pointers(glass) == pointers(module)  # every adopted weight is the module's own storage
    assert glass.tied == tie and glass.cfg == dataclasses.replace(TINY[family_of(kind)], tie_embeddings=tie)
    with torch.no_grad():
        assert torch.equal(glass(ids()), own_logits(module, ids()))
    assert adopted_from(glass).startswith(f"the book's {type(module).__name__}")
    assert ("kv_cache" in adopted_from(glass)) == ("kv_cache" in kind)


@pytest.mark.parametrize("family", list(TINY))
@pytest.mark.parametrize("tie", [False, True])
def test_transformers_modules_are_read_in_place_and_give_their_logits(family, tie):
    module = hf_module(family, tie).eval()
    glass = adopt(module, ids())
    assert pointers(glass) == pointers(module)
    assert glass.tied == tie and glass.cfg == dataclasses.replace(TINY[family], tie_embeddings=tie)
    with torch.no_grad():
        torch.testing.assert_close(glass(ids()), own_logits(module, ids()), rtol=0, atol=1e-5)
    assert adopted_from(glass).startswith(f"transformers' {type(module).__name__}")


def test_the_adopted_model_sees_the_modules_weights_as_they_change():
    module = book_module("qwen3")
    glass = adopt(module, ids())
    with torch.no_grad():
        module.trf_blocks[1].ff.fc2.weight.mul_(-1.5)
        assert torch.equal(glass(ids()), own_logits(module, ids()))


def test_a_head_the_books_loader_copied_is_adopted_as_its_own_head_not_a_tie():
    module = book_module("llama3")
    with torch.no_grad():
        module.out_head.weight.copy_(module.tok_emb.weight)  # equal values, two storages
    glass = adopt(module, ids())
    assert not glass.tied and "own head" in adopted_from(glass)


def test_a_module_whose_forward_is_not_what_its_config_says_is_refused_in_one_line():
    module = book_module("qwen3")
    module.cfg = {**module.cfg, "rope_base": 20_000.0}  # its cos/sin tables were made with 10,000
    with pytest.raises(GlassError, match=r"does not give its logits .* run glassgpt.check\(model\)") as e:
        adopt(module, ids())
    assert "\n" not in str(e.value)


def test_a_module_whose_tensors_disagree_with_its_heads_is_refused_in_one_line():
    module = book_module("llama3")
    module.trf_blocks[0].att.num_kv_groups = 4  # W_key holds 2 groups of 8
    with pytest.raises(GlassError, match=r"W_key.weight is \[16, 32\] but its config wants \[32, 32\]"):
        adopt(module, ids())


@pytest.mark.parametrize("kind", ["kv_cache.qwen3", "kv_cache.llama3"])
def test_greedy_tokens_with_glassgpts_kv_cache_equal_the_books_kv_cache_code(kind):
    module = book_module(kind, seed=5)
    prompt = ids(6, seed=7)[:1]
    n = 12  # 6 + 12 < context_length 24: the book's cache code has no window
    theirs = book_kv_generate.generate_text_simple(module, prompt, n)
    assert torch.equal(generate(module, prompt, n), theirs)  # the module itself, adopted in place
    glass = adopt(module)
    assert torch.equal(generate(glass, prompt, n), theirs)


def test_greedy_tokens_at_batch_2_equal_the_books_batched_kv_cache_code():
    module = book_module("kv_cache_batched.qwen3", seed=5)
    prompt = ids(6, seed=7)
    theirs = book_batched_generate.generate_text_simple(module, prompt, 10)
    assert torch.equal(generate(module, prompt, 10), theirs)


def test_generation_feeds_one_token_per_step_through_the_cache_and_never_remakes_ropes_tables(monkeypatch):
    import glassgpt.families.layers as layers
    import glassgpt.families.qwen3 as qwen3
    glass = adopt(book_module("kv_cache.qwen3", seed=5))
    seen = []
    glass.tok_emb.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    for module in (layers, qwen3):  # made once, when the model was built; generation only slices them
        monkeypatch.setattr(module, "compute_rope_params", lambda *a, **k: pytest.fail("RoPE's tables made again"))
    import glassgpt.engine.decode as decode
    from glassgpt.engine.step import RopeStep
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: False)
    generate(glass, ids(6, seed=7)[:1], 5)
    assert seen == [6, 1, 1, 1, 1]  # the prompt once, then each new token alone: the cache is used
    # The native step (engine/step.py's RopeStep) too: the prompt through the model, then one id per call.
    needs_kernels()
    seen.clear()
    fed = []
    real_call = RopeStep.__call__
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: True)
    monkeypatch.setattr(RopeStep, "__call__", lambda self, x: fed.append(x.numel()) or real_call(self, x))
    generate(glass, ids(6, seed=7)[:1], 5)
    assert seen == [6] and fed == [1, 1, 1, 1]


@pytest.mark.parametrize("family", list(TINY))
def test_the_decoding_twin_shares_the_weights_and_gives_the_glass_models_logits(family):
    from glassgpt.engine import native
    from glassgpt.engine.decode import gemv_twin
    from glassgpt.engine.linear import GemvLinear
    from glassgpt import KVCache
    glass = adopt(book_module(family, tie=True))
    twin, _ = gemv_twin(glass)
    assert pointers(twin) == pointers(glass) and twin.tied  # nothing copied
    ops = native.gemv_ops()  # the whole kernels, or their AVX2 build of the float products
    for m in twin.modules():  # glassgpt's kernel on every layer, whichever won here
        if isinstance(m, GemvLinear) and ops is not None:
            m.gemv = ops.gemv
    x = ids(12)
    caches = [KVCache(glass.cfg, 2, 12), KVCache(glass.cfg, 2, 12)]
    with torch.no_grad():
        prompts = [m(x[:, :5], c) for m, c in zip((glass, twin), caches)]
        assert torch.equal(prompts[0], prompts[1])  # more than GEMV_MAX_ROWS rows: F.linear, as the glass model
        for i in range(5, 12):
            ours, twins = (m(x[:, i:i + 1], c) for m, c in zip((glass, twin), caches))
            torch.testing.assert_close(twins, ours, rtol=0, atol=1e-5)
