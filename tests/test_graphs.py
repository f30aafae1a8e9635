"""The CUDA graph's decoding step (engine/graphs.py) computes the engine's step.

A graph replays one recorded step, so `GraphStep.static_step` has the same shapes at every position:
the position is a tensor, and attention reads the whole cache with the later positions masked. That
step is plain PyTorch and runs on a CPU (capture=False), so it is checked here against the engine's
own one-token forward; the recording itself needs a GPU (benchmarks/gpu_check.sh compares a graph's
greedy tokens with the eager engine's there). Tolerances: float32 logits within 1e-5 of the row's
largest (attention over a masked full cache sums the same terms, some of them exact zeros, in
another order); bfloat16 within 2%; greedy tokens identical.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import glassgpt
from glassgpt.engine import Engine, KVCache
from glassgpt.engine.graphs import GraphStep, why_not
from glassgpt.training.tasks.lora import apply_lora

from conftest import randomize_


def model_of(dtype=torch.float32, **changes) -> glassgpt.GPTModel:
    cfg = dataclasses.replace(glassgpt.GPTConfig(vocab_size=97, context_length=24, emb_dim=64, n_heads=4,
                                                 n_layers=2, qkv_bias=True), **changes)
    model = glassgpt.load_model("gpt2", device="cpu", dtype="float32", seed=0, config=cfg)
    return randomize_(model, seed=0, std=0.3).to(dtype).eval()


def prefilled(engine: Engine, prompt: torch.Tensor, max_len: int) -> KVCache:
    cache = KVCache(engine.cfg, prompt.shape[0], max_len=max_len, dtype=engine.model.tok_emb.weight.dtype)
    engine.prefill(prompt, cache)
    return cache


def eager_step(engine: Engine, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return engine(ids[:, None], cache, last_only=True)[:, -1]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch", [1, 3])
def test_static_step_is_the_engines_step(dtype, tol, batch):
    engine = Engine(model_of(dtype))
    prompt = torch.randint(0, 97, (batch, 5), generator=torch.Generator().manual_seed(batch))
    ours, theirs = prefilled(engine, prompt, 16), prefilled(engine, prompt, 16)
    graph = GraphStep(engine.fast, ours, capture=False)
    ids = prompt[:, -1]
    with torch.inference_mode():
        for _ in range(16 - 5):
            got, want = graph(ids).float(), eager_step(engine, ids, theirs).float()
            scale = want.abs().amax(dim=-1, keepdim=True)
            assert ((got - want).abs() / scale).max() < tol
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            ids = want.argmax(-1)
    assert ours.pos == theirs.pos == 16


def test_uninitialised_cache_memory_does_not_reach_the_logits():
    """The cache's later positions may hold NaN (torch.empty); the step's own tensors are zeroed, so the
    masked positions contribute exact zeros. Without the zeroing, 0 x NaN would make every logit NaN."""
    engine = Engine(model_of())
    prompt = torch.tensor([[3, 14, 15, 92]])
    cache = KVCache(engine.cfg, 1, max_len=12)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    engine.prefill(prompt, cache)
    graph = GraphStep(engine.fast, cache, capture=False)
    assert all(torch.isfinite(t).all() for t in graph.k + graph.v)
    with torch.inference_mode():
        assert torch.isfinite(graph(prompt[:, -1])).all()
    # the same step over tensors that keep the NaN (what adopting without zeroing would leave)
    for t in graph.k + graph.v:
        t[:, :, cache.pos + 1:].fill_(float("nan"))
    with torch.inference_mode():
        assert torch.isnan(graph(prompt[:, -1])).all()


def test_a_second_cache_takes_the_step_and_the_first_goes_on_correctly():
    """One graph serves every generate call of one shape (`adopt`); a cache it leaves keeps its own copy."""
    engine = Engine(model_of())
    a_prompt, b_prompt = torch.tensor([[1, 2, 3]]), torch.tensor([[40, 41, 42]])
    a, b = prefilled(engine, a_prompt, 10), prefilled(engine, b_prompt, 10)
    a_ref, b_ref = prefilled(engine, a_prompt, 10), prefilled(engine, b_prompt, 10)
    graph = GraphStep(engine.fast, a, capture=False)
    assert a.k[0] is graph.k[0]  # the first cache's tensors are the step's: no second copy
    with torch.inference_mode():
        graph(a_prompt[:, -1])
        eager_step(engine, a_prompt[:, -1], a_ref)
        graph.adopt(b)
        assert graph.cache is b and b.k[0] is graph.k[0] and a.k[0] is not graph.k[0]
        torch.testing.assert_close(graph(b_prompt[:, -1]), eager_step(engine, b_prompt[:, -1], b_ref),
                                   rtol=0, atol=1e-5)
        # the first cache, now on its own tensors, steps on through the engine's forward
        torch.testing.assert_close(eager_step(engine, torch.tensor([7]), a), eager_step(engine, torch.tensor([7]), a_ref),
                                   rtol=0, atol=1e-5)


def test_a_full_cache_is_refused():
    engine = Engine(model_of())
    cache = prefilled(engine, torch.tensor([[1, 2, 3, 4]]), 4)
    graph = GraphStep(engine.fast, cache, capture=False)
    with pytest.raises(glassgpt.errors.PromptError, match="all filled"):
        graph(torch.tensor([4]))


def test_why_not_names_each_cause():
    model = model_of()
    assert why_not(model, KVCache(model.cfg, 1, max_len=8)) == "it runs on a CUDA device only"
    cuda = SimpleNamespace(k=[SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32)])  # read: device, dtype
    assert why_not(model, cuda) is None
    assert why_not(model_of(drop_rate=0.1).train(), cuda) == "the model is in training mode (dropout)"
    assert why_not(model_of(drop_rate=0.0).train(), cuda) is None  # no dropout: training mode changes nothing
    lora = apply_lora(model_of(), rank=2, alpha=4.0)
    assert why_not(lora, cuda) == "its Linear layers are not all plain nn.Linear (LoRA, int8 and int4 layers are not)"
    int8 = glassgpt.engine.quantize_int8(model_of())
    assert why_not(int8, cuda) == why_not(lora, cuda)
    assert why_not(model_of(torch.bfloat16), cuda) == "the KV cache's dtype is not the model's"
    assert why_not(torch.nn.Linear(2, 2), cuda) == "it runs GPTModel only, not Linear"


def test_padded_linear_is_f_linear_with_its_gradients():
    """engine/linear.py's padded head (a GPU's training): the same outputs and gradients as F.linear, to the
    bit on a CPU (each output is the same dot product; the extra rows are zeros, sliced off)."""
    from glassgpt.engine.linear import padded_linear
    torch.manual_seed(0)
    for bias in (False, True):
        x = torch.randn(2, 5, 16, requires_grad=True)
        w = torch.randn(97, 16, requires_grad=True)
        b = torch.randn(97, requires_grad=True) if bias else None
        got = padded_linear(x, w, b, 64)
        assert got.shape == (2, 5, 97)
        grads = torch.autograd.grad(got.square().sum(), [x, w] + ([b] if bias else []))
        want = F.linear(x, w, b)
        want_grads = torch.autograd.grad(want.square().sum(), [x, w] + ([b] if bias else []))
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for g, wg in zip(grads, want_grads):
            torch.testing.assert_close(g, wg, rtol=1e-5, atol=1e-5)


def test_the_head_is_padded_only_on_a_gpu_in_training(monkeypatch):
    """A CPU (the book's bit-for-bit runs) and decoding (which would copy the head at every token) never pad."""
    from glassgpt.engine import linear
    calls = []
    monkeypatch.setattr(linear, "padded_linear", lambda *a: calls.append(a) or F.linear(*a[:3]))
    head = linear.GemvLinear(16, 5000, bias=False)
    head(torch.randn(3, 16, requires_grad=True)).sum().backward()
    assert calls == []  # a CPU
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    with torch.no_grad():
        head(torch.randn(3, 16))
    assert calls == []  # no gradient: decoding
    head(torch.randn(3, 16, requires_grad=True))
    assert len(calls) == 1 and calls[0][3] == 64
    head.pad_to = None
    head(torch.randn(3, 16, requires_grad=True))
    assert len(calls) == 1


def test_a_finished_generates_cache_is_not_kept_alive_or_copied():
    engine = Engine(model_of())
    graph = GraphStep(engine.fast, prefilled(engine, torch.tensor([[1, 2, 3]]), 10), capture=False)
    assert graph.cache is None  # nothing held the cache: the step does not keep it
    nxt = prefilled(engine, torch.tensor([[5, 6]]), 10)
    graph.adopt(nxt)  # nothing to hand back to a cache no one uses
    assert graph.cache is nxt and nxt.k[0] is graph.k[0]


def test_a_graph_that_cannot_be_recorded_falls_back_with_one_note(monkeypatch):
    """Recording can fail on a GPU (a kernel that cannot be captured): the engine's forward runs instead, said
    once, and the engine does not try again for that shape."""
    from glassgpt.engine import decode
    from glassgpt.errors import KernelWarning

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode, "why_no_graph", lambda model, cache: None)
    monkeypatch.setattr(decode, "GraphStep", refuse)
    monkeypatch.setattr(decode, "_said", set())
    engine = Engine(model_of())
    cache = prefilled(engine, torch.tensor([[1, 2, 3]]), 8)
    with pytest.warns(KernelWarning, match=r"CUDA graph of the decoding step does not run here: recording it "
                                           r"failed \(RuntimeError: operation not permitted"):
        assert engine.graph_step(cache) is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engine.graph_step(cache) is None  # not tried again, not said again
    engine.use_graphs = False
    assert engine.graph_step(cache) is None


def test_generate_through_the_graph_step_gives_the_engines_tokens_and_reuses_one_step(monkeypatch):
    """The engine's seam end to end, with the graph's step (unrecorded, on a CPU) where a GPU would record it:
    two generate calls of one shape share one step (the second cache adopted), and the tokens are the
    PyTorch engine's."""
    from glassgpt.engine import decode
    from glassgpt.generate import generate
    made = []

    def unrecorded(fast, cache, compiled=False):
        made.append(GraphStep(fast, cache, capture=False))
        return made[-1]

    monkeypatch.setattr(decode, "why_no_graph", lambda model, cache: None)
    monkeypatch.setattr(decode, "GraphStep", unrecorded)
    model = model_of()
    plain = Engine(model)
    plain.native_step = lambda cache: None  # the PyTorch engine's own step
    graphed = Engine(model)
    graphed.native_step = graphed.graph_step  # what decode_one does on a GPU
    for prompt in ([[3, 1, 4, 1]], [[2, 7, 1, 8]]):
        want = generate(plain, torch.tensor(prompt), 12)
        got = generate(graphed, torch.tensor(prompt), 12)
        assert torch.equal(got, want)
    assert len(made) == 1  # the second call's cache was adopted, not recorded again
