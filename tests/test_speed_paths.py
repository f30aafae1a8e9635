"""Every fast path gives the answers of the plain float32 forward.

The fast paths: the KV cache (allocated once, sized to the request, written in place),
bfloat16 weights, torch.compile, and int8 weight-only quantization (quantize.py).
They are checked on a small model trained for a few seconds on "The Verdict" (or a
built-in text when ../shared/data is absent), so that its next-token choices have
real margins, as a trained GPT-2's do; random weights make near-ties that any
rounding flips. Stated tolerances:

- bfloat16: the same greedy tokens; logits within 0.1 + 2% of their size (bf16 keeps
  8 bits of mantissa, about 0.4% per rounding, over a few roundings per block).
- int8: the same greedy tokens; perplexity within 1% of float32's.

Speed itself is never asserted here: benchmarks/ measures it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import glassgpt
from glassgpt.cli import main
from glassgpt.generate import compile_for_generation, generate, stream
from glassgpt.model import KVCache
from glassgpt.quantize import INT8_KERNEL_MAX_ROWS, Int8Linear, is_quantized, quantize_int8
from glassgpt.weights import random_model

from conftest import SHARED_DATA

FALLBACK_TEXT = (  # the first 400 characters of The Verdict, exactly: the same model either way
    'I HAD always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so '
    'it was no great surprise to me to hear that, in the height of his glory, he had dropped '
    'his painting, married a rich widow, and established himself in a villa on the Riviera. '
    '(Though I rather thought it would have been Rome or Florence.)\n\n"The height of his '
    'glory"--that was what the women called it. I can hear'
)


def trained_model(chars: int = 400, steps: int = 200) -> tuple[glassgpt.GPTModel, list[int]]:
    """A 2-block model that has learnt the first `chars` characters of The Verdict by heart."""
    path = SHARED_DATA / "the-verdict.txt"
    text = (path.read_text(encoding="utf-8") if path.is_file() else FALLBACK_TEXT)[:chars]
    ids = glassgpt.get_tokenizer("char", text=text).encode(text)
    cfg = glassgpt.GPTConfig(vocab_size=max(ids) + 1, context_length=64, emb_dim=64, n_heads=4, n_layers=2)
    model = random_model(cfg, torch.device("cpu"), torch.float32, seed=0).train()
    data = torch.tensor(ids)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (16,), generator=gen)
        x = torch.stack([data[s:s + 64] for s in starts])
        y = torch.stack([data[s + 1:s + 65] for s in starts])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), ids


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


def copy_of(model: glassgpt.GPTModel, dtype: torch.dtype = torch.float32) -> glassgpt.GPTModel:
    clone = random_model(model.cfg, torch.device("cpu"), torch.float32)
    clone.load_state_dict(model.state_dict())
    return clone.to(dtype).eval()


@torch.no_grad()
def perplexity(model: glassgpt.GPTModel, ids: list[int], window: int = 64) -> float:
    data = torch.tensor(ids[: (len(ids) - 1) // window * window + 1])
    x = data[:-1].view(-1, window)
    y = data[1:].view(-1, window)
    logits = model(x).float()
    return math.exp(F.cross_entropy(logits.flatten(0, 1), y.flatten()).item())


def prompts(ids: list[int], n: int = 4, length: int = 12) -> torch.Tensor:
    step = len(ids) // n
    return torch.tensor([ids[i * step: i * step + length] for i in range(n)])


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
        model(prompts(ids, n=1, length=9), cache)


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
        got = copy_of(model, torch.bfloat16)(x).float()
    torch.testing.assert_close(got, ref, atol=0.1, rtol=0.02)


# --- torch.compile --------------------------------------------------------------------------

def test_compiled_greedy_tokens_equal_eager_tokens(trained):
    model, ids = trained
    prompt = prompts(ids, n=2)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_for_generation(copy_of(model))
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
    # fused dot products (quantize.py) instead of the int8 kernel.
    model, ids = trained
    prompt = prompts(ids, n=1)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = compile_for_generation(quantize_int8(copy_of(model)))
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


def test_int8_perplexity_is_within_one_percent_of_float32(trained):
    model, ids = trained
    base = perplexity(model, ids)
    int8 = perplexity(quantize_int8(copy_of(model)), ids)
    assert base < 5, "the fixture model did not learn its text"
    assert abs(int8 / base - 1) < 0.01, (base, int8)


def test_int8_streams_one_id_per_row_and_step(trained):
    model, ids = trained
    steps = list(stream(quantize_int8(copy_of(model)), prompts(ids, n=3), 5))
    assert len(steps) == 5 and all(s.shape == (3,) for s in steps)


def test_cli_generates_with_int8_weights(tmp_path, capsys):
    cfg = dataclasses.replace(glassgpt.PRESETS["gpt2"], emb_dim=32, n_heads=2, n_layers=2, context_length=32)
    path = glassgpt.save_model(glassgpt.load_model("gpt2", config=cfg), tmp_path / "ckpt")
    assert main(["generate", "Every effort moves you", "--model", str(path), "--dtype", "int8",
                 "--max-new-tokens", "3", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert len(out["new_ids"]) == 3
