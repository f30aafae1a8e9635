"""glassgpt.check names the property of the formula that a planted mistake breaks, and where it shows first.

Each case plants one mistake into the book's own class (llms_from_scratch, subclassed here with one change)
across chapters 2 to 7, the Qwen3/Llama 3.2 pieces and the KV cache, and asserts the stage, the position and
the property named. The cases in OUTSIDE_CATALOGUE are mistakes no catalogue entry reproduces (no MISTAKES
key names them): the property alone carries their finding, never "no known mistake".
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import glassgpt
import llms_from_scratch.kv_cache.llama3 as kv_llama
import llms_from_scratch.kv_cache.qwen3 as kv_qwen
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt.explain.pieces import LLAMA3_TINY, QWEN3_MOE_TINY, QWEN3_TINY, PieceError
from glassgpt.explain.pieces.data import BOOK_TEXT
from glassgpt.tokenizer import get_tokenizer
from helpers import RMSNormCentred
from llms_from_scratch import ch02, ch03, ch04, ch05, ch07

CH03 = {"d_in": 3, "d_out": 2, "context_length": 6, "dropout": 0.0, "num_heads": 2}
CH03_HD2 = {"d_in": 3, "d_out": 6, "context_length": 6, "dropout": 0.0, "num_heads": 2}  # head size 3
SMALL_CFG = {"vocab_size": 50257, "context_length": 32, "emb_dim": 64, "n_heads": 4, "n_layers": 1,
             "drop_rate": 0.0, "qkv_bias": False}


def named(cls: type, name: str) -> type:
    """`cls` under the book's class name (what check reads first)."""
    return type(name, (cls,), {})


# --- chapter 2 ------------------------------------------------------------------------------------------

class TargetsNotShifted(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        super().__init__(txt, tokenizer, max_length, stride)
        self.target_ids = [x.clone() for x in self.input_ids]  # planted: the inputs again


class TargetsShiftedBy2(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        super().__init__(txt, tokenizer, max_length, stride)
        ids = tokenizer.encode(txt)
        self.target_ids = [torch.tensor(ids[i + 2:i + max_length + 2]) for i in range(0, len(ids) - max_length - 1,
                                                                                         stride)]
        self.input_ids = self.input_ids[:len(self.target_ids)]  # planted: two tokens on


class WindowsStartOneLate(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        ids = tokenizer.encode(txt)
        self.input_ids, self.target_ids = [], []
        for i in range(1, len(ids) - max_length, stride):  # planted: the first window starts at token 1
            self.input_ids.append(torch.tensor(ids[i:i + max_length]))
            self.target_ids.append(torch.tensor(ids[i + 1:i + max_length + 1]))


class TargetsOneShort(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        super().__init__(txt, tokenizer, max_length, stride)
        self.target_ids = [y[:-1] for y in self.target_ids]  # planted: token_ids[i + 1:i + max_length]


class SimpleTokenizerV2:  # the book's chapter 2 listing (it is not in llms_from_scratch)
    def __init__(self, vocab):
        self.str_to_int = vocab
        self.int_to_str = {i: s for s, i in vocab.items()}

    def encode(self, text):
        preprocessed = [item.strip() for item in re.split(r'([,.:;?_!"()\']|--|\s)', text) if item.strip()]
        return [self.str_to_int.get(s, self.str_to_int["<|unk|>"]) for s in preprocessed]

    def decode(self, ids):
        return re.sub(r'\s+([,.:;?!"()\'])', r'\1', " ".join(self.int_to_str[i] for i in ids))


class SplitOnSpacesOnly(SimpleTokenizerV2):
    def encode(self, text):
        preprocessed = [item.strip() for item in re.split(r'(\s)', text) if item.strip()]  # planted: spaces only
        return [self.str_to_int.get(s, self.str_to_int["<|unk|>"]) for s in preprocessed]


def simple_vocab():
    words = sorted(set(w.strip() for w in re.split(r'([,.:;?_!"()\']|--|\s)', BOOK_TEXT + " do you like tea? In "
                                                                                       "the sunlit terraces of")
                       if w.strip()))
    return {w: i for i, w in enumerate(words + ["<|endoftext|>", "<|unk|>"])}


def built(cls):
    return cls(BOOK_TEXT, get_tokenizer("gpt2"), 4, 4)


# --- chapter 3 ------------------------------------------------------------------------------------------

class MHA(ch03.MultiHeadAttention):
    """The book's MultiHeadAttention, its forward written out; `weights(scores, t)` is what a reader changes."""

    def split(self, y, b, t):
        return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def weights(self, scores, t):
        scores = scores.masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        return torch.softmax(scores / self.head_dim ** 0.5, dim=-1)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (self.split(w(x), b, t) for w in (self.W_query, self.W_key, self.W_value))
        w = self.dropout(self.weights(q @ k.transpose(2, 3), t))
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, t, self.d_out))


class MaskAfterSoftmax(MHA):
    def weights(self, scores, t):
        w = torch.softmax(scores / self.head_dim ** 0.5, dim=-1)
        return w.masked_fill(self.mask.bool()[:t, :t], 0.0)  # planted: the future zeroed after the softmax


class MaskPolarity(MHA):
    def weights(self, scores, t):
        scores = scores.masked_fill(~self.mask.bool()[:t, :t], -torch.inf)  # planted: the mask's polarity
        return torch.softmax(scores / self.head_dim ** 0.5, dim=-1)


class MaskOneLate(MHA):
    def weights(self, scores, t):
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(2), -torch.inf)  # planted: diagonal=2
        return torch.softmax(scores / self.head_dim ** 0.5, dim=-1)


class ScaleByHeadSize(MHA):
    def weights(self, scores, t):
        scores = scores.masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        return torch.softmax(scores / self.head_dim, dim=-1)  # planted: no square root


class ScaleByDOut(MHA):
    def weights(self, scores, t):
        scores = scores.masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        return torch.softmax(scores / self.d_out ** 0.5, dim=-1)  # planted: sqrt(d_out)


class NoScale(MHA):
    def weights(self, scores, t):
        return torch.softmax(scores.masked_fill(self.mask.bool()[:t, :t], -torch.inf), dim=-1)  # planted


class SoftmaxOverQueries(ch03.SelfAttention_v2):
    def forward(self, x):
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        return torch.softmax(queries @ keys.T / keys.shape[-1] ** 0.5, dim=0) @ values  # planted: dim=0


class DropoutInEval(MHA):
    def weights(self, scores, t):
        w = super().weights(scores, t)
        return F.dropout(w, 0.1, training=True)  # planted: always on


# --- chapter 4 ------------------------------------------------------------------------------------------

class NormNoEps(ch04.LayerNorm):
    def forward(self, x):
        return self.scale * (x - x.mean(-1, keepdim=True)) / x.var(-1, keepdim=True, unbiased=False).sqrt() + self.shift


class NormEpsOutside(ch04.LayerNorm):
    def forward(self, x):
        var = x.var(-1, keepdim=True, unbiased=False)
        return self.scale * (x - x.mean(-1, keepdim=True)) / (var.sqrt() + self.eps) + self.shift  # planted


class NormUnbiased(ch04.LayerNorm):
    def forward(self, x):
        var = x.var(-1, keepdim=True, unbiased=True)  # planted: n - 1
        return self.scale * (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + self.eps) + self.shift


class NormNoMean(ch04.LayerNorm):
    def forward(self, x):
        var = x.var(-1, keepdim=True, unbiased=False)
        return self.scale * x / torch.sqrt(var + self.eps) + self.shift  # planted: the mean not subtracted


class ExactGELU(ch04.GELU):
    def forward(self, x):
        return F.gelu(x)


class SigmoidGELU(ch04.GELU):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)  # planted: the sigmoid approximation


class FeedForwardWidth(ch04.FeedForward):
    def __init__(self, cfg, k):
        super().__init__(cfg)
        d = cfg["emb_dim"]
        self.layers = nn.Sequential(nn.Linear(d, k * d), ch04.GELU(), nn.Linear(k * d, d))


class FeedForward2x(FeedForwardWidth):
    def __init__(self, cfg):
        super().__init__(cfg, 2)


class FeedForward3x(FeedForwardWidth):
    def __init__(self, cfg):
        super().__init__(cfg, 3)


class FeedForwardReLU(ch04.FeedForward):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers[1] = nn.ReLU()


class BlockNoFirstShortcut(ch04.TransformerBlock):
    def forward(self, x):
        x = self.drop_resid(self.att(self.norm1(x)))  # planted: no + shortcut
        return x + self.drop_resid(self.ff(self.norm2(x)))


class BlockShortcutAfterNorm(ch04.TransformerBlock):
    def forward(self, x):
        x = self.norm1(x)
        x = x + self.drop_resid(self.att(x))  # planted: the shortcut keeps the normalized x
        return x + self.drop_resid(self.ff(self.norm2(x)))


class BlockPostNorm(ch04.TransformerBlock):
    def forward(self, x):
        x = self.norm1(x + self.drop_resid(self.att(x)))
        return self.norm2(x + self.drop_resid(self.ff(x)))


# --- chapters 5 and 6 --------------------------------------------------------------------------------------

def generate_second_to_last(model, idx, max_new_tokens, context_size):
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])[:, -2, :]  # planted: one position early
        idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx


generate_second_to_last.__name__ = "generate_text_simple"


def generate_crops_first(model, idx, max_new_tokens, context_size):
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, :context_size])[:, -1, :]  # planted: the first context_size tokens kept
        idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx


def generate_new_tokens_only(model, idx, max_new_tokens, context_size):
    start = idx.shape[1]
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])[:, -1, :]
        idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx[:, start:]  # planted: the prompt left out of what is returned


def generate_top_k_ignored(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, eos_id=None):
    return ch05.generate(model, idx, max_new_tokens, context_size, temperature, None, eos_id)  # planted: no top-k


generate_crops_first.__name__ = generate_new_tokens_only.__name__ = "generate_text_simple"
generate_top_k_ignored.__name__ = "generate"


def loss_last_position(input_batch, target_batch, model, device):
    logits = model(input_batch)
    return F.cross_entropy(logits[:, -1, :], target_batch[:, -1])  # planted: the last position only


def loss_but_first(input_batch, target_batch, model, device):
    logits = model(input_batch)[:, 1:]  # planted: the first position left out
    return F.cross_entropy(logits.flatten(0, 1), target_batch[:, 1:].flatten())


def loss_summed(input_batch, target_batch, model, device):
    logits = model(input_batch)
    return F.cross_entropy(logits.flatten(0, 1), target_batch.flatten(), reduction="sum")  # planted


def classifier_loss_first_token(input_batch, target_batch, model, device):
    return F.cross_entropy(model(input_batch)[:, 0, :], target_batch)  # planted: the first token


for fn in (loss_last_position, loss_but_first, loss_summed, classifier_loss_first_token):
    fn.__name__ = "calc_loss_batch"


def collate_pads_with_zero(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    return ch07.custom_collate_fn(batch, 0, ignore_index, allowed_max_length, device)  # planted: pads with 0


def collate_never_cut(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    return ch07.custom_collate_fn(batch, pad_token_id, ignore_index, None, device)  # planted: no truncation


def collate_ignore_minus_1(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    return ch07.custom_collate_fn(batch, pad_token_id, -1, allowed_max_length, device)  # planted: -1 ignored


for fn in (collate_pads_with_zero, collate_never_cut, collate_ignore_minus_1):
    fn.__name__ = "custom_collate_fn"


class BPE:
    """A tiktoken-style tokenizer over glassgpt's GPT-2 BPE, as a reader wraps one."""

    def __init__(self):
        self.gpt2 = get_tokenizer("gpt2")

    def encode(self, text, allowed_special=()):
        return self.gpt2.encode(text, allowed_special=allowed_special)

    def decode(self, ids):
        return self.gpt2.decode(ids)


class BPESplitsEndOfText(BPE):
    def encode(self, text, allowed_special=()):
        return self.gpt2.encode(text)  # planted: allowed_special not passed on, <|endoftext|> read as text


class BPELosesSpaces(BPE):
    def encode(self, text, allowed_special=()):
        return [i for word in text.split(" ") for i in self.gpt2.encode(word, allowed_special)]  # planted


class BPENoMerges(BPE):
    def encode(self, text, allowed_special=()):
        parts = text.split("<|endoftext|>")  # planted: each character alone, no merges
        ids = [[i for ch in part for i in self.gpt2.encode(ch)] for part in parts]
        return ids[0] + [i for part in ids[1:] for i in [self.gpt2.eot_id] + part]


# --- Qwen3 and Llama 3.2 pieces ------------------------------------------------------------------------------

class GQANoMask(book_qwen.GroupedQueryAttention):
    def forward(self, x, mask, cos, sin):
        return super().forward(x, torch.zeros_like(mask), cos, sin)  # planted: the mask not applied


class GQAScaleDOut(book_llama.GroupedQueryAttention):
    def forward(self, x, mask, cos, sin):
        real = torch.softmax
        d_out, hd = self.d_out, self.head_dim
        def softmax(scores, dim):  # planted: / sqrt(d_out) where the book divides by sqrt(head_dim)
            return real(scores * math.sqrt(hd) / math.sqrt(d_out), dim=dim)
        torch.softmax = softmax
        try:
            return super().forward(x, mask, cos, sin)
        finally:
            torch.softmax = real


class RMSNormEpsOutside(book_qwen.RMSNorm):
    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.scale  # planted


class SwiGLUSwapped(book_qwen.FeedForward):
    def forward(self, x):
        return self.fc3(F.silu(self.fc2(x)) * self.fc1(x))


class SwiGLUWithGELU(book_qwen.FeedForward):
    def forward(self, x):
        return self.fc3(F.gelu(self.fc1(x)) * self.fc2(x))  # planted: GELU's gate


class MoESoftmaxAll(book_qwen.MoEFeedForward):
    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1)
        top, chosen = torch.topk(probs, self.num_experts_per_tok, dim=-1)  # planted: no renormalization
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            w = (top * (chosen == e)).sum(-1, keepdim=True)
            out = out + w * self.fc3[e](F.silu(self.fc1[e](x)) * self.fc2[e](x))
        return out


def apply_rope_interleaved(x, cos, sin):
    t, hd = x.shape[2], x.shape[-1]
    c, s = cos[:t, : hd // 2].repeat_interleave(2, -1), sin[:t, : hd // 2].repeat_interleave(2, -1)
    pairs = x.view(*x.shape[:-1], hd // 2, 2)
    return x * c + torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2) * s


def apply_rope_backwards(x, cos, sin):
    hd = x.shape[-1]
    t = x.shape[2]
    rotated = torch.cat((x[..., hd // 2:], -x[..., : hd // 2]), dim=-1)  # planted: the other way round
    return x * cos[:t] + rotated * sin[:t]


def rope_params_fixed_base(head_dim, theta_base=10_000, context_length=4096, dtype=torch.float32):
    return book_qwen.compute_rope_params(head_dim, 1_000_000.0, context_length)  # planted: the base hard-coded


def rope_params_interleaved(head_dim, theta_base=10_000, context_length=4096, dtype=torch.float32):
    inv_freq = 1.0 / theta_base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(context_length).float()[:, None] * inv_freq[None, :]
    angles = angles.repeat_interleave(2, dim=1)  # planted: neighbours, where apply_rope pairs the halves
    return torch.cos(angles), torch.sin(angles)


def llama_rope_unscaled(head_dim, theta_base=10_000, context_length=4096, freq_config=None, dtype=torch.float32):
    return book_llama.compute_rope_params(head_dim, theta_base, context_length, None)  # planted: freq_config dropped


for fn in (apply_rope_interleaved, apply_rope_backwards):
    fn.__name__ = "apply_rope"
for fn in (rope_params_fixed_base, rope_params_interleaved, llama_rope_unscaled):
    fn.__name__ = "compute_rope_params"


# --- the KV cache -------------------------------------------------------------------------------------------

class QwenCounterStuck(kv_qwen.Qwen3Model):
    def forward(self, in_idx, cache=None):
        start = self.current_pos
        out = super().forward(in_idx, cache)
        if cache is not None:
            self.current_pos = start  # planted: the counter never advances
        return out


class QwenResetForgetsCounter(kv_qwen.Qwen3Model):
    def reset_kv_cache(self):
        pass  # planted: current_pos left where the last prompt ended


class QwenMaskNotOffset(kv_qwen.Qwen3Model):
    def forward(self, in_idx, cache=None):
        if cache is None:
            return super().forward(in_idx, cache)
        x = self.tok_emb(in_idx)
        t = x.shape[1]
        start, self.current_pos = self.current_pos, self.current_pos + t
        mask = torch.ones(start + t, start + t, dtype=torch.bool).triu(1)[:t, :start + t]  # planted: rows from 0
        for i, block in enumerate(self.trf_blocks):
            x, new = block(x, mask[None, None], self.cos, self.sin, start_pos=start, cache=cache.get(i))
            cache.update(i, new)
        return self.out_head(self.final_norm(x))


class CachedAttention(ch04.MultiHeadAttention):
    """Chapter 4's gpt_with_kv_cache attention, written here over the book's chapter-4 class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cache_k = self.cache_v = None
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for w in (self.W_query, self.W_key, self.W_value))
        if use_cache:
            self.cache_k = k if self.cache_k is None else torch.cat([self.cache_k, k], dim=2)
            self.cache_v = v if self.cache_v is None else torch.cat([self.cache_v, v], dim=2)
            k, v = self.cache_k, self.cache_v
        start = self.ptr_current_pos if use_cache else 0
        mask = self.mask_rows(start, t, k.shape[2])
        if use_cache:
            self.ptr_current_pos += t
        w = torch.softmax((q @ k.transpose(2, 3)).masked_fill(mask, -torch.inf) / self.head_dim ** 0.5, dim=-1)
        return self.out_proj((self.dropout(w) @ v).transpose(1, 2).reshape(b, t, self.d_out))

    def mask_rows(self, start, t, s):
        return self.mask.bool()[start:start + t, :s]  # the rows of the positions fed, every key so far

    def reset_cache(self):
        self.cache_k = self.cache_v = None
        self.ptr_current_pos = 0


class CachedAttentionMaskNotOffset(CachedAttention):
    def mask_rows(self, start, t, s):
        return self.mask.bool()[:t, :s]  # planted: the rows from 0, whatever the cache holds


class CachedAttentionMaskColumns(CachedAttention):
    def mask_rows(self, start, t, s):
        return self.mask.bool()[:s, :s][:, -t:]  # planted: the last t columns, where the last t rows were meant


class CachedBlock(ch04.TransformerBlock):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.att = CachedAttention(cfg["emb_dim"], cfg["emb_dim"], cfg["context_length"], 0.0, cfg["n_heads"])

    def forward(self, x, use_cache=False):
        x = x + self.att(self.norm1(x), use_cache=use_cache)
        return x + self.ff(self.norm2(x))


class CachedGPT(ch04.GPTModel):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.trf_blocks = nn.ModuleList(CachedBlock(cfg) for _ in range(cfg["n_layers"]))
        self.current_pos = 0

    def forward(self, in_idx, use_cache=False):
        t = in_idx.shape[1]
        start = self.current_pos if use_cache else 0
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(start, start + t))
        if use_cache:
            self.current_pos += t
        for blk in self.trf_blocks:
            x = blk(x, use_cache=use_cache)
        return self.out_head(self.final_norm(x))

    def reset_kv_cache(self):
        for blk in self.trf_blocks:
            blk.att.reset_cache()
        self.current_pos = 0


class CachedGPTResetKeepsKeys(CachedGPT):
    def reset_kv_cache(self):
        for blk in self.trf_blocks:
            blk.att.ptr_current_pos = 0  # planted: cache_k and cache_v kept
        self.current_pos = 0


TINY_GPT = {"vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0,
            "qkv_bias": False}


def model(cls, cfg):
    torch.manual_seed(123)
    return cls(cfg).eval()


# --- the cases -----------------------------------------------------------------------------------------------

CASES = {  # id: (a call giving the result, stage, where, property)
    "ch2_built_targets_not_shifted": (lambda: glassgpt.check(built(TargetsNotShifted)), "windows", "window 0", "shift"),
    "ch2_built_targets_shifted_by_2": (lambda: glassgpt.check(built(TargetsShiftedBy2)), "windows", "window 0",
                                       "shift"),
    "ch2_class_targets_shifted_by_2": (lambda: glassgpt.check(named(TargetsShiftedBy2, "GPTDatasetV1")), "windows",
                                       "window 0", "shift"),
    "ch2_windows_start_one_late": (lambda: glassgpt.check(named(WindowsStartOneLate, "GPTDatasetV1")), "windows",
                                   "window 0", "stride"),
    "ch5_generate_second_to_last": (lambda: glassgpt.check(generate_second_to_last), "tokens", "new token 0",
                                    "greedy_argmax"),
    "ch3_mask_after_softmax": (lambda: glassgpt.check(named(MaskAfterSoftmax, "MultiHeadAttention"), args=CH03),
                               "attention weights", "row 0 of head 0", "rows_sum_to_1"),
    "ch3_mask_polarity": (lambda: glassgpt.check(named(MaskPolarity, "MultiHeadAttention"), args=CH03_HD2),
                          "attention weights", "row 0 of head 0", "no_future"),
    "ch3_mask_one_late": (lambda: glassgpt.check(named(MaskOneLate, "MultiHeadAttention"), args=CH03_HD2),
                          "attention weights", "row 0 of head 0", "no_future"),
    "ch3_scale_by_head_size": (lambda: glassgpt.check(named(ScaleByHeadSize, "MultiHeadAttention"), args=CH03_HD2),
                               "attention weights", "every row", "scale"),
    "ch3_scale_by_d_out": (lambda: glassgpt.check(named(ScaleByDOut, "MultiHeadAttention"), args=CH03_HD2),
                           "attention weights", "every row", "scale"),
    "ch3_no_scale": (lambda: glassgpt.check(named(NoScale, "MultiHeadAttention"), args=CH03_HD2),
                     "attention weights", "every row", "scale"),
    "ch3_softmax_over_queries": (lambda: glassgpt.check(named(SoftmaxOverQueries, "SelfAttention_v2")),
                                 "attention weights", "row 0", "rows_sum_to_1"),
    "ch3_dropout_in_eval": (lambda: glassgpt.check(named(DropoutInEval, "MultiHeadAttention"), args=CH03_HD2),
                            "output", "two eval runs", "dropout_in_eval"),
    "ch4_norm_no_eps": (lambda: glassgpt.check(named(NormNoEps, "LayerNorm")), "output", "row 2", "eps"),
    "ch4_norm_eps_outside": (lambda: glassgpt.check(named(NormEpsOutside, "LayerNorm")), "output", "row 2", "eps"),
    "ch4_norm_unbiased": (lambda: glassgpt.check(named(NormUnbiased, "LayerNorm")), "output", "row 0",
                          "biased_variance"),
    "ch4_norm_no_mean": (lambda: glassgpt.check(named(NormNoMean, "LayerNorm")), "output", "row 0", "norm_mean"),
    "ch4_exact_gelu": (lambda: glassgpt.check(named(ExactGELU, "GELU")), "output", "position 0", "activation"),
    "ch4_sigmoid_gelu": (lambda: glassgpt.check(named(SigmoidGELU, "GELU")), "output", "position 0", "activation"),
    "ch4_ff_2x": (lambda: glassgpt.check(named(FeedForward2x, "FeedForward"), args=SMALL_CFG), "shape",
                  "nn.Linear(64, 128)", "width"),
    "ch4_ff_3x": (lambda: glassgpt.check(named(FeedForward3x, "FeedForward"), args=SMALL_CFG), "shape",
                  "nn.Linear(64, 192)", "width"),
    "ch4_ff_relu": (lambda: glassgpt.check(named(FeedForwardReLU, "FeedForward"), args=SMALL_CFG), "output",
                    "position 0", "activation"),
    "ch4_block_no_first_shortcut": (lambda: glassgpt.check(named(BlockNoFirstShortcut, "TransformerBlock"),
                                                           args=SMALL_CFG), "output", "position 0", "shortcut1"),
    "ch4_block_shortcut_after_norm": (lambda: glassgpt.check(named(BlockShortcutAfterNorm, "TransformerBlock"),
                                                             args=SMALL_CFG), "output", "position 0", "shortcut1"),
    "ch4_block_post_norm": (lambda: glassgpt.check(named(BlockPostNorm, "TransformerBlock"), args=SMALL_CFG),
                            "output", "position 0", "norm_placement"),
    "ch5_loss_last_position": (lambda: glassgpt.check(loss_last_position), "loss", "the last position only",
                               "loss_positions"),
    "ch5_loss_but_first": (lambda: glassgpt.check(loss_but_first), "loss", "every position but the first",
                           "loss_positions"),
    "ch5_loss_summed": (lambda: glassgpt.check(loss_summed), "loss", "every position", "loss_positions"),
    "ch6_loss_first_token": (lambda: glassgpt.check(classifier_loss_first_token), "loss", "the first position only",
                             "loss_positions"),
    "ch7_collate_pads_with_zero": (lambda: glassgpt.check(collate_pads_with_zero), "inputs", "row 1, position 2",
                                   "pad_id"),
    "ch7_collate_never_cut": (lambda: glassgpt.check(collate_never_cut), "inputs", "position 4", "truncation"),
    "ch7_collate_ignore_minus_1": (lambda: glassgpt.check(collate_ignore_minus_1), "targets", "row 1, position 2",
                                   "ignore_index"),
    "ch2_bpe_splits_endoftext": (lambda: glassgpt.check(BPESplitsEndOfText()), "tokens", "token 7", "special_token"),
    "ch2_bpe_loses_spaces": (lambda: glassgpt.check(BPELosesSpaces()), "tokens", "character 6", "round_trip"),
    "ch2_bpe_no_merges": (lambda: glassgpt.check(BPENoMerges()), "tokens", "token 0", "merges"),
    "ch5_generate_crops_first": (lambda: glassgpt.check(generate_crops_first), "tokens", "new token 5",
                                 "context_crop"),
    "ch5_generate_new_tokens_only": (lambda: glassgpt.check(generate_new_tokens_only), "tokens",
                                     "token 0 of the prompt", "prompt_kept"),
    "ch5_generate_top_k_ignored": (lambda: glassgpt.check(generate_top_k_ignored), "tokens", "new token 9", "top_k"),
    "ch2_class_targets_one_short": (lambda: glassgpt.check(named(TargetsOneShort, "GPTDatasetV1")), "windows",
                                    "window 0", "target_length"),
    "ch2_simple_split_on_spaces": (lambda: glassgpt.check(SplitOnSpacesOnly(simple_vocab())), "tokens", "token 1",
                                   "split"),
    "qwen3_gqa_no_mask": (lambda: glassgpt.check(GQANoMask(**{"d_in": 32, "num_heads": 4, "num_kv_groups": 2,
                                                             "head_dim": 16, "qk_norm": True})),
                          "attention weights", "row 0 of head 0", "no_future"),
    "llama3_gqa_scale_d_out": (lambda: glassgpt.check(named(GQAScaleDOut, "GroupedQueryAttention"), args=LLAMA3_TINY),
                               "attention weights", "every row", "scale"),
    "qwen3_rmsnorm_eps_outside": (lambda: glassgpt.check(named(RMSNormEpsOutside, "RMSNorm")), "output", "row 2",
                                  "eps"),
    "qwen3_rmsnorm_centred": (lambda: glassgpt.check(named(RMSNormCentred, "RMSNorm")), "output", "row 0",
                              "norm_mean"),
    "qwen3_swiglu_swapped": (lambda: glassgpt.check(named(SwiGLUSwapped, "FeedForward")), "output", "position 0",
                             "gate"),
    "qwen3_swiglu_gelu": (lambda: glassgpt.check(named(SwiGLUWithGELU, "FeedForward")), "output", "position 0",
                          "activation"),
    "qwen3_moe_softmax_all": (lambda: glassgpt.check(named(MoESoftmaxAll, "MoEFeedForward"), args=QWEN3_MOE_TINY),
                              "output", "position 0", "router_weights"),
    "rope_interleaved": (lambda: glassgpt.check(apply_rope_interleaved), "output", "dimension 0 at position 1",
                         "rope_pairs"),
    "rope_backwards": (lambda: glassgpt.check(apply_rope_backwards), "output", "dimension 0 at position 1",
                       "rope_direction"),
    "rope_params_fixed_base": (lambda: glassgpt.check(rope_params_fixed_base), "output", "position 1", "rope_base"),
    "rope_params_interleaved": (lambda: glassgpt.check(rope_params_interleaved), "output", "dimension 1",
                                "rope_pairs"),
    "llama3_rope_unscaled": (lambda: glassgpt.check(llama_rope_unscaled), "output", "position 1",
                             "rope_frequencies"),
    "kv_counter_stuck": (lambda: glassgpt.check(model(QwenCounterStuck, QWEN3_TINY)), "cache", "step 1 of run 1",
                         "position_counter"),
    "kv_reset_forgets_counter": (lambda: glassgpt.check(model(QwenResetForgetsCounter, QWEN3_TINY)), "cache",
                                 "step 0 of run 2 (after reset_kv_cache())", "cache_reset"),
    "kv_mask_not_offset": (lambda: glassgpt.check(model(QwenMaskNotOffset, QWEN3_TINY)), "cache", "step 1 of run 1",
                           "mask_offset"),
    "kv_gpt2_reset_keeps_keys": (lambda: glassgpt.check(model(CachedGPTResetKeepsKeys, TINY_GPT)), "cache",
                                 "step 0 of run 2 (after reset_kv_cache())", "cache_reset"),
    "kv_attention_mask_columns": (lambda: glassgpt.check(CachedAttentionMaskColumns, args=CH03_HD2), "cache",
                                  "step 1 of run 1", "mask_shape"),
    "kv_attention_mask_not_offset": (lambda: glassgpt.check(CachedAttentionMaskNotOffset, args=CH03_HD2), "cache",
                                     "step 1 of run 1", "mask_offset"),
}
# Mistakes that no catalogue entry (any MISTAKES of explain/) reproduces: the property carries them.
OUTSIDE_CATALOGUE = {
    "ch2_built_targets_shifted_by_2", "ch2_class_targets_shifted_by_2", "ch2_windows_start_one_late",
    "ch5_generate_second_to_last", "ch3_mask_after_softmax", "ch3_mask_polarity",
    "ch3_mask_one_late", "ch3_scale_by_head_size", "ch4_norm_eps_outside", "ch4_norm_no_mean", "ch4_sigmoid_gelu",
    "ch4_ff_3x", "ch4_block_shortcut_after_norm", "ch5_loss_last_position", "ch5_loss_but_first", "ch5_loss_summed",
    "qwen3_gqa_no_mask", "qwen3_rmsnorm_eps_outside", "qwen3_rmsnorm_centred", "qwen3_swiglu_gelu", "rope_backwards",
    "rope_params_interleaved", "kv_counter_stuck", "kv_reset_forgets_counter", "kv_mask_not_offset",
    "kv_gpt2_reset_keeps_keys", "kv_attention_mask_not_offset", "kv_attention_mask_columns",
    "ch7_collate_pads_with_zero", "ch7_collate_never_cut", "ch7_collate_ignore_minus_1",
    "ch2_bpe_splits_endoftext", "ch2_bpe_loses_spaces", "ch2_bpe_no_merges",
    "ch5_generate_crops_first", "ch5_generate_new_tokens_only", "ch5_generate_top_k_ignored",
    "ch2_class_targets_one_short", "ch2_simple_split_on_spaces",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_planted_mistake_is_named_by_the_property_it_breaks_at_its_first_position(case):
    run, stage, where, prop = CASES[case]
    result = run()
    assert not result.ok, result.to_text()
    assert (result.stage, result.where, result.prop) == (stage, where, prop), result.to_text()
    assert "no known mistake" not in result.finding and "\n" not in result.finding
    if case in OUTSIDE_CATALOGUE:
        assert result.mistake is None, result.to_text()


def test_at_least_thirty_planted_mistakes_and_ten_outside_the_catalogue():
    assert len(CASES) >= 30 and len(OUTSIDE_CATALOGUE & set(CASES)) >= 10


@pytest.mark.parametrize("case", ["ch2_built_targets_not_shifted", "ch3_scale_by_d_out", "ch4_norm_unbiased",
                                  "qwen3_swiglu_swapped", "rope_interleaved", "ch6_loss_first_token"])
def test_the_catalogue_still_names_the_line_after_the_property(case):
    result = CASES[case][0]()
    assert result.mistake is not None and "The line: " in result.finding, result.to_text()


def test_the_issues_mask_after_softmax_says_the_rows_do_not_sum_to_1():
    result = CASES["ch3_mask_after_softmax"][0]()
    assert "sums to" in result.finding and "not 1" in result.finding and "after the softmax" in result.finding


def test_the_scale_is_fitted_and_d_out_named():
    assert "1/sqrt(d_out) = 1/sqrt(6)" in CASES["ch3_scale_by_d_out"][0]().finding
    assert "1/sqrt(d_out) = 1/sqrt(32)" in CASES["llama3_gqa_scale_d_out"][0]().finding
    assert "the head size 3 itself" in CASES["ch3_scale_by_head_size"][0]().finding


def test_a_built_dataset_without_its_text_is_checked_on_its_windows_alone():
    result = glassgpt.check(built(ch02.GPTDatasetV1))
    assert result.ok and "shifted by one token" in result.finding
    assert "shifted by 2 tokens" in CASES["ch2_built_targets_shifted_by_2"][0]().finding


def test_rope_pairs_and_base_are_named():
    assert "neighbours" in CASES["rope_interleaved"][0]().finding
    assert "base 1e+06" in CASES["rope_params_fixed_base"][0]().finding


# --- the book's own pieces and caches pass ---------------------------------------------------------------------

@pytest.mark.parametrize("piece", [book_qwen.GroupedQueryAttention, book_llama.GroupedQueryAttention,
                                   book_qwen.RMSNorm, book_qwen.FeedForward, book_llama.FeedForward,
                                   book_qwen.MoEFeedForward, book_qwen.apply_rope, book_llama.apply_rope,
                                   book_qwen.compute_rope_params, book_llama.compute_rope_params])
def test_the_books_qwen3_and_llama_pieces_match(piece):
    result = glassgpt.check(piece)
    assert result.ok, result.to_text()


@pytest.mark.parametrize("cls, cfg", [(kv_qwen.Qwen3Model, QWEN3_TINY), (kv_llama.Llama3Model, LLAMA3_TINY),
                                      (CachedGPT, TINY_GPT)])
def test_the_books_kv_cache_equals_no_cache(cls, cfg):
    result = glassgpt.check(model(cls, cfg))
    assert result.ok and result.kind == "KV cache", result.to_text()


def test_chapter_4s_cached_attention_alone_equals_no_cache():
    result = glassgpt.check(CachedAttention, args=CH03_HD2)
    assert result.ok and result.kind == "KV cache", result.to_text()


def test_a_cache_of_another_api_names_the_methods_looked_for():
    class OtherCache(ch04.GPTModel):
        def forward(self, in_idx, past_key_values=None):
            return super().forward(in_idx)

    with pytest.raises(PieceError, match="past_key_values.*looked for forward\\(idx, use_cache=True\\)"):
        glassgpt.check(model(OtherCache, TINY_GPT))


def test_a_piece_of_no_known_kind_lists_the_kinds_and_how_to_say_which():
    class Mystery(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(2, 2)

    with pytest.raises(PieceError) as err:
        glassgpt.check(Mystery())
    assert "GroupedQueryAttention" in str(err.value) and "say which" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_qwen3_model_without_a_config_builds_a_tiny_one_and_reads_the_prompt():
    first = glassgpt.check(book_qwen.Qwen3Model, text="Hello")
    assert first.ok and first.prompt == "72 4 11 11 14", first.to_text()  # "Hello" as UTF-8 bytes mod 97


def test_the_cli_checks_a_readers_qwen3_attention_and_a_qwen3_model_without_a_config(tmp_path, capsys):
    from glassgpt.cli import main
    (tmp_path / "my_qwen3.py").write_text(
        "import torch\nimport llms_from_scratch.qwen3 as book\n\n\n"
        "class GroupedQueryAttention(book.GroupedQueryAttention):\n"
        "    def forward(self, x, mask, cos, sin):\n"
        "        return super().forward(x, torch.zeros_like(mask), cos, sin)  # the mask forgotten\n\n\n"
        "class Qwen3Model(book.Qwen3Model):\n    pass\n")
    assert main(["check", f"{tmp_path / 'my_qwen3.py'}:GroupedQueryAttention"]) == 1
    assert "row 0 of head 0 (position 0) puts weight" in capsys.readouterr().out
    assert main(["check", f"{tmp_path / 'my_qwen3.py'}:Qwen3Model", "--prompt", "Hi"]) == 0
    assert "on '72 8'" in capsys.readouterr().out  # "Hi" as UTF-8 bytes, modulo the tiny vocabulary of 97


class GPTShortcutAfterNorm(ch04.GPTModel):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.trf_blocks = nn.Sequential(*[named(BlockShortcutAfterNorm, "TransformerBlock")(cfg)
                                          for _ in range(cfg["n_layers"])])


class QwenNoMask(book_qwen.Qwen3Model):
    def __init__(self, cfg):
        super().__init__(cfg)
        for blk in self.trf_blocks:
            blk.att.__class__ = GQANoMask


def test_a_whole_gpt_whose_stage_no_mistake_reproduces_gets_its_parts_property():
    result = glassgpt.check(model(GPTShortcutAfterNorm, TINY_GPT), ids=[1, 2, 3, 4, 5])
    assert result.first.name == "trf_blocks.0.shortcut1" and result.mistake is None
    assert "checked alone on the book's inputs, trf_blocks.0: the first (around the attention) shortcut" in \
        result.finding and "no known mistake" not in result.finding
    assert result.notes[-1] == "property broken: shortcut1 (output, position 0)"


def test_a_qwen3_port_whose_attention_reads_the_future_is_named_at_its_first_row():
    result = glassgpt.check(model(QwenNoMask, QWEN3_TINY))
    assert result.first.name == "trf_blocks.0.att" and "no known mistake" not in result.finding
    assert result.notes[-1] == "property broken: no_future (attention weights, row 0 of head 0)", result.to_text()


def test_the_docs_property_findings_are_what_check_prints():
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text()
    blocks = [b.split("\n```")[0] for b in docs.split("```\n")[1:]]
    printed = {b.splitlines()[0]: b.splitlines()[-1] for b in blocks if b.startswith("glassgpt check: ")}
    assert printed["glassgpt check: MultiHeadAttention"] == CASES["ch3_mask_after_softmax"][0]().finding
    assert printed["glassgpt check: dataset"] == CASES["ch2_built_targets_not_shifted"][0]().finding
    assert printed["glassgpt check: KV cache"] == CASES["kv_mask_not_offset"][0]().finding


def test_a_weight_outside_a_sliding_window_is_named_at_its_row():
    from glassgpt.explain.pieces.properties import attention_rows
    t = 5
    scores = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
    weights = torch.softmax(scores, dim=-1)  # causal, but every row reads back to position 0
    broken = attention_rows(weights[None, None], True, window=2)
    assert (broken.prop, broken.where) == ("window", "row 2 of head 0")
    assert "puts weight 0.333 on position 0, outside its window of 2" in broken.words


def test_the_cli_checks_a_readers_cached_qwen3_against_no_cache(tmp_path, capsys):
    from glassgpt.cli import main
    (tmp_path / "my_qwen3_kv.py").write_text(
        "import llms_from_scratch.kv_cache.qwen3 as book\n\n\n"
        "class Qwen3Model(book.Qwen3Model):\n"
        "    def reset_kv_cache(self):\n"
        "        pass  # the position counter left where the last prompt ended\n")
    assert main(["check", f"{tmp_path / 'my_qwen3_kv.py'}:Qwen3Model"]) == 1
    out = capsys.readouterr().out
    assert "glassgpt check: KV cache" in out and "after reset_kv_cache() the position counter current_pos is" in out
