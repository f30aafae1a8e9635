"""Padded positions left out of training's forward (engine/packing.py) change nothing but the time.

A batch padded as the book's custom_collate_fn pads it, on a small model in the book's layout with
qkv biases, through the fused twin a training run steps: the packed loss, and every gradient, equal
the padded forward's within float32 rounding (stated: the loss within 1e-6 relative, each gradient
within 1e-5 of the model's largest gradient entry), on both attention paths a training step may
take. The positions packing leaves out are truly unread (their ids changed, the packed loss is the
same bit for bit), and packing runs only where it may: never on the exact run, with dropout, on the
glass model, or through a wrapper.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import glassgpt
from glassgpt.engine import packing
from glassgpt.engine.fused import FusedAttention, fused
from glassgpt.engine.loss import cross_entropy
from glassgpt.training.book import ch07

CFG = glassgpt.GPTConfig(vocab_size=50257, context_length=64, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
                         qkv_bias=True, tie_embeddings=False)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return glassgpt.GPTModel(CFG).train()


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Eight records of 5 to 40 ids, as custom_collate_fn pads them (one end of text, then -100)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 40, (8,), generator=gen).tolist()
    return ch07.collate([torch.randint(0, 50000, (n,), generator=gen).tolist() for n in lengths])


def padded_loss(twin, b):
    return cross_entropy(twin(b["input_ids"]).flatten(0, 1), b["targets"].flatten())


def test_kept_positions_are_each_rows_prefix_up_to_its_last_counted_target():
    targets = torch.tensor([[5, 6, -100, -100], [-100, 7, -100, 8], [-100, -100, -100, -100]])
    assert packing.kept_positions(targets).tolist() == [[True, True, False, False], [True] * 4, [False] * 4]


@pytest.mark.parametrize("path", ["sdpa", "blocks"])
def test_the_packed_loss_and_every_gradient_equal_the_padded_forwards(model, path):
    twin = fused(model)
    for block in twin.trf_blocks:
        block.att.train_path = path
    for seed in range(3):
        b = batch(seed)
        keep = packing.kept_positions(b["targets"])
        assert keep.float().mean() < 1 - packing.MIN_SAVED  # (this batch does pack)
        want = padded_loss(twin, b)
        want.backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = packing.packed_loss(twin, b["input_ids"], b["targets"])
        got.backward()
        scale = max(float(g.abs().max()) for g in want_grads)
        assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
        for p, g in zip(model.parameters(), want_grads):
            assert float((p.grad - g).abs().max()) <= 1e-5 * scale
        model.zero_grad()


def test_without_gradients_the_kept_positions_logits_are_the_padded_forwards(model):
    twin = fused(model).eval()
    b = batch(5)
    with torch.no_grad():
        logits, targets = packing.packed_logits(twin, b["input_ids"], b["targets"])
        keep = packing.kept_positions(b["targets"])
        want = twin(b["input_ids"])[keep]
    assert torch.equal(targets, b["targets"][keep])
    assert float((logits - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_the_positions_left_out_are_never_read(model):
    twin = fused(model)
    b = batch(7)
    keep = packing.kept_positions(b["targets"])
    other = dict(b, input_ids=b["input_ids"].masked_fill(~keep, 123))  # what sits past each row's prefix
    with torch.no_grad():
        assert torch.equal(packing.packed_loss(twin, b["input_ids"], b["targets"]),
                           packing.packed_loss(twin, other["input_ids"], other["targets"]))


def test_packing_draws_nothing_from_torchs_generator(model):
    twin = fused(model)
    b = batch(1)
    state = torch.get_rng_state()
    packing.packed_loss(twin, b["input_ids"], b["targets"]).backward()
    model.zero_grad()
    assert torch.equal(torch.get_rng_state(), state)


def test_packing_runs_only_on_a_fused_twin_without_dropout_hooks_or_wrappers(model):
    b = batch(2)
    args = (b["input_ids"], b["targets"])
    assert packing.packed_logits(model, *args) is None  # the glass model: model.py's forward, as the book's
    dropping = glassgpt.GPTModel(dataclasses.replace(CFG, drop_rate=0.1))
    assert packing.packed_logits(fused(dropping), *args) is None  # a mask of another shape: another stream
    hooked = fused(model)
    hooked.register_forward_hook(lambda *a: None)
    assert packing.packed_logits(hooked, *args) is None
    assert packing.packed_logits(torch.nn.Sequential(fused(model)), *args) is None  # (a compiled or DDP wrapper)
    full = {"input_ids": b["input_ids"], "targets": b["input_ids"]}  # every position counted: nothing to leave out
    assert packing.packed_logits(fused(model), full["input_ids"], full["targets"]) is None
    twin = fused(model)
    assert packing.packed_logits(twin, *args) is not None
    assert all(type(block.att) is FusedAttention and block.att.packing is None for block in twin.trf_blocks)


def test_chapter_7s_fast_run_packs_and_its_exact_run_does_not(model, monkeypatch):
    calls = []
    real = packing.packed_logits
    monkeypatch.setattr(packing, "packed_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    encoded = {"train": [batch(3)["input_ids"][i].tolist() for i in range(8)], "val": [[1, 2, 3]]}
    tok = glassgpt.get_tokenizer("gpt2")
    b = batch(3)
    twin = fused(model)
    exact = ch07.BookInstructionTask(encoded, "x", 8, 1, tok, exact=True)
    fast = ch07.BookInstructionTask(encoded, "x", 8, 1, tok, exact=False)
    with torch.no_grad():
        want = exact.loss(twin, b)
        assert not calls
        got = fast.loss(twin, b)
    assert calls and abs(float(got) - float(want)) <= 1e-6 * float(want)
