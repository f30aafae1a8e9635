"""The fast engine gives the glass model's answers.

`glassgpt.engine` runs the same weights faster: `Engine` (a KV cache, the fused or
blocked attention, the head on the last position), bfloat16 weights, torch.compile and
int8 weight-only layers. Each is checked against `GPTModel.forward`, mostly on a small
model trained for a few seconds on a built-in text, so that its next-token choices have
real margins, as a trained GPT-2's do (random weights make near-ties that any rounding
flips). Stated tolerances:

- float32: logits within 1e-5 of the glass model's (the same sums, another order);
  greedy tokens identical.
- bfloat16: the same greedy tokens; logits within 3% of their row's largest logit (bf16
  keeps 8 bits of mantissa, about 0.4% per rounding, over a few roundings per block).
- int8: the same greedy tokens; perplexity within 1% of float32's.
- int4 (4-bit groups of 32): perplexity within 2% of float32's.
- glassgpt's own kernels (engine/native.py): float32 within 1e-5 of F.linear relative to the
  output's scale, bfloat16 within its output's rounding, int8 within 1e-3 of the dequantized
  weight's product (the kernel rounds x to int16), int4 within 1e-3 of the product with x
  rounded to int8 per group (as the kernel does) and within 1% of x's own; the engine on them
  gives the glass model's float32 greedy tokens, and so does the pure-PyTorch path that runs
  where the kernels cannot be built (tested by forcing each); int4 decoded through the
  kernel keeps perplexity within 2% of float32's.

Speed itself is never asserted here: benchmarks/ measures it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F

import glassgpt
from glassgpt import GPTConfig
from glassgpt.cli import main
from glassgpt.engine import (Engine, KVCache, autotune, compile_for_generation, fused, is_fused, native,
                             quantize_int4, quantize_int8)
from glassgpt.engine.int4 import Int4Linear, pack, quantize_groups, unpack
from glassgpt.model import GELU, GPTModel, LayerNorm, MultiHeadAttention
from glassgpt.engine.attention import ATTENTION_BLOCK, PATHS, attend, attention_in_blocks
from glassgpt.engine.fused import FusedAttention
from glassgpt.engine.int8 import INT8_KERNEL_MAX_ROWS, Int8Linear, is_quantized
from glassgpt.errors import PromptError
from glassgpt.generate import generate, stream
from glassgpt.formats import random_model

from conftest import needs_gemv, layer_norm_and_input, make_hf_model, needs_kernels, save_hf_model
from helpers import copy_of, decode_with, prompts, trained_model

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second thread only waits for the first on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(one_thread):
    return trained_model()


@torch.no_grad()
def perplexity(model: glassgpt.GPTModel, ids: list[int], window: int = 64) -> float:
    data = torch.tensor(ids[: (len(ids) - 1) // window * window + 1])
    x = data[:-1].view(-1, window)
    y = data[1:].view(-1, window)
    logits = model(x).float()
    return math.exp(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())


# --- the engine's forward pass equals the glass model's --------------------------------------

@pytest.mark.parametrize("batch, t", [(1, 1), (2, 9), (3, 32)])
def test_engine_logits_equal_the_glass_models(tiny_model, batch, t):
    ids = torch.randint(0, 97, (batch, t), generator=torch.Generator().manual_seed(t))
    with torch.no_grad():
        torch.testing.assert_close(Engine(tiny_model)(ids), tiny_model(ids), atol=1e-5, rtol=0)


def test_engine_has_no_weights_of_its_own(tiny_model):
    engine = Engine(tiny_model)
    assert [n for n, _ in engine.named_parameters()] == ["model." + n for n, _ in tiny_model.named_parameters()]
    assert engine.model is tiny_model


def test_engine_trains_like_the_glass_model(tiny_config):
    # Dropout 0: the engine's gradients are the glass model's (float32 round-off).
    model = glassgpt.load_model("gpt2", config=tiny_config, seed=1).train()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    Engine(model)(ids).square().mean().backward()
    engine_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(ids).square().mean().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(engine_grads[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)


def test_cached_greedy_tokens_equal_the_books_loop(tiny_model):
    # use_cache=False is the book's generate: the whole window through GPTModel at every step.
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    assert torch.equal(generate(tiny_model, prompt, 40), generate(tiny_model, prompt, 40, use_cache=False))


def test_last_only_equals_the_last_row_of_the_full_forward(tiny_model):
    ids = torch.randint(0, 97, (2, 9))
    last = Engine(tiny_model)(ids, last_only=True)
    assert last.shape == (2, 1, 97)
    # A [b, 1, d] and a [b, t, d] matmul may round differently in float32: 1e-5, not exact.
    torch.testing.assert_close(last, tiny_model(ids)[:, -1:], atol=1e-5, rtol=0)


def test_cache_overflow_is_a_prompt_error(tiny_model):
    ctx = tiny_model.cfg.context_length
    cache = KVCache(tiny_model.cfg, batch_size=1)
    Engine(tiny_model)(torch.zeros(1, ctx - 2, dtype=torch.long), cache)
    with pytest.raises(PromptError):
        Engine(tiny_model)(torch.zeros(1, 3, dtype=torch.long), cache)


# --- the KV cache -------------------------------------------------------------------------

def test_kv_cache_one_token_at_a_time_matches_full_forward(tiny_model):
    ids = torch.randint(0, 97, (2, 20))
    full = tiny_model(ids)
    cache = KVCache(tiny_model.cfg, batch_size=2)
    steps = [Engine(tiny_model)(ids[:, i:i + 1], cache) for i in range(20)]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("split", [1, 7, 12, 19])
def test_chunked_prefill_through_the_cache_matches_full_forward(tiny_model, split):
    ids = torch.randint(0, 97, (2, 20))
    full = tiny_model(ids)
    cache = KVCache(tiny_model.cfg, batch_size=2)
    first = Engine(tiny_model)(ids[:, :split], cache)
    second = Engine(tiny_model)(ids[:, split:], cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-5, rtol=0)


# --- the fused kernels (engine/fused.py) --------------------------------------------------------

def test_fused_layer_norm_and_gelu_equal_the_books_formulas():
    # F.layer_norm and F.gelu(approximate="tanh") compute the book's formulas in one kernel each,
    # adding in another order: within float32 round-off (1e-5 on outputs of size ~3).
    norm, x = layer_norm_and_input()
    torch.testing.assert_close(fused(norm)(x), norm(x), atol=1e-5, rtol=0)
    torch.testing.assert_close(fused(GELU())(x), GELU()(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("training", [False, True])
def test_fused_attention_equals_the_books_written_out_attention(tiny_config, training):
    # The book's steps (scores, mask, softmax, context) and F.scaled_dot_product_attention are
    # the same sums in another order: outputs within float32 round-off (1e-5). Dropout 0, so
    # training mode (gradients on) compares the same maths.
    att = MultiHeadAttention(tiny_config).train(training)
    x = torch.randn(2, 9, tiny_config.emb_dim)
    torch.testing.assert_close(fused(att)(x), att(x), atol=1e-5, rtol=0)


def test_the_fused_twin_shares_every_weight_and_none_of_the_hooks(tiny_model):
    tiny_model.tok_emb.register_forward_hook(lambda *a: pytest.fail("the twin ran the model's hook"))
    twin = fused(tiny_model)
    assert {id(p) for p in twin.parameters()} == {id(p) for p in tiny_model.parameters()}
    assert twin.tied == tiny_model.tied and is_fused(twin) and not is_fused(tiny_model)
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in tiny_model.named_parameters()]
    twin(torch.zeros(1, 3, dtype=torch.long))
    with torch.no_grad():
        tiny_model.final_norm.shift.add_(1.0)  # a change to the model is a change to the twin
    assert torch.equal(twin.final_norm.shift, tiny_model.final_norm.shift)


# --- the CPU attention paths (attention.attend picks them; every other case runs SDPA) -----

@pytest.mark.parametrize("t", [256, 300, 600])
@pytest.mark.parametrize("dtype, atol", [
    (torch.float32, 1e-5),   # the same sums in another order
    (torch.bfloat16, 0.03),  # bf16 inputs and scores, float32 softmax; outputs are O(1)
])
def test_attention_in_blocks_equals_fused_attention(t, dtype, atol):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, t, 16) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # float32
    got = attention_in_blocks(q.to(dtype), k.to(dtype), v.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("t", [2, 72, 128])
def test_the_training_path_written_out_has_sdpas_output_and_gradients(t):
    """attend(train_path="blocks") with gradients (training's short sequences): the same context and the
    same gradients of q, k and v as SDPA's, within float32 rounding."""
    torch.manual_seed(0)
    leaves = [torch.randn(2, 3, t, 16, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(2, 3, t, 16)
    results = []
    for path in ("sdpa", "blocks"):
        for x in leaves:
            x.grad = None
        out = attend(*leaves, 0.0, "blocks", "sdpa", path)
        out.backward(grad_out)
        results.append([out.detach()] + [x.grad.clone() for x in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_tune_training_sets_the_twins_attention_path_and_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "TRIES", 1)  # every measurement settles (a close one is measured again: below)
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(autotune, "_training_memo", {})
    model = GPTModel(GPTConfig(vocab_size=96, context_length=32, emb_dim=64, n_heads=4, n_layers=2)).train()
    twin = fused(model)
    path = autotune.tune_training(twin)
    assert path in PATHS and all(m.train_path == path for m in twin.modules() if isinstance(m, FusedAttention))
    saved = json.loads((tmp_path / "autotune.json").read_text())
    [(key, entry)] = [(k, v) for k, v in saved.items() if "| training |" in k]
    assert key.endswith("h 4, hd 16, t 32") and set(entry["ms"]["attention train"]) == set(PATHS)
    monkeypatch.setattr(autotune, "_training_memo", {})
    monkeypatch.setattr(autotune, "measure", lambda *a, **kw: pytest.fail("measured again"))
    assert autotune.tune_training(fused(model)) == path  # read back from the file


@pytest.mark.parametrize("start, t", [(5, 1), (37, 1), (40, 300), (7, 128)])
def test_attention_in_blocks_after_cached_keys_equals_fused_attention(start, t):
    # Queries at positions start..start+t-1 over keys 0..start+t-1, as with a KV cache
    # (t = 1 is a decoding step).
    torch.manual_seed(0)
    q = torch.randn(2, 3, t, 16)
    k, v = (torch.randn(2, 3, start + t, 16) for _ in range(2))
    mask = torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attention_in_blocks(q, k, v), expected, atol=1e-5, rtol=0)


def test_bfloat16_long_prompt_in_blocks_matches_the_fused_path():
    # Without gradients a bfloat16 prompt of >= ATTENTION_BLOCK tokens on a CPU attends in
    # blocks; the glass model runs SDPA. Logits agree to the bf16 tolerance
    # the speed tests use (atol 0.1, rtol 0.02, as above).
    cfg = GPTConfig(vocab_size=97, context_length=2 * ATTENTION_BLOCK, emb_dim=32, n_heads=4, n_layers=2)
    model = glassgpt.load_model("gpt2", seed=0, config=cfg).to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, ATTENTION_BLOCK + 44))
    with torch.no_grad():
        blocked = Engine(model)(ids).float()
    fused = model(ids).float()  # the glass model: SDPA
    torch.testing.assert_close(blocked, fused, atol=0.1, rtol=0.02)


def test_kv_cache_reset_starts_over(tiny_model):
    ids = torch.randint(0, 97, (1, 6))
    cache = KVCache(tiny_model.cfg, batch_size=1)
    first = Engine(tiny_model)(ids, cache)
    cache.reset()
    torch.testing.assert_close(Engine(tiny_model)(ids, cache), first)




@pytest.mark.slow
def test_gpt2_124m_kv_cache_matches_full_forward(tmp_path):
    hf = make_hf_model(seed=0, std=0.02, vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    model = glassgpt.load_model(save_hf_model(hf, tmp_path / "hf"))
    ids = torch.randint(0, 50257, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.cfg, batch_size=1)
        engine = Engine(model)
        chunks = [engine(ids[:, :10], cache)] + [engine(ids[:, i:i + 1], cache) for i in range(10, 24)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-4, rtol=0)


# --- the KV cache ---------------------------------------------------------------------------

def test_cached_greedy_tokens_equal_full_forward_tokens_even_past_the_window(trained):
    model, ids = trained
    prompt = prompts(ids, n=2, length=40)
    # 40 + 50 > context_length 64: the cache fills, resets and re-reads the last 64 tokens.
    assert torch.equal(generate(model, prompt, 50, use_cache=True), generate(model, prompt, 50, use_cache=False))


def test_kv_cache_is_allocated_once_and_written_in_place(trained, monkeypatch):
    model, ids = trained
    made, pointers = [], set()
    original_init, original_update = KVCache.__init__, KVCache.update

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        made.append(self)

    def update(self, layer, k, v):
        pointers.add(tuple(t.data_ptr() for t in self.k + self.v))
        return original_update(self, layer, k, v)

    monkeypatch.setattr(KVCache, "__init__", init)
    monkeypatch.setattr(KVCache, "update", update)
    generate(model, prompts(ids, n=1), 20)
    assert len(made) == 1 and len(pointers) == 1


def test_kv_cache_holds_only_the_positions_a_request_can_use(trained, monkeypatch):
    model, ids = trained
    sizes = []
    original = KVCache.__init__

    def init(self, cfg, batch_size, max_len=None, **kwargs):
        original(self, cfg, batch_size, max_len, **kwargs)
        sizes.append(self.max_len)

    monkeypatch.setattr(KVCache, "__init__", init)
    generate(model, prompts(ids, n=1, length=12), 8)
    generate(model, prompts(ids, n=1, length=40), 100)
    assert sizes == [12 + 8, model.cfg.context_length]


def test_a_full_kv_cache_is_a_prompt_error_not_a_crash(trained):
    model, ids = trained
    cache = KVCache(model.cfg, 1, max_len=8)
    with pytest.raises(glassgpt.GlassError, match="KV cache holds 8"):
        Engine(model)(prompts(ids, n=1, length=9), cache)


# --- bfloat16 -------------------------------------------------------------------------------

def test_bfloat16_greedy_tokens_equal_float32_tokens(trained):
    model, ids = trained
    prompt = prompts(ids)
    assert torch.equal(generate(copy_of(model, torch.bfloat16), prompt, 30), generate(model, prompt, 30))


def test_bfloat16_logits_are_within_the_stated_tolerance(trained):
    model, ids = trained
    x = prompts(ids, length=64)
    with torch.no_grad():
        ref = model(x)
        got = Engine(copy_of(model, torch.bfloat16))(x).float()  # what generate --dtype bfloat16 runs
    # Each logit within 3% of its row's largest |logit| (here ~12): bf16 rounds every stored
    # activation to 8 bits of mantissa (~0.4%), a few times per block. (The fused LayerNorm
    # accumulates its mean and variance in float32; the book's, run in bf16, would not.)
    scale = ref.abs().amax(dim=-1, keepdim=True)
    assert ((got - ref).abs() <= 0.03 * scale).all(), ((got - ref).abs() / scale).max()


# --- torch.compile --------------------------------------------------------------------------

def test_compiled_greedy_tokens_equal_eager_tokens(trained):
    model, ids = trained
    prompt = prompts(ids, n=2)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_for_generation(copy_of(model))
    decode_with(compiled, "engine")  # the compiled forward decodes too (not the native step)
    other = prompts(ids, n=3, length=7)
    # Twice: the second call runs the already-compiled prompt and step graphs.
    assert torch.equal(generate(compiled, prompt, 12), generate(model, prompt, 12))
    assert torch.equal(generate(compiled, prompt, 12), generate(model, prompt, 12))
    # One graph for the prompt, one for every later step (the cache position stays
    # symbolic): a graph break or a recompile per step would fall back to slow paths.
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2
    # Another batch size and prompt length: two more graphs, with those sizes symbolic too.
    assert torch.equal(generate(compiled, other, 5), generate(model, other, 5))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 4
    # The options are the compiled model's own: nothing global is left changed.
    assert not torch._inductor.config.freezing


def test_compiled_int8_greedy_tokens_equal_float32_tokens(trained):
    # Batch 1 is the case int8 is for, and the one where a compiled Int8Linear runs its own
    # fused dot products (engine/int8.py) instead of the int8 kernel.
    model, ids = trained
    prompt = prompts(ids, n=1)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_for_generation(quantize_int8(copy_of(model)))
    decode_with(compiled, "engine")
    assert torch.equal(generate(compiled, prompt, 20), generate(model, prompt, 20))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 2


# --- int8 weight-only -----------------------------------------------------------------------

@pytest.mark.parametrize("rows", [1, INT8_KERNEL_MAX_ROWS + 1])
def test_int8_linear_equals_matmul_with_the_dequantized_weight(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    q = Int8Linear(linear)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    dequantized = q.weight.float() * q.scales.float()[:, None]
    expected = x.float() @ dequantized.T + q.bias.float()
    torch.testing.assert_close(q(x).float(), expected, atol=0.05, rtol=0.02)
    # and the dequantized weight is the float weight to within half a step of each row's scale
    assert (dequantized - linear.weight).abs().max() <= q.scales.float().max() / 2 + 1e-6


def test_compiled_int8_linear_of_one_row_equals_the_int8_kernel():
    torch.manual_seed(0)
    q = Int8Linear(torch.nn.Linear(256, 320))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        # the same int8 products summed in float32 by both, in a different order; each
        # rounds its result to bfloat16 once (a relative step of 2^-8)
        torch.testing.assert_close(torch.compile(q, fullgraph=True)(x), q(x), atol=0.02, rtol=2**-7)


def test_int8_keeps_every_module_name_and_output_shape(trained):
    model, ids = trained
    quantized = quantize_int8(copy_of(model))
    assert is_quantized(quantized) and not is_quantized(model)
    assert [n for n, _ in quantized.named_modules()] == [n for n, _ in model.named_modules()]
    x = prompts(ids)
    assert quantized(x).shape == model(x).shape


def test_int8_greedy_tokens_equal_float32_tokens(trained):
    model, ids = trained
    prompt = prompts(ids)
    assert torch.equal(generate(quantize_int8(copy_of(model)), prompt, 30), generate(model, prompt, 30))


@pytest.mark.parametrize("quantize, tolerance", [(quantize_int8, 0.01), (quantize_int4, 0.02)], ids=["int8", "int4"])
def test_quantized_perplexity_is_within_its_tolerance_of_float32(trained, quantize, tolerance):
    model, ids = trained
    base = perplexity(model, ids)
    quantized = perplexity(quantize(copy_of(model)), ids)
    assert base < 5, "the fixture model did not learn its text"
    assert abs(quantized / base - 1) < tolerance, (base, quantized)


def test_int8_streams_one_id_per_row_and_step(trained):
    model, ids = trained
    steps = list(stream(quantize_int8(copy_of(model)), prompts(ids, n=3), 5))
    assert len(steps) == 5 and all(s.shape == (3,) for s in steps)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_cli_generates_with_quantized_weights_and_reports_the_kernels(tmp_path, capsys, dtype):
    cfg = dataclasses.replace(glassgpt.PRESETS["gpt2"], emb_dim=32, n_heads=2, n_layers=2, context_length=32)
    path = glassgpt.save_model(glassgpt.load_model("gpt2", config=cfg), tmp_path / "ckpt")
    assert main(["generate", "Every effort moves you", "--model", str(path), "--dtype", dtype,
                 "--max-new-tokens", "3", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["new_ids"]) == 3
    assert f"kernels: {dtype} matrix-vector products" in captured.err


# --- bfloat16 training with a float32 master copy ------------------------------------------

def test_low_precision_copy_is_bf16_tied_and_leaves_the_master_float32(tiny_model):
    from glassgpt.engine import LowPrecisionCopy
    lp = LowPrecisionCopy(tiny_model)
    assert all(p.dtype == torch.bfloat16 for p in lp.module.parameters())
    assert all(p.dtype == torch.float32 for p in tiny_model.parameters())
    assert lp.module.out_head.weight is lp.module.tok_emb.weight


def test_low_precision_gradients_reach_the_master_in_float32(tiny_config):
    # The bf16 copy's gradients, widened, are the float32 model's to bf16 accuracy: within
    # 3% of the largest gradient of each tensor (8-bit mantissa, a few roundings per block).
    from glassgpt.engine import LowPrecisionCopy
    master = glassgpt.load_model("gpt2", config=tiny_config, seed=2).train()
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    lp = LowPrecisionCopy(master)
    F.cross_entropy(lp.module(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten()).backward()
    lp.grads_to_master()
    got = {n: p.grad.clone() for n, p in master.named_parameters()}
    assert all(g.dtype == torch.float32 for g in got.values())
    assert all(p.grad is None for p in lp.module.parameters())
    master.zero_grad(set_to_none=True)
    F.cross_entropy(master(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    for n, p in master.named_parameters():
        assert (got[n] - p.grad).abs().max() <= 0.03 * p.grad.abs().max() + 1e-6, n


def test_low_precision_training_follows_float32_training(tiny_config):
    # Ten AdamW steps memorising one batch: the losses stay within 2% of float32 training's,
    # and refresh() puts the updated float32 weights into the copy.
    from glassgpt.engine import LowPrecisionCopy
    data = torch.randint(0, 97, (1, 4, 17), generator=torch.Generator().manual_seed(1)).expand(10, 4, 17)

    def train(low_precision: bool) -> list[float]:
        master = glassgpt.load_model("gpt2", config=tiny_config, seed=3).train()
        opt = torch.optim.AdamW(master.parameters(), lr=3e-3)
        lp = LowPrecisionCopy(master) if low_precision else None
        losses = []
        for batch in data:
            logits = (lp.module if lp else master)(batch[:, :-1]).float()
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            if lp:
                lp.grads_to_master()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if lp:
                lp.refresh()
                torch.testing.assert_close(lp.module.tok_emb.weight, master.tok_emb.weight.bfloat16(), atol=0, rtol=0)
            losses.append(loss.item())
        return losses

    full, low = train(False), train(True)
    assert low[-1] < low[0] - 0.5  # it learns
    for a, b in zip(full, low):
        assert abs(a - b) <= 0.02 * a, (full, low)


# --- int4: 4-bit groups ---------------------------------------------------------------------

def test_int4_packing_keeps_every_weight_and_scale():
    torch.manual_seed(0)
    w = torch.randn(37, 96)  # rows not a multiple of the kernel's 16
    q, scale, mins = quantize_groups(w, 32)
    packed, scales_mins = pack(q, scale, mins, torch.float32)
    q2, scale2, mins2 = unpack(packed, scales_mins, 37)
    assert torch.equal(q2, q) and torch.equal(scale2, scale) and torch.equal(mins2, mins)
    # every weight within half a step of its group's 16 levels
    dequantized = (q.float().view(37, 3, 32) * scale[..., None] + mins[..., None]).view(37, 96)
    assert ((dequantized - w).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-6).all()


def test_int4_keeps_every_module_name_and_output_shape(trained):
    model, ids = trained
    quantized = quantize_int4(copy_of(model))
    assert [n for n, _ in quantized.named_modules()] == [n for n, _ in model.named_modules()]
    assert sum(isinstance(m, Int4Linear) for m in quantized.modules()) == 6 * model.cfg.n_layers + 1
    assert quantized(prompts(ids)).shape == model(prompts(ids)).shape


def test_int4_refuses_widths_that_are_not_whole_groups_and_names_the_sizes_that_fit():
    cfg = GPTConfig(vocab_size=50, context_length=16, emb_dim=48, n_heads=4, n_layers=1)
    with pytest.raises(glassgpt.GlassError, match=r"groups of 32 columns.*such as 32 or 64, not 48.*group size of 16"):
        quantize_int4(random_model(cfg, torch.device("cpu"), torch.float32))


def test_cli_int4_on_a_width_that_is_not_whole_groups_is_one_line(tmp_path, capsys):
    cfg = dataclasses.replace(glassgpt.PRESETS["gpt2"], emb_dim=48, n_heads=2, n_layers=1, context_length=32)
    path = glassgpt.save_model(glassgpt.load_model("gpt2", config=cfg), tmp_path / "ckpt")
    assert main(["generate", "hi", "--model", str(path), "--dtype", "int4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --dtype int4") and "multiple of 32" in err


# --- glassgpt's own kernels, and the PyTorch path where they are missing ------------------------

def check_kernels(ops) -> None:
    """Each kernel against PyTorch's product of the same weights, on shapes with ragged ends."""
    torch.manual_seed(0)
    for rows, out, inp in ((1, 13, 37), (3, 70, 96), (5, 33, 3072), (8, 768, 64), (27, 40, 64)):
        x, w, b = torch.randn(rows, inp), torch.randn(out, inp), torch.randn(out)
        ref = F.linear(x.double(), w.double(), b.double())
        scale = ref.abs().max().item()
        assert (ops.gemv(x, w, b).double() - ref).abs().max() <= 1e-5 * scale
        xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
        ref_b = F.linear(xb.double(), wb.double(), bb.double())
        assert ((ops.gemv(xb, wb, bb).double() - ref_b).abs() <= ref_b.abs() * 2**-8 + 1e-3 * scale).all()
        q8 = Int8Linear(torch.nn.Linear(inp, out), torch.float32)
        ref_q8 = F.linear(x.double(), q8.weight.double() * q8.scales.double()[:, None], q8.bias.double())
        assert (ops.gemv_q8(x, q8.weight, q8.scales, q8.bias).double() - ref_q8).abs().max() <= 1e-3 * ref_q8.abs().max()
        if inp % 32 == 0:
            q4 = Int4Linear(torch.nn.Linear(inp, out), 32, torch.float32)
            got = ops.gemv_q4(x, q4.packed, q4.scales_mins, q4.bias, out, 32).double()
            # the product of x rounded to int8 per group of 32, as the kernel rounds it (a rare
            # element rounds to the other side in the kernel's float32 arithmetic: 1e-3) ...
            groups = x.double().view(rows, -1, 32)
            step = groups.abs().amax(-1, keepdim=True) / 127
            x8 = (torch.round(groups / step) * step).view(rows, inp)
            ref_q4 = F.linear(x8, q4.dequantized(torch.float64), q4.bias.double())
            assert (got - ref_q4).abs().max() <= 1e-3 * ref_q4.abs().max()
            # ... which is within 1% of the output's largest of the product of x itself
            ref_x = F.linear(x.double(), q4.dequantized(torch.float64), q4.bias.double())
            assert (got - ref_x).abs().max() <= 1e-2 * ref_x.abs().max()
            # bfloat16 inputs and scales: the float32 kernel's arithmetic on the same values, rounded once at the end
            qb = Int4Linear(torch.nn.Linear(inp, out), 32, torch.bfloat16)
            got_b = ops.gemv_q4(xb, qb.packed, qb.scales_mins, qb.bias, out, 32)
            as_f32 = ops.gemv_q4(xb.float(), qb.packed, qb.scales_mins.float(), qb.bias.float(), out, 32)
            assert torch.equal(got_b, as_f32.bfloat16())


def test_each_kernel_equals_pytorchs_product():
    check_kernels(needs_kernels())


def test_kernels_built_without_vnni_and_bf16_equal_pytorchs_product(tmp_path):
    # Another process: a process holds one build of the kernels, and this one has this CPU's.
    needs_kernels()
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import torch; from glassgpt.device import cpu_flags\n"
              "from glassgpt.engine import native; import test_engine\n"
              "ops = native.load(cpu_flags() - {'avx512_vnni', 'avx512_bf16'})\n"
              "assert ops is not None, native.status(); assert ops.features() == 0, ops.features()\n"
              "test_engine.check_kernels(ops); print('ok')")
    import subprocess
    import sys
    from pathlib import Path
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def choose_all(engine: Engine, linear: str, attention: str) -> None:
    """Make every decision of the engine's autotune `linear` ("glassgpt"/"torch") and `attention`."""
    cfg = engine.cfg
    winners = {f"linear {o}x{i}": linear for o, i in autotune.linear_shapes(cfg)}
    winners.update({"attention decode": attention, "attention prompt": attention, "step": "engine"})
    engine.choices = autotune.Choices("test", autotune.precision_of(engine.fast), winners)
    autotune.apply(engine.fast, engine.choices)


@pytest.mark.parametrize("linear, attention", [("glassgpt", "blocks"), ("glassgpt", "sdpa"), ("torch", "sdpa"),
                                               ("torch", "blocks")])
def test_greedy_tokens_on_each_kernel_and_attention_path_equal_the_glass_models(trained, linear, attention):
    if linear == "glassgpt":
        needs_gemv()  # the whole kernels, or their AVX2 build of the float products
    model, ids = trained
    prompt = prompts(ids)
    engine = Engine(model)
    choose_all(engine, linear, attention)
    assert all(m.gemv is not None for m in engine.fast.modules() if isinstance(m, torch.nn.Linear)) == (linear == "glassgpt")
    assert torch.equal(generate(engine, prompt, 30), generate(model, prompt, 30, use_cache=False))
    # and a prefill of more rows than the kernel takes gives the same logits (PyTorch's matmul)
    x = torch.tensor(ids[:40])[None]
    torch.testing.assert_close(engine(x), model(x), atol=1e-5, rtol=1e-5)


def test_int8_kernel_gives_the_pure_pytorch_paths_greedy_tokens(trained):
    needs_kernels()
    model, ids = trained
    prompt = prompts(ids)
    quantized = quantize_int8(copy_of(model))
    fast, plain = Engine(quantized), Engine(quantized)
    choose_all(fast, "glassgpt", "sdpa")
    choose_all(plain, "torch", "sdpa")
    assert torch.equal(generate(fast, prompt, 30), generate(plain, prompt, 30))


@torch.inference_mode()
def decoding_perplexity(engine: Engine, ids: list[int], window: int = 64) -> float:
    """Perplexity as generation computes it: each window fed one token at a time through the KV
    cache, all windows as one batch (8 rows: the matrix-vector kernels' case)."""
    data = torch.tensor(ids[: (len(ids) - 1) // window * window + 1])
    x, y = data[:-1].view(-1, window), data[1:].view(-1, window)
    cache = KVCache(engine.cfg, x.shape[0], window, dtype=engine.model.tok_emb.weight.dtype)
    logits = torch.cat([engine(x[:, i:i + 1], cache, last_only=True) for i in range(window)], dim=1)
    return math.exp(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item())


def test_int4_kernels_decoding_perplexity_is_within_two_percent_of_float32(trained):
    needs_kernels()
    model, ids = trained
    fast = Engine(quantize_int4(copy_of(model)))
    choose_all(fast, "glassgpt", "sdpa")
    base, int4 = decoding_perplexity(Engine(model), ids), decoding_perplexity(fast, ids)
    assert abs(base / perplexity(model, ids) - 1) < 1e-4  # the same sums as the whole-window forward
    assert abs(int4 / base - 1) < 0.02, (base, int4)


def test_compiled_kernels_give_the_eager_kernels_tokens(trained):
    needs_kernels()
    model, ids = trained
    prompt = prompts(ids, n=1)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_for_generation(quantize_int8(copy_of(model)))
    choose_all(compiled, "glassgpt", "sdpa")
    eager = Engine(quantize_int8(copy_of(model)))
    choose_all(eager, "glassgpt", "sdpa")
    assert torch.equal(generate(compiled, prompt, 20), generate(eager, prompt, 20))
    assert not counters["graph_break"]


def test_two_compiled_models_in_one_process_each_run_their_own_graphs(trained):
    # Without guards on the modules (compile_for_generation's option), graphs kept on a shared
    # forward code would let the second model run the first one's.
    model, ids = trained
    prompt = prompts(ids, n=1)
    torch._dynamo.reset()
    models = [copy_of(model, torch.bfloat16), quantize_int8(copy_of(model)), quantize_int4(copy_of(model))]
    with torch.inference_mode():  # as benchmarks/ runs them (this failed before: KeyError 'weight')
        for m in models:
            assert torch.equal(generate(compile_for_generation(m), prompt, 8), generate(Engine(m), prompt, 8))


def test_a_cpu_without_avx512_runs_pytorchs_operators_and_says_why():
    assert native.load(frozenset({"avx2", "fma"})) is None
    assert "lacks avx512f" in native.status()


def test_a_kernel_that_fails_to_build_falls_back_and_says_so_in_one_line(tmp_path, monkeypatch):
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "gemv.cpp").write_text("this is not C++\n")
    (broken / "ops.cpp").write_text("\n")
    monkeypatch.setattr(native, "SOURCES", broken)
    # (the ISA the kernels are written for, whatever this CPU has: the build itself is what fails)
    assert native.load(flags=frozenset(native.REQUIRED), directory=tmp_path / "build") is None
    status = native.status()
    assert status.startswith("building the kernels failed") and "\n" not in status and "Traceback" not in status


def test_cli_without_kernels_generates_and_says_why_in_one_note(tmp_path, capsys, monkeypatch):
    cfg = dataclasses.replace(glassgpt.PRESETS["gpt2"], emb_dim=32, n_heads=2, n_layers=1, context_length=32)
    path = glassgpt.save_model(glassgpt.load_model("gpt2", config=cfg), tmp_path / "ckpt")
    monkeypatch.setattr(native, "_load", lambda flags, directory: None)
    monkeypatch.setattr(native, "_status", "no C++ compiler (g++) found: install one")
    monkeypatch.setattr(autotune, "_memo", {})
    native._load_once.cache_clear()
    try:
        assert main(["generate", "Every effort", "--model", str(path), "--dtype", "int8", "--max-new-tokens", "2",
                     "--json"]) == 0
    finally:
        native._load_once.cache_clear()
    err = capsys.readouterr().err
    assert err.count("note: glassgpt's CPU kernels are not used: no C++ compiler") == 1 and "Traceback" not in err


def test_a_missing_kernel_is_said_once_per_process(monkeypatch):
    import warnings
    monkeypatch.setattr(native, "_load", lambda flags, directory: None)
    native._load_once.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert native.load() is None and native.load() is None
        assert len([w for w in caught if issubclass(w.category, glassgpt.errors.KernelWarning)]) == 1
    finally:
        native._load_once.cache_clear()


def test_autotune_measures_once_per_machine_and_reads_the_choice_back(tmp_path, monkeypatch):
    cfg = GPTConfig(vocab_size=96, context_length=32, emb_dim=64, n_heads=4, n_layers=1)
    cache = tmp_path / "autotune.json"
    monkeypatch.setattr(autotune, "TRIES", 1)  # every measurement settles (a close one is measured again: below)
    torch.manual_seed(0)
    first = autotune.choose(cfg, "float32", cache)
    drawn = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(4))  # measuring leaves torch's generator alone (a seeded run is the same either way)
    assert not first.cached and cache.exists()
    assert set(first.winners) == {f"linear {o}x{i}" for o, i in autotune.linear_shapes(cfg)} | {
        "attention decode", "attention prompt"}
    monkeypatch.setattr(autotune, "_memo", {})
    again = autotune.choose(cfg, "float32", cache)
    assert again.cached and again.winners == first.winners
    assert "kernels: float32 matrix-vector products" in autotune.describe(again, cfg)


class FakeClock:
    """autotune's clock, advanced only by the candidates: each call of a candidate takes the next of its times (ms),
    cycling."""
    def __init__(self, monkeypatch, **ms):
        self.now, self.ms = 0.0, {name: itertools.cycle(times) for name, times in ms.items()}
        monkeypatch.setattr(autotune.time, "perf_counter", lambda: self.now)

    def candidates(self) -> dict:
        def call(name):
            def run():
                self.now += next(self.ms[name]) / 1e3
            return run
        return {name: call(name) for name in self.ms}


def test_a_close_or_disturbed_measurement_is_taken_again_at_the_next_process_and_kept_at_its_least_disturbed(
        monkeypatch):
    """A lead under SETTLED_LEAD, or runs whose median strays past STEADY of their least disturbed, leave the
    decision unsettled: the next process measures it again, each candidate keeping its least disturbed time."""
    choices = autotune.Choices("here", "float32")
    autotune.measure(choices, "linear 8x8", FakeClock(monkeypatch, torch=[1.0], glassgpt=[1.05]).candidates())
    assert choices.winners["linear 8x8"] == "torch" and choices.unsettled == {"linear 8x8": 1}  # a 5% lead
    assert not choices.due("linear 8x8")  # (this process measured it)
    later = autotune.Choices("here", "float32", choices.winners, choices.ms, unsettled=choices.unsettled)
    assert later.due("linear 8x8")
    # the quiet machine: the kernel twice as fast; torch's earlier 1.0 ms is kept as its least disturbed
    autotune.measure(later, "linear 8x8", FakeClock(monkeypatch, torch=[2.0], glassgpt=[0.5]).candidates())
    assert later.winners["linear 8x8"] == "glassgpt" and later.ms["linear 8x8"] == pytest.approx({"torch": 1.0, "glassgpt": 0.5})
    assert later.unsettled == {}

    # a clear lead, but runs disturbed: every other run of torch 5x its least
    choices = autotune.Choices("here", "float32")
    autotune.measure(choices, "linear 8x8", FakeClock(monkeypatch, glassgpt=[0.9], torch=[9.0, 1.8]).candidates())
    assert choices.winners["linear 8x8"] == "glassgpt" and choices.unsettled == {"linear 8x8": 1}
    autotune.measure(choices, "linear 8x8", FakeClock(monkeypatch, glassgpt=[0.9], torch=[1.8]).candidates())
    assert choices.unsettled == {}  # steady and a 2x lead: settled

    # close every time: settled after TRIES measurements, the least disturbed of each kept
    choices = autotune.Choices("here", "float32")
    for tries in range(1, autotune.TRIES + 1):
        autotune.measure(choices, "linear 8x8", FakeClock(monkeypatch, torch=[1.0 + tries / 100], glassgpt=[1.0]).candidates())
        assert choices.unsettled == ({"linear 8x8": tries} if tries < autotune.TRIES else {})
    assert choices.ms["linear 8x8"] == pytest.approx({"torch": 1.01, "glassgpt": 1.0})
    assert autotune.Choices("here", "float32", {"linear 8x8": "torch"}).due("linear 8x8") is False  # a settled one


def test_choose_measures_again_only_the_unsettled_decisions_of_earlier_processes(tmp_path, monkeypatch):
    cfg = GPTConfig(vocab_size=96, context_length=32, emb_dim=64, n_heads=4, n_layers=1)
    cache = tmp_path / "autotune.json"
    monkeypatch.setattr(autotune, "_memo", {})
    first = autotune.choose(cfg, "float32", cache)
    first.unsettled = {"linear 256x64": 1, "attention prompt": 2}
    autotune.save(first)
    monkeypatch.setattr(autotune, "_memo", {})
    measured = []
    real = autotune.measure
    monkeypatch.setattr(autotune, "TRIES", 3)
    monkeypatch.setattr(autotune, "measure", lambda c, decision, *a, **k: measured.append(decision) or real(c, decision, *a, **k))
    again = autotune.choose(cfg, "float32", cache)
    assert sorted(measured) == ["attention prompt", "linear 256x64"]
    saved = json.loads(cache.read_text())[again.key]
    assert "attention prompt" not in saved["unsettled"]  # its third measurement: settled whatever it found
    assert saved["unsettled"].get("linear 256x64", 2) == 2 and set(saved["winners"]) == set(first.winners)
    monkeypatch.setattr(autotune, "_memo", {})
    measured.clear()
    autotune.choose(cfg, "float32", cache)
    assert measured == (["linear 256x64"] if "linear 256x64" in saved["unsettled"] else [])


@pytest.mark.parametrize("kind, kernel", [("int4", "gemv_q4"), ("int8", "gemv_q8"), ("int8", None)])
def test_a_quantized_layer_gives_the_gradient_of_its_input_on_every_path(kind, kernel):
    """glassgpt's kernels and torch._weight_int8pack_mm have no backward: an input that needs its gradient (a
    reader's attribution, LoRA layers upstream) takes the dequantized weight's F.linear instead, whose gradient
    is the weight's column sums for y.sum(). The kernels once returned outputs that carried no gradient."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    layer = Int4Linear(linear, dtype=torch.float32) if kind == "int4" else Int8Linear(linear, torch.float32)
    if kernel is not None:
        needs_kernels()
        layer.gemv = getattr(native.load(), kernel)
    weight = layer.dequantized(torch.float32) if kind == "int4" else layer.weight.float() * layer.scales[:, None]
    x = torch.randn(4, 64, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(4, -1), rtol=0, atol=1e-5)  # float32 sums of 32 terms
    with torch.no_grad():  # no gradient asked: the kernel (or int8pack_mm) runs, as in decoding
        torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=0, atol=2e-2 if kind == "int4" else 1e-4)


def gelu_float64(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form in float64, written as x / (1 + exp(-2u)): the same function as 0.5 x (1 + tanh(u)) without its
    cancellation (in float64 1 + tanh(u) is 0 from x = -7.2 on, where the value is still -1e-16)."""
    x = x.double()
    return x / (1 + torch.exp(-2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def test_the_gelu_kernel_is_torchs_tanh_gelu_within_float_rounding():
    """glassgpt's gelu_tanh (gemv.h's gelu16, the native step's) against float64: float32 within 2e-6 relative where
    |y| > 1e-3 and 1e-6 absolute (measured: 1.1e-6 and 5.2e-7, where torch's own float32 gelu is 4.9e-5 relative),
    bf16 at most one bf16 step from the float64 value. An odd length over two threads; NaN stays NaN."""
    needs_kernels()
    ops = native.load()
    torch.manual_seed(0)
    x = torch.cat([torch.randn(100_003) * 3, torch.linspace(-30, 30, 10_001), torch.tensor([0.0, -0.0, 1e-30, 88.0, -88.0, 1e4])])
    exact = gelu_float64(x)
    with torch.inference_mode():
        y = ops.gelu_tanh(x)
    big = exact.abs() > 1e-3
    assert ((y.double() - exact).abs() / exact.abs())[big].max() <= 2e-6
    assert (y.double() - exact).abs().max() <= 1e-6
    xb = x.bfloat16()
    exact = gelu_float64(xb)
    # a bf16 step at the value, or 1e-30 in the far tail (exp16 is clamped: -88 gives -2.6e-37 against -1e-10000)
    step = (exact.abs() * 2 ** -7).clamp(min=1e-30)
    assert ((ops.gelu_tanh(xb).double() - exact).abs() <= step).all()
    assert ops.gelu_tanh(torch.tensor([float("nan"), 1.0])).isnan().tolist() == [True, False]


@pytest.mark.parametrize("winner", ["glassgpt", "torch"])
def test_the_twins_gelu_runs_the_kernel_only_where_measured_faster_and_never_with_a_gradient(winner, monkeypatch):
    needs_kernels()
    cfg = GPTConfig(vocab_size=96, context_length=32, emb_dim=64, n_heads=4, n_layers=1)
    twin = fused(glassgpt.load_model("gpt2", config=cfg, seed=0).eval())
    autotune.apply(twin, autotune.Choices("here", "float32", {autotune.GELU_DECISION: winner}))
    gelu = twin.trf_blocks[0].ff.layers[1]
    assert type(gelu).__name__ == "FusedGELU" and (gelu.kernel is not None) == (winner == "glassgpt")
    calls = []
    if gelu.kernel is not None:
        kernel = gelu.kernel
        monkeypatch.setattr(gelu, "kernel", lambda x: calls.append(x.shape) or kernel(x))
    x = torch.randn(2, 5, 4 * cfg.emb_dim, requires_grad=True)
    gelu(x).sum().backward()  # a gradient asked: F.gelu, whose backward exists
    assert calls == [] and x.grad is not None
    with torch.inference_mode():
        y = gelu(x)
    assert calls == ([(2, 5, 4 * cfg.emb_dim)] if winner == "glassgpt" else [])
    torch.testing.assert_close(y, F.gelu(x.detach(), approximate="tanh"), rtol=0, atol=1e-6)


def counted_ff_layer(model, precision: str, prompt_winner: str, monkeypatch) -> tuple[torch.nn.Module, list[int]]:
    """The first FF layer of `model`'s fused twin, given the kernel for every shape and `prompt_winner` for the prompt
    decision, and the list its kernel calls append their row counts to."""
    needs_kernels()
    twin = fused(model.eval())
    autotune.apply(twin, autotune.Choices("here", precision, {f"linear {o}x{i}": "glassgpt"
                                                              for o, i in autotune.linear_shapes(model.cfg)}
                                          | {autotune.PROMPT: prompt_winner}))
    layer, calls = twin.trf_blocks[0].ff.layers[0], []
    kernel = layer.gemv
    monkeypatch.setattr(layer, "gemv", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    return layer, calls


@pytest.mark.parametrize("prompt_winner", ["glassgpt", "torch"])
def test_a_short_prompt_runs_the_kernel_only_where_it_was_measured_faster_at_prompt_rows(prompt_winner, monkeypatch):
    """Past GEMV_MAX_ROWS rows (a prompt) a float layer runs the kernel only where autotune timed it faster than
    PyTorch's matmul at PROMPT_ROWS rows (the "linear prompt" decision); it still equals F.linear there."""
    cfg = GPTConfig(vocab_size=96, context_length=48, emb_dim=64, n_heads=4, n_layers=1)
    layer, calls = counted_ff_layer(glassgpt.load_model("gpt2", config=cfg, seed=0), "float32", prompt_winner, monkeypatch)
    x = torch.randn(1, 16, cfg.emb_dim)
    with torch.inference_mode():
        y = layer(x)
        layer(x[:, :4])
    expected = [16, 4] if prompt_winner == "glassgpt" else [4]
    assert calls == expected and layer.max_rows == (autotune.PROMPT_ROWS["float32"] if prompt_winner == "glassgpt" else 8)
    ref = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # float32: the sums in another order


@pytest.mark.parametrize("prompt_winner", ["glassgpt", "torch"])
def test_a_long_int4_prompt_runs_the_kernel_only_where_it_was_measured_faster(prompt_winner, monkeypatch):
    """int4: past QUANTIZED_GEMV_MAX_ROWS rows the kernel runs (at any length) only where autotune timed it faster
    than dequantizing the weight and multiplying at PROMPT_ROWS["int4"] rows; its rounding of x to int8 per group
    keeps it within 1% of the product of x itself, as for a short prompt (check_kernels)."""
    cfg = GPTConfig(vocab_size=96, context_length=128, emb_dim=64, n_heads=4, n_layers=1)
    model = quantize_int4(glassgpt.load_model("gpt2", config=cfg, seed=0))
    layer, calls = counted_ff_layer(model, "int4", prompt_winner, monkeypatch)
    x = torch.randn(1, 100, cfg.emb_dim, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)
    assert calls == ([100] if prompt_winner == "glassgpt" else [])
    ref = F.linear(x.double(), layer.dequantized(torch.float64), layer.bias.double())
    assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_tune_measures_the_prompt_decision_once_and_keeps_it(tmp_path, monkeypatch):
    """A machine's earlier choices without the prompt and GELU decisions gain them at the next tune, measured once
    and saved."""
    needs_kernels()
    cfg = GPTConfig(vocab_size=96, context_length=32, emb_dim=64, n_heads=4, n_layers=1)
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(autotune, "_memo", {})
    model = glassgpt.load_model("gpt2", config=cfg, seed=0).eval()
    choices = autotune.choose(cfg, "float32")
    choices.winners[f"linear {4 * cfg.emb_dim}x{cfg.emb_dim}"] = "glassgpt"  # as where the kernel won one row
    autotune.save(choices)
    measured = []
    real = autotune.measure
    monkeypatch.setattr(autotune, "measure", lambda c, decision, *a, **k: measured.append(decision) or real(c, decision, *a, **k))
    autotune.tune(fused(model))
    autotune.tune(fused(model))
    assert measured == [autotune.PROMPT, autotune.GELU_DECISION]
    saved = json.loads((tmp_path / "autotune.json").read_text())[choices.key]
    assert set(saved["ms"][autotune.PROMPT]) == {"torch", "glassgpt"} and saved["winners"][autotune.PROMPT] in ("torch", "glassgpt")


def test_the_twins_quick_shallow_copy_is_copy_copy_for_every_module_it_meets(trained):
    import copy
    import importlib

    fused_module = importlib.import_module("glassgpt.engine.fused")  # (the package's `fused` is the function)
    model = quantize_int4(copy_of(trained[0]))
    model.trf_blocks[0].ff.layers[0] = Int8Linear(torch.nn.Linear(model.cfg.emb_dim, 4 * model.cfg.emb_dim), torch.float32)
    for module in model.modules():
        quick, slow = fused_module._shallow_copy(module), copy.copy(module)
        assert type(quick) is type(slow) and quick is not module
        assert quick.__dict__.keys() == slow.__dict__.keys()
        assert all(quick.__dict__[k] is slow.__dict__[k] for k in slow.__dict__)  # the same objects, not copies

    class Odd(torch.nn.Linear):  # a class that copies itself its own way keeps its way
        def __copy__(self):
            return "its own"
    assert fused_module._shallow_copy(Odd(2, 2)) == "its own"
