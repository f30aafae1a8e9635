"""A mistake no catalogue entry reproduces still gets the broken property and the position where it first
shows, in every check's last resort: generate, the losses, the accuracy, the collate function, chapter 4's
parts, the tokenizer's encode, GPTDatasetV1, and a whole model (GPT-2's stages and a described model's).

Each case plants one mistake into the book's own code (llms_from_scratch, one change) that no MISTAKES key
of explain/ reproduces (OUTSIDE_CATALOGUE: every case here), and asserts the stage, the position and the
property named, with no "no known mistake" in the finding.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import glassgpt
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt.explain.pieces import LLAMA3_TINY, QWEN3_TINY
from glassgpt.explain.pieces.data import BOOK_TEXT, SPLIT
from glassgpt.tokenizer import get_tokenizer
from llms_from_scratch import ch02, ch04, ch05, ch06, ch07
from helpers import RMSNormCentred


def rename(fn, name):
    fn.__name__ = name
    return fn


def named(cls: type, name: str) -> type:
    return type(name, (cls,), {})


# --- chapter 5: generate ----------------------------------------------------------------------------------

def generate_one_too_many(model, idx, max_new_tokens, context_size):
    return ch04.generate_text_simple(model, idx, max_new_tokens + 1, context_size)  # planted: one turn more


def generate_logits_times_temperature(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None,
                                      eos_id=None):
    if temperature > 0:
        temperature = 1 / temperature  # planted: logits * temperature
    return ch05.generate(model, idx, max_new_tokens, context_size, temperature, top_k, eos_id)


# --- chapters 5 and 6: the losses and the accuracy -------------------------------------------------------

def loss_over_batch_size(input_batch, target_batch, model, device):
    logits = model(input_batch)
    ce = F.cross_entropy(logits.flatten(0, 1), target_batch.flatten(), reduction="sum")
    return ce / input_batch.shape[0]  # planted: the mean over the batch, not over every position


def loss_targets_transposed(input_batch, target_batch, model, device):
    logits = model(input_batch)
    return F.cross_entropy(logits.flatten(0, 1), target_batch.T.flatten())  # planted: another order


def loss_gathered_by_hand(input_batch, target_batch, model, device):
    logp = torch.log_softmax(model(input_batch), dim=-1)
    picked = logp.gather(-1, target_batch.clamp(min=0)[..., None])  # planted: -100 read as token 0
    return -picked.mean()


def loader_over_examples(data_loader, model, device, num_batches=None):
    total = sum(ch05.calc_loss_batch(x, y, model, device).item() for x, y in data_loader)
    return total / sum(len(x) for x, _ in data_loader)  # planted: divided by the examples, not the batches


def accuracy_over_batches(data_loader, model, device, num_batches=None):
    model.eval()
    right = 0
    for x, y in data_loader:
        with torch.no_grad():
            right += (model(x)[:, -1, :].argmax(-1) == y).sum().item()
    return right / (len(data_loader) * 3)  # planted: a count that is not the examples'


def accuracy_in_training_mode(data_loader, model, device, num_batches=None):
    model.train()  # planted: train() where eval() was meant
    right = seen = 0
    for x, y in data_loader:
        with torch.no_grad():
            right += (model(x)[:, -1, :].argmax(-1) == y).sum().item()
        seen += len(y)
    return right / seen


for fn in (loss_over_batch_size, loss_targets_transposed, loss_gathered_by_hand):
    rename(fn, "calc_loss_batch")
rename(loader_over_examples, "calc_loss_loader")
for fn in (accuracy_over_batches, accuracy_in_training_mode):
    rename(fn, "calc_accuracy_loader")


# --- chapter 7: the collate function ---------------------------------------------------------------------

def collate_float_ids(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    x, y = ch07.custom_collate_fn(batch, pad_token_id, ignore_index, allowed_max_length, device)
    return x.float(), y  # planted: the inputs as floats


def collate_pad_written_in(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    return ch07.custom_collate_fn(batch, 50256, ignore_index, allowed_max_length, device)  # planted: not the argument


for fn in (collate_float_ids, collate_pad_written_in):
    rename(fn, "custom_collate_fn")


# --- chapter 2: the tokenizer and the windows ----------------------------------------------------------------

class SimpleTokenizerV2:  # the book's chapter 2 listing (it is not in llms_from_scratch)
    def __init__(self, vocab):
        self.str_to_int = vocab
        self.int_to_str = {i: s for s, i in vocab.items()}

    def encode(self, text):
        preprocessed = [item.strip() for item in re.split(SPLIT, text) if item.strip()]
        return [self.str_to_int.get(s, self.str_to_int["<|unk|>"]) for s in preprocessed]

    def decode(self, ids):
        return re.sub(r'\s+([,.:;?!"()\'])', r'\1', " ".join(self.int_to_str[i] for i in ids))


class TokenizerLowercases(SimpleTokenizerV2):
    def encode(self, text):
        return super().encode(text.lower())  # planted: the text lowercased first


class TokenizerEndsEveryText(SimpleTokenizerV2):
    def encode(self, text):
        return super().encode(text) + [self.str_to_int["<|endoftext|>"]]  # planted: an <|endoftext|> added


def simple_vocab():
    words = sorted(set(w.strip() for w in re.split(SPLIT, BOOK_TEXT + " do you like tea? In the sunlit terraces of")
                       if w.strip()))
    return {w: i for i, w in enumerate(words + ["<|endoftext|>", "<|unk|>"])}


class DatasetLowercases(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        super().__init__(txt.lower(), tokenizer, max_length, stride)  # planted: the text lowercased


def loader_always_shuffles(txt, batch_size=4, max_length=256, stride=128, shuffle=True, drop_last=True,
                           num_workers=0):
    torch.manual_seed(0)
    dataset = ch02.GPTDatasetV1(txt, get_tokenizer("gpt2"), max_length, stride)  # tests never download tiktoken's
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=drop_last)  # planted: shuffle=True


rename(loader_always_shuffles, "create_dataloader_v1")


# --- chapter 4: the parts ------------------------------------------------------------------------------------

class FeedForwardWithShortcut(ch04.FeedForward):
    def forward(self, x):
        return x + self.layers(x)  # planted: the block's shortcut inside the feed forward


class NormScaleShiftSwapped(ch04.LayerNorm):
    def forward(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return self.shift * (x - mean) / torch.sqrt(var + self.eps) + self.scale  # planted: the two swapped


# --- a whole model: GPT-2's stages and a described model's ----------------------------------------------------

TINY_GPT = {"vocab_size": 97, "context_length": 16, "emb_dim": 32, "n_heads": 4, "n_layers": 2, "drop_rate": 0.0,
            "qkv_bias": False}


def model(cls, cfg):
    torch.manual_seed(123)
    return cls(cfg).eval()


class GPTPositionsReversed(ch04.GPTModel):
    def forward(self, in_idx):
        seq_len = in_idx.shape[1]
        pos = self.pos_emb(torch.arange(seq_len, device=in_idx.device).flip(0))  # planted: the last position first
        x = self.drop_emb(self.tok_emb(in_idx) + pos)
        return self.out_head(self.final_norm(self.trf_blocks(x)))


class GPTEmbeddingsScaled(ch04.GPTModel):
    def forward(self, in_idx):
        seq_len = in_idx.shape[1]
        tok = self.tok_emb(in_idx) * self.tok_emb.weight.shape[1] ** 0.5  # planted: Gemma's scale in GPT-2
        x = self.drop_emb(tok + self.pos_emb(torch.arange(seq_len, device=in_idx.device)))
        return self.out_head(self.final_norm(self.trf_blocks(x)))


class MaskOneLate(ch04.MultiHeadAttention):
    def forward(self, x):
        b, t, _ = x.shape
        keys = self.W_key(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        scores = queries @ keys.transpose(2, 3)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(2), -torch.inf)  # planted: diagonal=2
        weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
        return self.out_proj((weights @ values).transpose(1, 2).reshape(b, t, self.d_out))


class ScaleByHeadSize(ch04.MultiHeadAttention):
    def forward(self, x):
        b, t, _ = x.shape
        keys = self.W_key(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        scores = (queries @ keys.transpose(2, 3)).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -torch.inf)
        weights = torch.softmax(scores / keys.shape[-1], dim=-1)  # planted: the head size, not its root
        return self.out_proj((weights @ values).transpose(1, 2).reshape(b, t, self.d_out))


class GPTScaleByHeadSize(ch04.GPTModel):
    def __init__(self, cfg):
        super().__init__(cfg)
        for blk in self.trf_blocks:
            blk.att.__class__ = ScaleByHeadSize


class GPTMaskOneLate(ch04.GPTModel):
    def __init__(self, cfg):
        super().__init__(cfg)
        for blk in self.trf_blocks:
            blk.att.__class__ = MaskOneLate


class QwenFinalNormCentred(book_qwen.Qwen3Model):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.final_norm.__class__ = RMSNormCentred


class LlamaEmbeddingsDoubled(book_llama.Llama3Model):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.tok_emb.register_forward_hook(lambda mod, args, out: out * 2)  # planted: the rows twice over


SMALL_CFG = {"vocab_size": 50257, "context_length": 32, "emb_dim": 64, "n_heads": 4, "n_layers": 1,
             "drop_rate": 0.0, "qkv_bias": False}


CASES = {  # id: (a call giving the result, stage, where, property)
    "ch5_generate_one_turn_more": (lambda: glassgpt.check(rename(generate_one_too_many, "generate_text_simple")),
                                   "tokens", "new token 12", "new_tokens"),
    "ch5_generate_logits_times_temperature": (lambda: glassgpt.check(rename(generate_logits_times_temperature,
                                                                            "generate")),
                                              "tokens", "new token 1", "temperature"),
    "ch5_loss_over_batch_size": (lambda: glassgpt.check(loss_over_batch_size), "loss", "the count", "loss_count"),
    "ch5_loss_targets_transposed": (lambda: glassgpt.check(loss_targets_transposed), "loss", "window 0, position 1",
                                    "loss_pairing"),
    "ch7_loss_ignores_nothing": (lambda: glassgpt.check(loss_gathered_by_hand), "loss", "window 1, position 2",
                                 "ignore_index"),
    "ch5_loader_over_examples": (lambda: glassgpt.check(loader_over_examples), "loss", "the number of batches",
                                 "loss_count"),
    "ch6_accuracy_over_another_count": (lambda: glassgpt.check(accuracy_over_batches), "accuracy", "the count",
                                        "example_count"),
    "ch6_accuracy_in_training_mode": (lambda: glassgpt.check(accuracy_in_training_mode), "accuracy", "batch 0",
                                      "eval_mode"),
    "ch7_collate_float_ids": (lambda: glassgpt.check(collate_float_ids), "inputs", "the batch", "integer_ids"),
    "ch7_collate_pad_written_in": (lambda: glassgpt.check(collate_pad_written_in), "inputs", "row 1, position 2",
                                   "pad_id"),
    "ch2_tokenizer_lowercases": (lambda: glassgpt.check(TokenizerLowercases(simple_vocab())), "tokens", "token 8",
                                 "lookup"),
    "ch2_tokenizer_ends_every_text": (lambda: glassgpt.check(TokenizerEndsEveryText(simple_vocab())), "tokens",
                                      "token 16", "token_count"),
    "ch2_dataset_lowercases": (lambda: glassgpt.check(named(DatasetLowercases, "GPTDatasetV1")), "windows",
                               "window 0", "window_tokens"),
    "ch2_loader_always_shuffles": (lambda: glassgpt.check(loader_always_shuffles), "windows", "window 0", "order"),
    "ch4_ff_shortcut_inside": (lambda: glassgpt.check(named(FeedForwardWithShortcut, "FeedForward"), args=SMALL_CFG),
                               "output", "position 0", "ff_output"),
    "ch4_norm_scale_shift_swapped": (lambda: glassgpt.check(named(NormScaleShiftSwapped, "LayerNorm")), "output",
                                     "row 0", "scale_shift"),
}
WHOLE = {  # id: (the model, the first stage, its property, words of the finding)
    "ch4_gpt_positions_reversed": (lambda: model(GPTPositionsReversed, TINY_GPT), "pos_emb", "positions",
                                   "position 0 holds row 4 of pos_emb.weight"),
    "ch4_gpt_embeddings_scaled": (lambda: model(GPTEmbeddingsScaled, TINY_GPT), "embeddings", "embeddings_sum",
                                  "the blocks read sqrt(emb_dim) = 5.657 x tok_emb + 1 x pos_emb"),
    "ch4_gpt_mask_one_late": (lambda: model(GPTMaskOneLate, TINY_GPT), "trf_blocks.0.att", "no_future",
                              "position 0's output changes when the tokens after it are cut off"),
    "qwen3_final_norm_centred": (lambda: model(QwenFinalNormCentred, QWEN3_TINY), "final_norm", "norm_mean",
                                 "position 0 of the normalized output has mean 0: RMSNorm subtracts no mean"),
    "llama3_embeddings_doubled": (lambda: model(LlamaEmbeddingsDoubled, LLAMA3_TINY), "tok_emb", "factor",
                                  "tok_emb's output is 2 times the formula's at every position"),
}
OUTSIDE_CATALOGUE = set(CASES) | set(WHOLE)  # every case here: no MISTAKES key of explain/ reproduces it


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_unlisted_mistake_is_named_by_the_property_it_breaks_at_its_first_position(case):
    run, stage, where, prop = CASES[case]
    result = run()
    assert not result.ok, result.to_text()
    assert (result.stage, result.where, result.prop) == (stage, where, prop), result.to_text()
    assert "no known mistake" not in result.finding and "\n" not in result.finding
    assert case in OUTSIDE_CATALOGUE and result.mistake is None, result.to_text()


@pytest.mark.parametrize("case", sorted(WHOLE))
def test_a_whole_models_unlisted_mistake_is_named_by_its_stages_property(case):
    build, stage, prop, words = WHOLE[case]
    result = glassgpt.check(build(), ids=[1, 2, 3, 4, 5])
    assert result.first.name == stage and result.prop == prop, result.to_text()
    assert words in result.finding and "no known mistake" not in result.finding, result.to_text()
    assert case in OUTSIDE_CATALOGUE and result.mistake is None, result.to_text()


def test_the_issues_count_holds_with_these_cases():
    """Issue 49: at least ten planted mistakes outside the catalogue (these, besides test_check_findings'),
    one at least for each of check's last resorts."""
    assert len(OUTSIDE_CATALOGUE) >= 10


def test_the_docs_unlisted_loss_finding_is_what_check_prints():
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text()
    blocks = [b.split("\n```")[0] for b in docs.split("```\n")[1:]]
    printed = {b.splitlines()[0]: b.rstrip("\n") for b in blocks if b.startswith("glassgpt check: calc_loss_batch")}
    assert printed["glassgpt check: calc_loss_batch (chapter 5)"] == glassgpt.check(loss_over_batch_size).to_text()


def test_where_no_property_breaks_the_finding_says_what_was_checked():
    """A GPT-2 whose attention divides the scores by the head size (not its root): its weights still sum to 1 and
    read nothing later, so the stage's finding says so before "no known mistake"; checked alone, the part's
    fitted scale then names it (glassgpt.check)."""
    from glassgpt.explain.verify import check as check_stages
    gpt = model(GPTScaleByHeadSize, TINY_GPT)
    staged = check_stages(gpt, ids=[1, 2, 3, 4, 5])
    assert staged.first.name == "trf_blocks.0.att" and staged.prop is None and staged.mistake is None
    assert "it keeps what was checked there (its weights summing to 1, nothing read after a position), and no " \
           "known mistake reproduces it" in staged.finding, staged.finding
    result = glassgpt.check(gpt, ids=[1, 2, 3, 4, 5])
    assert "checked alone on the book's inputs, trf_blocks.0.att: the scores are divided by the head size 8 itself" \
        in result.finding and "no known mistake" not in result.finding, result.finding


def test_the_packages_gpt2_kv_cache_is_named_by_its_mask_shape():
    """A mistake nobody planted: llms_from_scratch's kv_cache/gpt2.py (the installed package) slices its causal
    mask by columns, causal_mask[:, -num_tokens:], so a step of one new token with use_cache=True cannot mask its
    [1, keys] scores (it raises); check names the mask's shape at the first cached step. (The chapter's own
    gpt_with_kv_cache.py slices rows, mask[ptr:ptr + num_tokens, :num_keys]: CachedGPT in test_check_findings.)"""
    import llms_from_scratch.kv_cache.gpt2 as pkg_kv_gpt2
    result = glassgpt.check(model(pkg_kv_gpt2.GPTModel, TINY_GPT))
    assert (result.kind, result.stage, result.where, result.prop) == ("KV cache", "cache", "step 1 of run 1",
                                                                      "mask_shape"), result.to_text()
    assert "the mask must be [num_tokens, num_keys]" in result.finding
