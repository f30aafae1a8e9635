"""The native decoding step (engine/step.py, kernels/step.cpp) gives the glass model's answers.

One C++ call per new token runs the whole model; `Engine.decode_one` uses it where autotune chose
it. Each test here forces the choice (`decode_with`), so both paths are checked whatever this
machine measured. Stated tolerances, each against the reference named:

- float32: logits within 1e-5 of the glass model's (model.py, the whole window), relative to the
  row's largest logit (the same sums in another order); greedy tokens identical to model.py's
  and to transformers', on the book's layout and OpenAI's, tied and untied, batch 1 and 8, and
  past `context_length` (the window slides: the engine refills the cache, then steps again).
- bfloat16, int8, int4: the step keeps the residual stream, LayerNorm, attention and GELU in
  float32 where the PyTorch engine rounds each to bfloat16, so logits are within 3% of the row's
  largest logit of the PyTorch engine's on the same weights (int8 and int4: 4%, as the step also
  quantizes the activations), and greedy tokens on a model that has learnt its text are those of
  the PyTorch engine.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import glassgpt
from glassgpt.engine import Engine, KVCache, native, quantize_int4, quantize_int8
from glassgpt.engine import decode
from glassgpt.engine import step as step_module
from glassgpt.errors import KernelWarning
from glassgpt.formats import random_model
from glassgpt.generate import generate

from conftest import make_hf_model, needs_kernels, randomize_, save_hf_model
from helpers import copy_of, decode_with, prompts, trained_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained():
    return trained_model()


def layouts():
    """The book's layout (no qkv bias, untied head) and OpenAI's (qkv bias, tied), small."""
    base = glassgpt.GPTConfig(vocab_size=97, context_length=24, emb_dim=64, n_heads=4, n_layers=2)
    book = dataclasses.replace(base, qkv_bias=False, tie_embeddings=False)
    openai = dataclasses.replace(base, qkv_bias=True, tie_embeddings=True)
    return {"book": book, "openai": openai}


def model_of(cfg: glassgpt.GPTConfig) -> glassgpt.GPTModel:
    model = glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=0, config=cfg)
    return randomize_(model, seed=0, std=0.3).eval()


@pytest.mark.parametrize("layout", ["book", "openai"])
@pytest.mark.parametrize("batch", [1, 8])
def test_float32_step_logits_equal_the_glass_models(layout, batch):
    needs_kernels()
    model = model_of(layouts()[layout])
    assert model.tied == (layout == "openai")
    engine = Engine(model)
    decode_with(engine, "native")
    ids = torch.randint(0, 97, (batch, 20), generator=torch.Generator().manual_seed(batch))
    cache = KVCache(model.cfg, batch, 20)
    with torch.inference_mode():
        engine.prefill(ids[:, :4], cache)
        for t in range(4, 20):
            got = engine.decode_one(ids[:, t], cache)
            want = model(ids[:, :t + 1])[:, -1]
            assert engine.step is not None and engine.step.cache is cache  # the native step ran
            scale = want.abs().amax(dim=-1, keepdim=True)
            assert ((got - want).abs() / scale).max() < 1e-5


@pytest.mark.parametrize("layout", ["book", "openai"])
@pytest.mark.parametrize("batch", [1, 8])
def test_float32_greedy_tokens_equal_the_books_loop_past_the_window(layout, batch):
    needs_kernels()
    model = model_of(layouts()[layout])
    engine = Engine(model)
    decode_with(engine, "native")
    prompt = torch.randint(0, 97, (batch, 6), generator=torch.Generator().manual_seed(0))
    ours = generate(engine, prompt, 40)  # 46 tokens through a 24-token window: it slides
    assert ours.tolist() == generate(model, prompt, 40, use_cache=False).tolist()


@pytest.mark.parametrize("tied", [True, False])
def test_float32_greedy_tokens_equal_transformers(tmp_path, tied):
    needs_kernels()
    hf = make_hf_model(seed=0 if tied else 1, tie_word_embeddings=tied)
    model = glassgpt.load_model(save_hf_model(hf, tmp_path / "hf"))
    assert model.tied == tied
    engine = Engine(model)
    decode_with(engine, "native")
    prompt = torch.tensor([[5, 17, 42, 3, 99, 0, 64, 23], [1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=50, min_new_tokens=50,
                             do_sample=False, pad_token_id=0)
    assert generate(engine, prompt, 50).tolist() == theirs.tolist()


# int8 and int4: the step also quantizes each activation row to int8 in groups, where the engine keeps
# it bfloat16 (on the Xeon, int8 at batch 8: 3.4% between the two, each 3.8% from the float32 model's).
QUANTIZED = {"bfloat16": (lambda m: copy_of(m, torch.bfloat16), 0.03), "int8": (lambda m: quantize_int8(copy_of(m)), 0.04),
             "int4": (lambda m: quantize_int4(copy_of(m)), 0.04)}


@pytest.mark.parametrize("precision", list(QUANTIZED))
@pytest.mark.parametrize("batch", [1, 8])
def test_low_precision_step_logits_are_within_the_stated_tolerance_of_the_engines(trained, precision, batch):
    needs_kernels()
    model, ids = trained
    make, tolerance = QUANTIZED[precision]
    quantized = make(model)
    native_engine, torch_engine = Engine(quantized), Engine(quantized)
    decode_with(native_engine, "native")
    decode_with(torch_engine, "engine")
    x = prompts(ids, n=batch, length=24)
    caches = [KVCache(model.cfg, batch, 24, dtype=quantized.tok_emb.weight.dtype) for _ in range(2)]
    with torch.inference_mode():
        native_engine.prefill(x[:, :4], caches[0])
        torch_engine.prefill(x[:, :4], caches[1])
        for t in range(4, 24):
            got = native_engine.decode_one(x[:, t], caches[0]).float()
            want = torch_engine.decode_one(x[:, t], caches[1]).float()
            assert native_engine.step is not None and torch_engine.step is None
            scale = want.abs().amax(dim=-1, keepdim=True)
            assert ((got - want).abs() / scale).max() < tolerance


@pytest.mark.parametrize("precision", list(QUANTIZED))
def test_low_precision_greedy_tokens_equal_the_pytorch_engines(trained, precision):
    needs_kernels()
    model, ids = trained
    quantized = QUANTIZED[precision][0](model)
    native_engine, torch_engine = Engine(quantized), Engine(quantized)
    decode_with(native_engine, "native")
    decode_with(torch_engine, "engine")
    x = prompts(ids, n=4)
    assert torch.equal(generate(native_engine, x, 30), generate(torch_engine, x, 30))


def test_a_training_runs_bf16_twin_decodes_with_the_step_and_its_greedy_tokens(trained):
    """What a bf16 training run samples and snapshots with (Compute.eval_model: the fused twin of its bf16
    copy, whose Linear layers are GemvLinear) is a model the step covers, and decodes as the PyTorch engine."""
    needs_kernels()
    from glassgpt.engine.fused import fused
    from glassgpt.engine.mixed import LowPrecisionCopy
    model, ids = trained
    twin = fused(LowPrecisionCopy(copy_of(model).train()).module)
    cache = KVCache(twin.cfg, 2, 24, dtype=torch.bfloat16)
    with glassgpt.device.evaluating(twin):
        assert step_module.kind_of(twin) == "bfloat16" and step_module.why_not(twin, cache) is None
        native_engine, torch_engine = Engine(twin), Engine(twin)
        decode_with(native_engine, "native")
        decode_with(torch_engine, "engine")
        x = prompts(ids, n=2)
        assert torch.equal(generate(native_engine, x, 30), generate(torch_engine, x, 30))
        assert native_engine.step is not None


def test_the_step_allocates_nothing_per_token_and_reads_the_models_own_weights():
    needs_kernels()
    model = model_of(layouts()["openai"])
    engine = Engine(model)
    decode_with(engine, "native")
    cache = KVCache(model.cfg, 2, 16)
    ids = torch.zeros(2, dtype=torch.long)
    with torch.inference_mode():
        engine.prefill(torch.zeros(2, 3, dtype=torch.long), cache)
        first = engine.decode_one(ids, cache).data_ptr()
        step = engine.step
        addresses = set(step.plan.tolist())
        assert all(engine.decode_one(ids, cache).data_ptr() == first for _ in range(5))  # the same buffer
        assert engine.step is step and cache.pos == 9
    weights = [model.tok_emb.weight, model.pos_emb.weight, model.trf_blocks[0].att.W_query.weight, model.out_head.weight]
    assert all(w.data_ptr() in addresses for w in weights)  # no copy: the plan points at the model's tensors
    assert cache.k[1].data_ptr() in addresses


def test_the_next_generate_moves_the_plan_onto_its_cache_and_frees_the_last_one():
    """A plan is written once per engine and cache shape: the next call's cache of the same shape takes the old
    one's place (its addresses, not a new plan), the old cache is freed, and the tokens are a fresh plan's."""
    import gc
    import weakref

    needs_kernels()
    model = model_of(layouts()["openai"])
    engine, fresh = Engine(model), Engine(model)
    decode_with(engine, "native")
    decode_with(fresh, "native")
    prompt = torch.tensor([[3, 1, 4], [1, 5, 9]])
    first = generate(engine, prompt, 6)
    step = engine.step
    old_cache = weakref.ref(step.cache)
    second = generate(engine, prompt.flip(0), 6)
    assert engine.step is step and step.cache is not old_cache()
    gc.collect()
    assert old_cache() is None  # the plan does not keep the last call's keys and values
    assert torch.equal(first.flip(0)[:, 3:], second[:, 3:])  # the rows' tokens moved with the rows
    assert torch.equal(second, generate(fresh, prompt.flip(0), 6))
    assert {step.cache.k[1].data_ptr(), step.cache.v[0].data_ptr()} <= set(step.plan.tolist())
    generate(engine, prompt, 9)  # a longer cache: another shape, another plan
    assert engine.step is not step


@pytest.mark.parametrize("change", ["train", "replace"])
def test_a_model_changed_between_calls_is_planned_again(change):
    """The plan moves onto a new cache only while the model is the one it was written for (step.stamp): put in
    training mode (dropout: the step refuses) or given a new tensor, the engine looks at the model again."""
    needs_kernels()
    model = model_of(dataclasses.replace(layouts()["book"], drop_rate=0.5))
    engine = Engine(model)
    decode_with(engine, "native")
    prompt = torch.tensor([[3, 1, 4]])
    generate(engine, prompt, 4)
    step = engine.step
    if change == "train":
        model.train()
        with torch.inference_mode():
            cache = KVCache(model.cfg, 1, 7)
            engine.prefill(prompt, cache)
            engine.decode_one(torch.tensor([2]), cache)
        assert engine.step is None  # the PyTorch engine ran: the step has no dropout
    else:
        model.final_norm.shift = torch.nn.Parameter(torch.full_like(model.final_norm.shift, 0.25))
        generate(engine, prompt, 4)
        assert engine.step is not None and engine.step is not step
        assert engine.step.plan[step_module.HEADER_FIELDS.index("fn_shift")] == model.final_norm.shift.data_ptr()


@pytest.mark.parametrize("threads", [1, 2])
def test_the_steps_greedy_pick_is_torch_max_s_on_ties_zeros_and_a_nan(threads, monkeypatch):
    """step.h's greedy_rows against `logits.max(-1)` (pick_next's greedy): ties go to the first, a row of equal
    logits to id 0, a NaN is the largest (and generate refuses it), rows shared between threads."""
    needs_kernels()
    model = model_of(layouts()["book"])
    head = model.out_head.weight
    ids = torch.tensor([3, 50, 96])
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for craft in ("as trained", "two equal rows", "all zero", "a NaN row"):
                if craft == "two equal rows":
                    head[40] = head[41] = head[7] = head.abs().amax(0) * 3  # 7 first, 40 and 41 the same value
                elif craft == "all zero":
                    head.zero_()
                elif craft == "a NaN row":
                    head[60] = float("nan")
                engine = Engine(model)
                decode_with(engine, "native")
                cache = KVCache(model.cfg, 3, 8)
                engine.prefill(torch.zeros(3, 2, dtype=torch.long), cache)
                logits = engine.decode_one(ids, cache)
                assert engine.step.threads == threads
                picked, largest = engine.greedy(logits)
                values, want = logits.max(dim=-1)
                assert picked.tolist() == want.tolist(), craft
                torch.testing.assert_close(torch.tensor(largest), values, rtol=0, atol=0, equal_nan=True, msg=craft)
                if craft == "all zero":
                    assert picked.tolist() == [0, 0, 0]
                assert engine.greedy(logits.clone()) is None  # logits the step did not make: pick_next picks
        # Finite weights (generate checks them first) whose score overflows to +inf at the first step only, so
        # that the step's pick, not pick_next's on the prompt's logits, is the one that must refuse it.
        prompt = overflow_at_the_first_step(model_of(layouts()["book"]), model)
        monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: True)
        with pytest.raises(glassgpt.errors.NonFiniteError, match="NaN or infinite"):
            generate(model, prompt, 3)
        assert len(generate(model, prompt, 1)[0]) == 3  # the prompt's own pick was finite
    finally:
        torch.set_num_threads(1)


def overflow_at_the_first_step(source: glassgpt.GPTModel, model: glassgpt.GPTModel) -> torch.Tensor:
    """Give `model` `source`'s weights with one head row changed so that the greedy run of the prompt returned
    has a finite largest score after the prompt and +inf after its first new token: the row reads one feature
    j of final_norm's output h, with a weight c of the sign that makes the prompt's score very negative."""
    features = []
    source.final_norm.register_forward_hook(lambda module, args, out: features.append(out[0]))
    with torch.inference_mode():
        for first in range(source.cfg.vocab_size):
            prompt = torch.tensor([[first, first]])
            features.clear()
            nxt = source(prompt)[0, -1].argmax()
            features.clear()
            source(torch.cat([prompt[0], nxt[None]])[None])
            h1, h2 = features[0][1], features[0][2]  # after the prompt, after its first new token
            for j in range(h1.numel()):
                a, b = float(h1[j]), float(h2[j])
                if 0.9 <= abs(a) and a * b < 0 and abs(b) > 1.5 * abs(a):
                    with torch.no_grad():
                        model.load_state_dict(source.state_dict())
                        model.out_head.weight[60] = 0.0
                        model.out_head.weight[60, j] = -math.copysign(3e38 / abs(a), a)  # -3e38 after the prompt
                    return prompt
    raise AssertionError("no prompt and feature overflow at the first step only")


def test_generate_takes_the_steps_greedy_pick_and_the_tokens_are_pick_nexts(trained, monkeypatch):
    needs_kernels()
    model, ids = trained
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: True)
    x = prompts(ids, n=3)
    with torch.inference_mode():
        fast = generate(model, x, 20)
        taken = []
        real = Engine.greedy
        monkeypatch.setattr(Engine, "greedy", lambda self, logits: taken.append(real(self, logits)) or None)
        slow = generate(model, x, 20)  # every id from pick_next's logits.max
    assert fast.tolist() == slow.tolist()
    assert len(taken) == 20 and taken[0] is None and all(t is not None for t in taken[1:])  # the prompt's: pick_next


def test_decode_n_picks_each_next_id_from_decode_ones_logits(trained):
    needs_kernels()
    model, ids = trained
    engine = Engine(model)
    decode_with(engine, "native")
    x = prompts(ids, n=2)
    cache = KVCache(model.cfg, 2, 40)
    with torch.inference_mode():
        first = engine.prefill(x, cache).argmax(-1)
        steps = list(engine.decode_n(first, cache, 10, lambda logits: logits.argmax(-1)))
    assert torch.stack([first, *steps], dim=1).tolist() == generate(model, x, 11, use_cache=False)[:, 12:].tolist()


def test_a_batch_the_step_does_not_cover_runs_the_engine_with_one_note(trained, monkeypatch):
    model, ids = trained
    engine = Engine(model)
    decode_with(engine, "native")
    x = prompts(ids, n=step_module.MAX_BATCH + 1, length=6)
    monkeypatch.setattr(decode, "_said", set())  # the notes said so far in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = generate(engine, x, 5)
        generate(engine, x, 5)
    notes = [str(w.message) for w in caught if issubclass(w.category, KernelWarning)]
    assert len(notes) == 1 and "batches of 1 to 8, not 9" in notes[0] and "\n" not in notes[0]
    assert engine.step is None
    assert out.tolist() == generate(model, x, 5, use_cache=False).tolist()


def test_without_the_kernels_the_engine_decodes_and_the_tokens_are_the_same(trained, monkeypatch):
    model, ids = trained
    x = prompts(ids, n=2)
    want = generate(model, x, 10, use_cache=False)
    monkeypatch.setattr(native, "library", lambda: None)
    engine = Engine(model)
    decode_with(engine, "native")
    assert generate(engine, x, 10).tolist() == want.tolist()
    assert engine.step is None


@pytest.mark.parametrize("n_heads", [4, 8])  # head_dim 16: heads split between threads; 8: 4-bit rows by blocks
def test_two_threads_split_the_heads_and_rows_and_give_one_threads_logits(trained, n_heads):
    needs_kernels()
    cfg = dataclasses.replace(layouts()["openai"], n_heads=n_heads)
    model = model_of(cfg)
    for make in (lambda m: m, lambda m: quantize_int4(copy_of(m))):
        m = make(model)
        ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            engine = Engine(m)
            decode_with(engine, "native")
            cache = KVCache(cfg, 3, 12, dtype=m.tok_emb.weight.dtype)
            with torch.inference_mode():  # every position through the step (a prefill's kernels differ per thread count)
                outs.append(torch.stack([engine.decode_one(ids[:, t], cache).clone() for t in range(12)]))
        torch.set_num_threads(1)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_the_steps_profile_gives_each_phase_its_own_time():
    # Where benchmarks/decode_profile.py's figures come from (an attribution, not a speed): on one thread no
    # barrier waits, and the head, by far the largest product of this vocabulary-heavy model, must be counted
    # as the head. The slip this guards against put the head's time under "waiting" and left the head ~1%.
    needs_kernels()
    cfg = glassgpt.GPTConfig(vocab_size=8192, context_length=16, emb_dim=64, n_heads=4, n_layers=1)
    model = model_of(cfg)
    cache = KVCache(cfg, 1, 16)
    with torch.inference_mode():
        Engine(model).prefill(torch.zeros(1, 2, dtype=torch.long), cache)
        step = step_module.NativeStep(model, cache)
        assert step.threads == 1
        phases = step.profile()
        for _ in range(100):
            cache.pos = 2
            step(torch.zeros(1, dtype=torch.long))
    seconds = dict(zip(step_module.PHASES, phases.tolist()))
    assert seconds["head"] > 0.2 * sum(seconds.values()), seconds  # about 80% here; a preempted phase cannot undo it
    assert seconds["waiting for the other threads"] < seconds["head"], seconds
