"""The native decoding step for Qwen3 and Llama 3 (engine/step.py's RopeStep, the plan their description asks
for; kernels/family_step.cpp) gives the glass model's answers.

One C++ call per new token runs the whole family model; `TwinSteps.decode_one` uses it where the
measurement on this machine chose it. Each test here calls the step itself, or forces the choice,
so both paths are checked whatever this machine measured. Stated tolerances, against the glass
model (families/qwen3.py, llama3.py) on the whole sequence:

- float32: logits within 1e-5 of the row's largest logit (the same sums in another order; measured
  up to 6e-7); greedy tokens identical.
- bfloat16: the step keeps the residual stream, the norms, RoPE, attention and SwiGLU in float32 where
  the glass model rounds each to bfloat16. Against the same bf16 weights computed in float32, the
  step's logits are no further than the glass model's own bfloat16 logits (measured: 0.2-0.5x as
  far), and within 3% of the row's largest logit of the glass model's bfloat16 logits on weights
  of the published scale.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import glassgpt.engine.decode as decode
from glassgpt.engine import KVCache, autotune
from glassgpt.engine.decode import TwinSteps, twin_steps
from glassgpt.engine.step import RopeStep, native_step, why_not
from glassgpt.families import build_model
from glassgpt.generate import generate

from conftest import needs_kernels
from helpers import TINY, V, randomize_

pytestmark = pytest.mark.usefixtures("kernels")


@pytest.fixture(scope="module")
def kernels():
    return needs_kernels()


def shapes() -> dict[str, object]:
    """The two families, and the shapes that stress the step's splits: one key/value group for every
    query head (fewer groups than threads), a group per head, heads of 24 (not a multiple of 16),
    a query width unlike emb_dim (Qwen3 0.6B's 2,048 against 1,024)."""
    qwen, llama = TINY["qwen3"], TINY["llama3"]
    return {"qwen3": qwen, "llama3": llama,
            "one group": dataclasses.replace(qwen, n_kv_groups=1),
            "a group per head": dataclasses.replace(llama, n_kv_groups=4),
            "heads of 24": dataclasses.replace(qwen, head_dim=24),
            "queries wider than d": dataclasses.replace(qwen, head_dim=32, hidden_dim=40),
            "tied": dataclasses.replace(qwen, tie_embeddings=True)}


def model_of(cfg, dtype=torch.float32):
    model = randomize_(build_model(cfg))
    model.tie_weights() if hasattr(model, "tie_weights") else None
    return model.to(dtype).eval()


def stepped(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits `[b, t - prompt, V]` of positions prompt..t-1, each from one native step after the prompt."""
    cache = KVCache(model.cfg, ids.shape[0], ids.shape[1], dtype=model.tok_emb.weight.dtype)
    with torch.no_grad():
        model(ids[:, :prompt], cache)
        step = native_step(model, cache)
        assert isinstance(step, RopeStep), why_not(model, cache)
        return torch.stack([step(ids[:, t]).clone() for t in range(prompt, ids.shape[1])], dim=1)


def ids_of(batch: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("shape", list(shapes()))
def test_float32_steps_give_the_glass_models_logits(shape, batch, threads):
    model = model_of(shapes()[shape])
    x = ids_of(batch, 20)
    with torch.no_grad():
        want = model(x)[:, 6:]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = stepped(model, x, 6)
    finally:
        torch.set_num_threads(before)
    scale = want.abs().amax(dim=-1, keepdim=True)
    assert ((got - want).abs() / scale).max() < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("shape", ["qwen3", "llama3"])
def test_bfloat16_steps_are_within_the_glass_models_roundings(shape):
    model = model_of(shapes()[shape], torch.bfloat16)
    exact = model_of(shapes()[shape])
    exact.load_state_dict({k: v.float() for k, v in model.state_dict().items()})  # the bf16 weights, computed in float32
    x = ids_of(2, 16)
    with torch.no_grad():
        glass = model(x)[:, 4:].float()
        truth = exact(x)[:, 4:]
    got = stepped(model, x, 4)
    assert (got - truth).abs().max() <= (glass - truth).abs().max()
    small = model_of(shapes()[shape])
    with torch.no_grad():
        for p in small.parameters():
            p.mul_(0.02 / 0.3) if p.dim() >= 2 else None  # the published models' scale of weights
    small = small.to(torch.bfloat16)
    with torch.no_grad():
        glass = small(x)[:, 4:].float()
    got = stepped(small, x, 4)
    assert ((got - glass).abs() / glass.abs().amax(dim=-1, keepdim=True)).max() < 0.03


def test_the_step_reads_the_models_tensors_in_place():
    """A weight changed after the step was made is what the next step multiplies by (nothing copied)."""
    model = model_of(TINY["qwen3"])
    x = ids_of(1, 8)
    cache = KVCache(model.cfg, 1, 8)
    with torch.no_grad():
        model(x[:, :4], cache)
        step = native_step(model, cache)
        model.trf_blocks[1].ff.fc3.weight.mul_(2)
        model.trf_blocks[0].att.k_norm.scale.add_(0.5)
        got = step(x[:, 4]).clone()
        cache2 = KVCache(model.cfg, 1, 8)
        want = model(x[:, :5], cache2)[:, -1]
    assert not torch.allclose(got, stepped(model_of(TINY["qwen3"]), x[:, :5], 4)[:, 0])
    # keys of positions 0-3 were written before k_norm changed, so compare against the glass model fed the same way
    cache3 = KVCache(model.cfg, 1, 8)
    with torch.no_grad():
        model.trf_blocks[0].att.k_norm.scale.sub_(0.5)
        model(x[:, :4], cache3)
        model.trf_blocks[0].att.k_norm.scale.add_(0.5)
        want = model(x[:, 4:5], cache3)[:, -1]
    assert ((got - want).abs().max() / want.abs().max()) < 1e-5


def test_greedy_generation_with_the_native_step_equals_the_glass_models_tokens(monkeypatch):
    model = model_of(TINY["llama3"])
    prompt = ids_of(1, 5)
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: True)
    picks = []
    real = TwinSteps.greedy
    monkeypatch.setattr(TwinSteps, "greedy", lambda self, logits: picks.append(real(self, logits)) or
                        picks[-1])
    native = generate(model, prompt, max_new_tokens=30)  # past the 24-token context: the cache is refilled
    assert isinstance(twin_steps(model).step, RopeStep)
    # the step's own greedy pick took each id the step made (19 fill the 24-position cache after the 5-token
    # prompt); the prompt's and, once the window is full, each refill's are pick_next's
    assert len(picks) == 30 and sum(p is not None for p in picks) == 24 - 5
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: False)
    plain = generate(model, prompt, max_new_tokens=30)
    assert twin_steps(model).step is None
    seq = prompt
    with torch.no_grad():
        for _ in range(30):
            seq = torch.cat([seq, model(seq[:, -24:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(native, seq) and torch.equal(plain, seq)


def test_the_next_generate_moves_the_plan_onto_its_cache_and_frees_the_last_one(monkeypatch):
    """The step of a family model is planned once per cache shape: the next call's cache takes the last one's
    place in the plan, the last one is freed, and the tokens are those of a fresh plan."""
    import gc
    import weakref

    model = model_of(TINY["qwen3"])
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: True)
    first = generate(model, ids_of(1, 5), max_new_tokens=8)
    step = twin_steps(model).step
    old_cache = weakref.ref(step.cache)
    second = generate(model, ids_of(1, 5, seed=2), max_new_tokens=8)
    assert twin_steps(model).step is step
    gc.collect()
    assert old_cache() is None
    twin_steps(model).step = None  # the next call plans afresh
    assert torch.equal(generate(model, ids_of(1, 5, seed=2), max_new_tokens=8), second)
    assert twin_steps(model).step is not step
    assert torch.equal(generate(model, ids_of(1, 5), max_new_tokens=8), first)


def test_the_choice_between_the_step_and_the_twin_is_measured_once(monkeypatch):
    model = model_of(TINY["qwen3"])
    timed = []
    real = autotune.measure

    def spy(choices, decision, candidates, *args):
        timed.append(sorted(candidates))
        real(choices, decision, candidates, *args)
    monkeypatch.setattr(autotune, "measure", spy)
    steps = twin_steps(model)
    steps.choices.winners.pop("step", None)  # as on a machine that never measured this model's step
    steps.choices.unsettled.pop("step", None)
    cache = KVCache(model.cfg, 1, 8)
    first = autotune.native_step_chosen(steps, cache)
    assert autotune.native_step_chosen(steps, cache) == first
    assert [names for names in timed if "native" in names] == [["engine", "native"]]


@pytest.mark.parametrize("case, words", [
    ("float16", "float32 and bfloat16"),
    ("a LoRA layer", "not all plain"),
    ("batch 9", "batches of 1 to 8"),
    ("a float32 cache for bf16 weights", "dtype and key/value groups"),
    ("a GPT-2", "the KV cache is not of the model's layers and heads"),
    ("a mixture of experts at batch 2", "a batch of 1, not 2"),  # (the described step's; RopeStep's: not SwiGLU)
])
def test_what_the_step_does_not_cover_is_said_in_one_line_and_the_twin_runs(case, words):
    cfg = TINY["llama3"]
    model, cache = model_of(cfg), KVCache(cfg, 1, 8)
    if case == "float16":
        model = model.half()
        cache = KVCache(cfg, 1, 8, dtype=torch.float16)
    elif case == "a LoRA layer":
        from glassgpt.training.tasks.lora import LoRALinear
        model.trf_blocks[0].ff.fc1 = LoRALinear(model.trf_blocks[0].ff.fc1, rank=2, alpha=4)
    elif case == "batch 9":
        cache = KVCache(cfg, 9, 8)
    elif case == "a float32 cache for bf16 weights":
        model = model.to(torch.bfloat16)
    elif case == "a GPT-2":
        from glassgpt.formats import random_model
        from glassgpt import GPTConfig
        model = random_model(GPTConfig(vocab_size=V, context_length=24, emb_dim=32, n_heads=4, n_layers=2),
                             torch.device("cpu"), torch.float32)
    elif case == "a mixture of experts at batch 2":
        model = model_of(dataclasses.replace(TINY["qwen3"], num_experts=4, num_experts_per_tok=2, moe_hidden_dim=16))
        cache = KVCache(model.cfg, 2, 8)
    reason = why_not(model, cache)
    assert reason is not None and words in reason and "\n" not in reason
    assert native_step(model, cache) is None


@pytest.mark.parametrize("native", [True, False])
def test_a_model_that_generated_is_freed_once_the_reader_drops_it(native, monkeypatch):
    # twin_steps keeps its twin and steps per model, holding the model weakly: before, every family model
    # that ever generated stayed in memory for the life of the process (a 0.6B Qwen3 is 2.4 GB in float32)
    import gc
    import weakref
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: native)
    model = model_of(TINY["qwen3"])
    generate(model, ids_of(1, 5), max_new_tokens=4)
    assert isinstance(twin_steps(model).step, RopeStep) == native
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and len(decode._TWINS) == 0
