"""The twin's one-token linear attention (engine/linear_attention.py) against the glass Qwen3.5 (issue 48, point 6).

generate decodes Qwen3.5 through a twin of the glass model (engine/decode.py) whose linear attentions take one
token through OneTokenDeltaNet: the convolution as one multiply-sum, the gated delta rule in place on the cache's
state. Tiny random models, several consecutive tokens after a prompt, batch 2, with hv = hk and hv = 2 hk.

Tolerances, relative to the largest |value| of each row:
  - one module, float32: 5e-6 (the same float32 sums in another order: the decayed state read by one matmul, the
    output as S^T q + (q . k) delta; measured 1e-7 to 1.4e-6 over 35 tokens, the largest where the gated norm
    divides by a small rms); the state within 1e-6 of its largest entry; the convolution's inputs equal.
  - the whole twin, float32: 1e-5 of the row's largest logit (the twin's products are also glassgpt's gemv kernel
    where autotune chose it here: other sums again).
  - bfloat16: 1e-2 of the row's largest logit. Both sides compute the state in float32 and round the same
    tensors to bfloat16 (the convolution's output once, after a float32 sum, as the convolution library does);
    where a float32 difference of ~1e-7 meets a bfloat16 rounding boundary, one value moves by one step
    (2^-8 relative), and the few layers after carry it. Measured here: one module's output equal in 49 of 50
    tokens, the tiny model's logits equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

import glassgpt
from glassgpt.engine.decode import twin_steps
from glassgpt.engine.hybrid_cache import cache_for
from glassgpt.engine.linear_attention import OneTokenDeltaNet
from glassgpt.families import Qwen3_5Config, build_model
from glassgpt.families import qwen3_5
from glassgpt.families.qwen3_5 import Qwen3_5GatedDeltaNet

LINEAR, FULL = "linear_attention", "full_attention"
V = 300


def config(value_heads: int = 4) -> Qwen3_5Config:
    return Qwen3_5Config(family="qwen3_5", vocab_size=V, context_length=64, emb_dim=32, n_heads=4, n_layers=4,
                         hidden_dim=48, head_dim=8, n_kv_groups=2, rope_base=10_000.0, qk_norm=True,
                         linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
                         linear_num_key_heads=2, linear_num_value_heads=value_heads,
                         layer_types=(LINEAR, FULL, LINEAR, LINEAR))


def random_model(cfg: Qwen3_5Config, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved by N(0, 0.3): the decay, the step size and the norms off their initial values."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.to(dtype).eval()


def ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest |difference| of a row, over that row's largest |value|, worst row."""
    ours, theirs = ours.float().flatten(1), theirs.float().flatten(1)
    return float(((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max())


class Slot:
    """One linear layer's cache, as the glass module reads and writes it."""

    def __init__(self):
        self.conv = self.state = None

    def read(self):
        return self.conv, self.state

    def write(self, conv, state):
        self.conv, self.state = conv, state


def one_token_copy(module: Qwen3_5GatedDeltaNet) -> Qwen3_5GatedDeltaNet:
    """The module again over the same Parameters, with OneTokenDeltaNet's forward (its linears stay nn.Linear)."""
    twin = copy.copy(module)
    twin.__class__ = type("OneTokenDeltaNetUnderTest", (OneTokenDeltaNet, type(module)), {})
    return twin


@pytest.mark.parametrize("value_heads", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_step_equals_the_glass_modules_cached_step(dtype, value_heads):
    cfg = config(value_heads)
    glass = random_model(cfg, dtype).trf_blocks[0].token_mixer
    twin = one_token_copy(glass)
    x = torch.randn(2, 12, cfg.emb_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    glass_slot, twin_slot = Slot(), Slot()
    with torch.no_grad():
        glass(x[:, :5], glass_slot)
        twin(x[:, :5], twin_slot)  # the prompt: the glass forward on both
        for i in range(5, 12):
            theirs, ours = glass(x[:, i:i + 1], glass_slot), twin(x[:, i:i + 1], twin_slot)
            assert relative_error(ours, theirs) <= (5e-6 if dtype == torch.float32 else 1e-2), i
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
            assert torch.equal(twin_slot.conv, glass_slot.conv)  # the last kernel - 1 inputs, [b, c, kernel - 1]
            assert twin_slot.conv.shape == (2, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
            assert twin_slot.state.dtype == torch.float32 and twin_slot.state.shape == glass_slot.state.shape
            assert float((twin_slot.state - glass_slot.state).abs().max()) <= 1e-6 * float(
                glass_slot.state.abs().max()) * (1 if dtype == torch.float32 else 1e4)


def test_the_twins_linear_attentions_and_only_they_take_the_one_token_step():
    model = random_model(config())
    steps = twin_steps(model)
    kinds = [isinstance(block.token_mixer, OneTokenDeltaNet) for block in steps.twin.trf_blocks]
    assert kinds == [t == LINEAR for t in model.cfg.layer_types]
    assert not any(isinstance(m, OneTokenDeltaNet) for m in model.modules())  # the glass model keeps its own forward
    for glass, twin in zip(model.trf_blocks[2:], steps.twin.trf_blocks[2:]):  # two linear layers
        assert twin.token_mixer.in_proj_qkv.weight is glass.token_mixer.in_proj_qkv.weight  # the same Parameters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_twins_decoding_equals_the_glass_models_cached_step(dtype, monkeypatch):
    cfg = config()
    model = random_model(cfg, dtype)
    steps = twin_steps(model)
    batch = ids(2, 16)
    glass_cache, twin_cache = cache_for(cfg, 2, 16, dtype=dtype), cache_for(cfg, 2, 16, dtype=dtype)
    with torch.no_grad():
        model(batch[:, :6], glass_cache)
        glass = [model(batch[:, i:i + 1], glass_cache)[:, -1] for i in range(6, 16)]
        steps.prefill(batch[:, :6], twin_cache)

        def glass_delta_rule(*args, **kwargs):
            raise AssertionError("the twin's decoding step ran the glass gated_delta_rule")

        monkeypatch.setattr(qwen3_5, "gated_delta_rule", glass_delta_rule)  # fails where the one-token path is not used
        twin = [steps.decode_one(batch[:, i], twin_cache) for i in range(6, 16)]
    for i, (ours, theirs) in enumerate(zip(twin, glass)):
        assert relative_error(ours, theirs) <= (1e-5 if dtype == torch.float32 else 1e-2), i


@pytest.mark.parametrize("prompt_length", [1, 5])
def test_generate_greedy_equals_the_glass_models_uncached_greedy(prompt_length):
    model = random_model(config())
    prompt = ids(2, prompt_length, seed=3)
    out = glassgpt.generate(model, prompt, max_new_tokens=10)
    seq = prompt
    with torch.no_grad():
        for _ in range(10):  # no cache: the whole sequence through the glass model at every step
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_the_one_token_step_updates_the_caches_state_in_place_only_where_it_may():
    cfg = config()
    glass = random_model(cfg).trf_blocks[0].token_mixer
    twin = one_token_copy(glass)
    x = torch.randn(1, 6, cfg.emb_dim, generator=torch.Generator().manual_seed(4))
    slot = Slot()
    with torch.no_grad():
        twin(x[:, :3], slot)
        state = slot.state
        twin(x[:, 3:4], slot)
    assert slot.state is state  # the one-token step: the same tensor, updated
    out = twin(x[:, 4:5], slot)  # gradients on: the glass forward, a new state (the old one is in autograd's graph)
    assert out.requires_grad and slot.state is not state
    with torch.inference_mode():
        twin(x[:, :3], slot)  # a state made in inference mode ...
    with torch.no_grad():
        state = slot.state
        twin(x[:, 3:4], slot)  # ... cannot change outside it: the glass forward
    assert slot.state is not state  # (updating it in place would raise)


def test_the_glass_model_goes_on_from_a_cache_the_twin_wrote():
    """read() and write() keep their meaning: after the twin's one-token steps, the glass model reads the cache's
    convolution inputs (a view of the twin's window) and state, and continues as if it had written them."""
    cfg = config()
    model = random_model(cfg)
    steps = twin_steps(model)
    batch = ids(2, 14, seed=5)
    glass_cache, twin_cache = cache_for(cfg, 2, 14), cache_for(cfg, 2, 14)
    with torch.no_grad():
        model(batch[:, :10], glass_cache)
        steps.prefill(batch[:, :6], twin_cache)
        for i in range(6, 10):
            steps.decode_one(batch[:, i], twin_cache)
        theirs = model(batch[:, 10:], glass_cache)
        ours = model(batch[:, 10:], twin_cache)  # the glass forward, four tokens at once
    assert relative_error(ours.flatten(0, 1), theirs.flatten(0, 1)) <= 1e-5
