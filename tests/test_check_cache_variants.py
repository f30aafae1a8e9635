"""Chapter 4's cached attentions checked alone, cached against uncached (issue 49 point 3).

glassgpt's GQA, MLA and sliding-window attentions (variants/), as the repository writes them
(forward(x, use_cache), reset_cache()), fed torch.rand rows one at a time through their own cache
equal all rows at once without it; one planted cache mistake each is named at its step with the
property it breaks: a mask not offset by the cache's length (GQA), a cache reset_cache() leaves full
(MLA), a window cache trimmed one position too far (SWA).
"""

from __future__ import annotations

import pytest
import torch

import glassgpt
from glassgpt.explain.debugger import tiny_config
from glassgpt.variants import gqa, mla, swa
from glassgpt.variants.base import append_to_cache


def attention(key: str):
    torch.manual_seed(0)
    if key == "swa":
        return swa.MultiHeadAttentionWithSWA(tiny_config("swa"), sliding_window_size=4).eval()
    return {"gqa": gqa.GroupedQueryAttention, "mla": mla.MultiHeadLatentAttention}[key](tiny_config(key)).eval()


@pytest.mark.parametrize("key", ["gqa", "mla", "swa"])
def test_each_cached_attention_alone_equals_no_cache(key):
    result = glassgpt.check(attention(key))
    assert result.kind == "KV cache" and result.ok, result.to_text()
    assert result.finding.startswith("your cache changes nothing: each of the 6 steps fed alone")


def test_gqa_whose_mask_is_not_offset_by_the_cache_is_named_at_step_1():
    def forward(self, x, use_cache=False):
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if use_cache:
            k, v = append_to_cache(self, k, v)
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        s = k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool).triu(1)  # rows 0..t-1: the cache's length not added
        scores = (q @ k.transpose(2, 3)).masked_fill(mask, -torch.inf) / self.head_dim ** 0.5
        return self.out_proj((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, self.d_out))

    att = attention("gqa")
    att.__class__ = type("MyGQA", (gqa.GroupedQueryAttention,), {"forward": forward})
    result = glassgpt.check(att)
    assert not result.ok and result.prop == "mask_offset"
    assert result.where == "step 1 of run 1"
    assert "the causal mask is not offset by the cache's length" in result.finding


def test_mla_whose_reset_leaves_the_latent_cached_is_named_at_the_second_run():
    att = attention("mla")
    att.__class__ = type("MyMLA", (mla.MultiHeadLatentAttention,), {"reset_cache": lambda self: None})
    result = glassgpt.check(att)
    assert not result.ok and result.prop == "cache_reset"
    assert result.where.startswith("step 0 of run 2")
    assert "reset_kv_cache() must empty the cached keys and values" in result.finding


def test_swa_whose_cache_is_trimmed_too_far_is_named_by_the_keys_the_window_holds():
    def update(self, k_new, v_new):
        k, v = append_to_cache(self, k_new, v_new)
        w = self.sliding_window_size
        self.cache_k, self.cache_v = k[:, :, -(w - 2):], v[:, :, -(w - 2):]  # one too few kept
        return k, v

    att = attention("swa")
    att.__class__ = type("MySWA", (swa.MultiHeadAttentionWithSWA,), {"update": update})
    result = glassgpt.check(att)
    assert not result.ok and result.prop == "window_trimming"
    assert result.where == "step 3 of run 1"
    assert ("the new token (position 3), whose window is 4, reads 3 keys where it should read 4, fewer than its "
            "window holds: the cache is trimmed too far") in result.finding
