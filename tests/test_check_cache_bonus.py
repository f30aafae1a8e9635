"""The bonus models' KV caches, written as the notebooks' '-plus-kvcache' twins write them, checked against no
cache (issue 49 point 3).

The notebooks (ch05/11_qwen3 MoE, 12_gemma3, 13_olmo3, 15_tiny-aya, 16_qwen3.5, 17_gemma4) give each model
forward(input_ids, cache=None) over a KVCache of one slot a layer (get / update), a position counter
current_pos, and reset_kv_cache(). A reader's port here is glassgpt's glass model (families/) driven through
that API: `Port` hands the glass forward a view of the book's cache (BookCache, below), so each slot holds a
tuple the way the notebook's does: (keys, values) of an attention layer, the last `window` of them in a
sliding one; (convolution inputs, state) of Qwen3.5's linear layer. glassgpt.check must find the port's cache
changes nothing, and name planted mistakes at their step with the property they break: a sliding cache trimmed
one too far and a full layer trimmed to the window (Gemma 3, OLMo 3, Tiny Aya, Gemma 4), a counter never
advanced (all six), a reset that leaves the counter (Qwen3 MoE), Qwen3.5's linear state or convolution inputs
not carried.
"""

from __future__ import annotations

import pytest
import torch

import glassgpt
from glassgpt import kinds
from glassgpt.explain.debugger import tiny_config


class Slot:
    """Layer i's slot of the notebook's KVCache, as the glass layer calls its cache."""

    def __init__(self, book, cache, i: int, window: int | None):
        self.book, self.cache, self.i, self.window = book, cache, i, window

    def update(self, keys, values):  # an attention layer: the cached keys and values, then the new ones
        before = self.cache.get(self.i)
        if before is not None:
            keys, values = torch.cat([before[0], keys], dim=2), torch.cat([before[1], values], dim=2)
        kept = None if self.window is None else self.book.keep(self.window)  # a sliding layer: its window
        self.cache.update(self.i, (keys, values) if kept is None else (keys[:, :, -kept:], values[:, :, -kept:]))
        return keys, values

    def read(self):  # a linear layer (Qwen3.5): the convolution's last inputs and the state
        return self.cache.get(self.i) or (None, None)

    def write(self, conv, state):
        self.cache.update(self.i, self.book.carry(conv, state))


class BookCache:
    """The notebook's KVCache and its model's current_pos, read the way the glass forward reads a cache."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.windows = getattr(model.cfg, "windows", None) or (None,) * model.cfg.n_layers

    @property
    def pos(self):
        return self.model.current_pos

    def layer(self, i):
        return Slot(self.model, self.cache, i, self.windows[i])

    def advance(self, t):
        self.model.advance(t)


def port_of(key: str, **mistakes):
    """A reader's cached port of glass model `key` (a tiny random one), with `mistakes` as methods."""
    base = kinds.glass_class(tiny_config(key))

    def forward(self, in_idx, cache=None):
        return base.forward(self, in_idx, None if cache is None else BookCache(self, cache))

    def reset_kv_cache(self):
        self.current_pos = 0

    def advance(self, t):  # after every layer has run: the notebook's self.current_pos = pos_end
        self.current_pos += t

    methods = {"forward": forward, "reset_kv_cache": reset_kv_cache, "advance": advance,
               "keep": lambda self, window: window, "carry": lambda self, conv, state: (conv, state)}
    cls = type(f"My{base.__name__}", (base,), methods | mistakes)
    torch.manual_seed(0)
    model = cls(tiny_config(key)).eval()
    model.current_pos = 0
    return model


MODELS = ["gemma3", "qwen3_moe", "qwen3_5", "olmo3", "tiny_aya", "gemma4"]


@pytest.mark.parametrize("key", MODELS)
def test_each_bonus_models_cached_port_equals_no_cache(key):
    result = glassgpt.check(port_of(key))
    assert result.kind == "KV cache" and result.ok, result.to_text()
    assert result.finding.startswith("your cache changes nothing: each of the 8 steps fed alone")


@pytest.mark.parametrize("key", ["gemma3", "olmo3", "tiny_aya", "gemma4"])
def test_a_sliding_cache_trimmed_one_too_far_is_named_by_the_keys_its_window_holds(key):
    # planted: the slot keeps window - 2 positions, so the new token reads window - 1 keys, not window (4)
    result = glassgpt.check(port_of(key, keep=lambda self, window: window - 2))
    assert not result.ok and result.prop == "window_trimming", result.to_text()
    assert result.where == "step 3 of run 1"
    assert ("the new token (position 3) of the first layer, whose window is 4, reads 3 keys where it should read 4, "
            "fewer than its window holds: the cache is trimmed too far") in result.finding


@pytest.mark.parametrize("key", MODELS)
def test_a_counter_that_never_advances_is_named_at_step_1(key):
    result = glassgpt.check(port_of(key, advance=lambda self, t: None))
    assert not result.ok and result.prop == "position_counter", result.to_text()
    assert result.where == "step 1 of run 1"
    assert "the position counter current_pos is 0, not 2 (the tokens fed so far)" in result.finding


@pytest.mark.parametrize("carry", [
    lambda self, conv, state: (conv, None),  # the state dropped: each step starts again from zeros
    lambda self, conv, state: (None, state),  # the convolution's last inputs dropped
], ids=["state", "conv"])
def test_qwen3_5_whose_linear_layer_does_not_carry_its_state_is_named_by_it(carry):
    model = port_of("qwen3_5", carry=carry)
    with torch.no_grad():  # a slow decay (exp(A_log) ~ 3e-4): the state still matters a step later
        model.trf_blocks[0].token_mixer.A_log.fill_(-8.0)
    result = glassgpt.check(model)
    assert not result.ok and result.prop == "linear_state", result.to_text()
    assert result.where == "step 1 of run 1"
    assert ("yet the logits differ: the linear attentions (trf_blocks.0.token_mixer) must carry their state and the "
            "convolution's last inputs from step to step") in result.finding


def test_qwen3_moe_whose_reset_leaves_the_counter_is_named_at_the_second_run():
    result = glassgpt.check(port_of("qwen3_moe", reset_kv_cache=lambda self: None))
    assert not result.ok and result.prop == "cache_reset", result.to_text()
    assert result.where == "step 0 of run 2 (after reset_kv_cache())"
    assert ("after reset_kv_cache() the position counter current_pos is 8, not 0: reset_kv_cache() must set it back "
            "to 0") in result.finding


class FullTrimmedSlot(Slot):
    """planted: a full layer's slot trimmed to the sliding layers' window (4), as if every layer were sliding."""

    def __init__(self, book, cache, i, window):
        super().__init__(book, cache, i, window or book.cfg.sliding_window)


@pytest.mark.parametrize("key, blocks", [("gemma3", "blocks"), ("olmo3", "blocks"), ("tiny_aya", "trf_blocks"),
                                         ("gemma4", "blocks")])
def test_a_full_layer_trimmed_to_the_window_is_named_by_its_path_not_the_right_first_layer(key, blocks, monkeypatch):
    monkeypatch.setattr(BookCache, "layer", lambda self, i: FullTrimmedSlot(self.model, self.cache, i,
                                                                            self.windows[i]))
    result = glassgpt.check(port_of(key))
    assert not result.ok and result.prop == "window_trimming", result.to_text()
    assert result.where == "step 5 of run 1"  # positions 0..4 fit in 4 kept + the new one; at 5, position 0 is gone
    assert (f"the new token (position 5) reads 5 keys in {blocks}.1.att, a full layer, where it should read 6: its "
            f"cache is trimmed: a full layer keeps every key (the first layer's cache is right)") in result.finding


def test_a_sliding_cache_never_trimmed_under_a_mask_that_trusts_it_is_named_not_trimmed(monkeypatch):
    # planted, as a reader might write the notebook: the slot keeps every key, and one new token's mask hides
    # nothing (it trusts the cache to hold only the window), so past the window the new token reads too far back
    from glassgpt.families import gemma3
    whole = gemma3.hidden_positions
    monkeypatch.setattr(gemma3, "hidden_positions",
                        lambda t, s, window, device: whole(t, s, None if t == 1 else window, device))
    result = glassgpt.check(port_of("gemma3", keep=lambda self, window: None))
    assert not result.ok and result.prop == "window_trimming", result.to_text()
    assert result.where == "step 4 of run 1"
    assert ("the new token (position 4) of the first layer, whose window is 4, reads 5 keys where it should read 4, "
            "more than its window holds: the cache is not trimmed to the window") in result.finding


def test_a_sliding_cache_never_trimmed_under_the_windowed_mask_changes_nothing():
    # the same slot, but the glass mask hides what lies past the window: more memory, the same logits
    result = glassgpt.check(port_of("gemma3", keep=lambda self, window: None))
    assert result.ok, result.to_text()
