"""Weights on 2 MB pages for long decoding runs (engine/pages.py): same values, same addresses, and
only where the run is long enough to repay the move."""

from __future__ import annotations

from pathlib import Path

import torch

import glassgpt
from glassgpt.engine import KVCache, pages
from glassgpt.formats import random_model
from glassgpt.generate import generate


def thp_mode() -> str:
    """"always", "madvise" or "never" (the bracketed word of the kernel's setting), "" off Linux."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.is_file():
        return ""
    text = path.read_text()
    return text[text.index("[") + 1:text.index("]")]


def test_huge_pages_keep_every_value_and_address_and_move_the_whole_2mb_pages_inside():
    t = torch.randn(5 * 2**20)  # 20 MB: at least 9 whole 2 MB pages, wherever it starts
    before, where = t.clone(), t.data_ptr()
    moved = pages.huge_pages([t, t])  # the same tensor twice is moved once
    assert torch.equal(t, before) and t.data_ptr() == where
    lo = (where + pages.HUGE - 1) // pages.HUGE * pages.HUGE
    hi = (where + t.nbytes) // pages.HUGE * pages.HUGE
    assert moved in (0, hi - lo)
    if thp_mode() in ("always", "madvise") and Path("/proc/self/smaps").is_file():
        assert moved == hi - lo  # the kernel here (6.1+, THP on) moves them


def test_small_tensors_and_other_devices_are_left_alone():
    assert pages.huge_pages([torch.zeros(1000), torch.zeros(2**20 // 4 - 1)]) == 0


def test_only_a_run_with_room_for_min_tokens_asks_for_huge_pages(monkeypatch):
    cfg = glassgpt.GPTConfig(vocab_size=97, context_length=1024, emb_dim=32, n_heads=4, n_layers=2)
    model = random_model(cfg, torch.device("cpu"), torch.float32)
    asked = []
    monkeypatch.setattr(pages, "huge_pages", lambda tensors: asked.append(len(list(tensors))) or 0)
    short = KVCache(cfg, 1, pages.MIN_TOKENS + 10)
    short.pos = 11
    pages.for_run(model, short)
    assert asked == []
    short.pos = 10
    pages.for_run(model, short)
    assert asked == [len(list(model.parameters())) + len(list(model.buffers()))]
    asked.clear()
    prompt = torch.zeros(1, 4, dtype=torch.long)
    generate(model, prompt, max_new_tokens=20)
    assert asked == []  # 20 tokens: not worth a move
    first = generate(model, prompt, max_new_tokens=pages.MIN_TOKENS)
    assert asked, "a long run moves the weights"
    monkeypatch.undo()
    assert torch.equal(first, generate(model, prompt, max_new_tokens=pages.MIN_TOKENS))
