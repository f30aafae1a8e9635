"""transformers' Qwen3MoeForCausalLM (5.x) holds each block's experts fused, one gate_up_proj [E, 2m, d] and one
down_proj [E, d, m] tensor, where the MoE notebook's MoEFeedForward has an nn.Linear per expert (fc1, fc2, fc3).
glassgpt reads it in place: each expert's matrices are views of the fused tensors (adopt.py's _expert_views).

Tolerances: float32 logits within 1e-5 of the module's own (relative to the row's largest), the same sums in
another order (the router's softmax over all experts then renormalised, against the softmax over the chosen k).
"""

from __future__ import annotations

import pytest
import torch

import glassgpt

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_moe(vocab_size: int = 101, **overrides) -> torch.nn.Module:
    fields = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=64, norm_topk_prob=True) | overrides
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields)).eval()


def storages(module: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def test_the_module_holds_its_experts_fused():
    experts = tiny_moe().model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 48, 32) and experts.down_proj.shape == (4, 32, 24)
    assert not any(isinstance(m, torch.nn.Linear) for m in experts.modules())


@torch.no_grad()
def test_adopt_reads_the_fused_experts_in_place_and_computes_the_modules_logits():
    model = tiny_moe()
    glass = glassgpt.adopt(model)
    assert storages(glass) <= storages(model)  # every parameter a view of the module's storage: nothing copied
    fused = model.model.layers[1].mlp.experts
    ff = glass.trf_blocks[1].ff
    assert torch.equal(ff.fc1[3].weight, fused.gate_up_proj[3, :24]) and torch.equal(ff.fc2[3].weight,
                                                                                     fused.gate_up_proj[3, 24:])
    assert torch.equal(ff.fc3[3].weight, fused.down_proj[3])
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = model(ids).logits
    assert float((glass(ids) - theirs).abs().max()) <= 1e-5 * max(1.0, float(theirs.abs().max()))
    fused.gate_up_proj[2].mul_(2.0)  # an edit of the module's experts is the glass model's too
    assert torch.equal(ff.fc1[2].weight, fused.gate_up_proj[2, :24])


def test_describe_names_the_fused_experts_and_the_glass_paths():
    anatomy = glassgpt.describe(tiny_moe())
    assert anatomy.name == "Qwen3 MoE" and anatomy.blocks[0].ff.kind == "moe"
    assert anatomy.blocks[0].ff.experts.n_experts == 4 and anatomy.blocks[0].ff.experts.per_token == 2
    assert "fused experts" in anatomy.source and "glassgpt.adopt(model)" in anatomy.source


def test_the_trace_gives_the_modules_own_next_token():
    from helpers import CHAR_TEXT, CHAR_TOK

    model = tiny_moe(CHAR_TOK.n_vocab)
    result = glassgpt.trace(model, CHAR_TOK, CHAR_TEXT)
    with torch.no_grad():
        own = model(torch.tensor([CHAR_TOK.encode(CHAR_TEXT)])).logits[0, -1]
    assert result.next_token["id"] == int(own.argmax())


def test_generate_gives_transformers_greedy_tokens():
    model = tiny_moe()
    prompt = torch.tensor([[5, 17, 3, 42]])
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(glassgpt.generate(model, prompt, 10), want)


def test_routing_weights_not_renormalised_are_refused_in_one_line():
    with pytest.raises(glassgpt.GlassError, match="norm_topk_prob is false") as err:
        glassgpt.adopt(tiny_moe(norm_topk_prob=False))
    assert "\n" not in str(err.value)
