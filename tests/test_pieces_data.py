"""glassgpt.check(piece), chapters 2 and 5 to 7: tokenizers, GPTDatasetV1's windows and the book's
functions. The book's own (llms_from_scratch, and SimpleTokenizerV2 as chapter 2 prints it) match;
copies with one planted mistake each are named at the token, window, row or new token where they
first differ, with the mistake.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import Dataset

import glassgpt
from glassgpt.explain.pieces import PieceError
from glassgpt.explain.pieces.data import BOOK_TEXT
from llms_from_scratch import ch02, ch04, ch05, ch06, ch07

from readers import my_model
from helpers import StrideSkips


# --- chapter 2 ----------------------------------------------------------------------------------------

class SimpleTokenizerV2:  # the book's chapter 2 listing (it is not in llms_from_scratch)
    def __init__(self, vocab):
        self.str_to_int = vocab
        self.int_to_str = {i: s for s, i in vocab.items()}

    def encode(self, text):
        preprocessed = re.split(r'([,.:;?_!"()\']|--|\s)', text)
        preprocessed = [item.strip() for item in preprocessed if item.strip()]
        preprocessed = [item if item in self.str_to_int else "<|unk|>" for item in preprocessed]
        return [self.str_to_int[s] for s in preprocessed]

    def decode(self, ids):
        text = " ".join([self.int_to_str[i] for i in ids])
        return re.sub(r'\s+([,.:;?!"()\'])', r'\1', text)


class DropsUnk(SimpleTokenizerV2):
    def encode(self, text):
        preprocessed = [item.strip() for item in re.split(r'([,.:;?_!"()\']|--|\s)', text) if item.strip()]
        return [self.str_to_int[s] for s in preprocessed if s in self.str_to_int]  # planted: unknown words dropped


class DropsEndOfText(SimpleTokenizerV2):
    def encode(self, text):
        return [i for i in super().encode(text) if i != self.str_to_int["<|endoftext|>"]]  # planted


def vocab():
    words = sorted(set(w.strip() for w in re.split(r'([,.:;?_!"()\']|--|\s)', BOOK_TEXT + " do you like tea? In "
                                                                                       "the sunlit terraces of")
                       if w.strip()))
    return {w: i for i, w in enumerate(words + ["<|endoftext|>", "<|unk|>"])}


class TargetsNotShifted(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        super().__init__(txt, tokenizer, max_length, stride)
        self.target_ids = list(self.input_ids)  # planted: the targets are the inputs


class MaxLengthPlusOne(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        self.input_ids, self.target_ids = [], []
        ids = tokenizer.encode(txt, allowed_special={"<|endoftext|>"})
        for i in range(0, len(ids) - max_length, stride):
            self.input_ids.append(torch.tensor(ids[i:i + max_length + 1]))  # planted: + 1
            self.target_ids.append(torch.tensor(ids[i + 1:i + max_length + 2]))


class MaxLengthMinusOne(ch02.GPTDatasetV1):
    def __init__(self, txt, tokenizer, max_length, stride):
        self.input_ids, self.target_ids = [], []
        ids = tokenizer.encode(txt, allowed_special={"<|endoftext|>"})
        for i in range(0, len(ids) - max_length, stride):
            self.input_ids.append(torch.tensor(ids[i:i + max_length - 1]))  # planted: - 1
            self.target_ids.append(torch.tensor(ids[i + 1:i + max_length]))


DATA_PLANTED = {  # id: (piece, stage, mistake, words)
    "stride_skips": (type("GPTDatasetV1", (StrideSkips,), {}), "windows", "stride_skips", "stride + 1"),
    "not_shifted": (type("GPTDatasetV1", (TargetsNotShifted,), {}), "windows", "not_shifted",
                    "token_ids[i + 1:i + max_length + 1]"),
    "max_length_plus_1": (type("GPTDatasetV1", (MaxLengthPlusOne,), {}), "windows", "max_length_plus_1",
                          "max_length + 1 tokens"),
    "max_length_minus_1": (type("GPTDatasetV1", (MaxLengthMinusOne,), {}), "windows", "max_length_minus_1",
                           "max_length - 1 tokens"),
    "drops_unk": (lambda: DropsUnk(vocab()), "tokens", "drops_unk", "<|unk|>"),
    "drops_endoftext": (lambda: DropsEndOfText(vocab()), "tokens", "drops_endoftext", "<|endoftext|>"),
}


@pytest.mark.parametrize("bug", sorted(DATA_PLANTED))
def test_each_planted_chapter_2_mistake_is_named(bug):
    piece, stage, mistake, words = DATA_PLANTED[bug]
    result = glassgpt.check(piece if isinstance(piece, type) else piece())
    assert (result.stage, result.mistake) == (stage, mistake), result.to_text()
    assert words in result.finding and "\n" not in result.finding


def test_a_stride_that_skips_is_placed_at_window_1_with_both_windows():
    result = glassgpt.check(type("GPTDatasetV1", (StrideSkips,), {}))
    assert result.where == "window 1"
    assert result.finding.startswith("window 1's inputs first differ (max_length 4, stride 1)")


def test_position_ids_from_1_are_named_at_the_position_embeddings():
    result = glassgpt.check(my_model("pos_from_1"))
    assert result.first.name == "pos_emb" and result.mistake == "pos_from_1"
    assert "torch.arange(seq_len)" in result.finding


def test_the_books_tokenizers_and_windows_match(offline_tiktoken):
    import tiktoken
    assert glassgpt.check(SimpleTokenizerV2(vocab())).ok
    result = glassgpt.check(tiktoken.get_encoding("gpt2"))
    assert result.ok and "<|endoftext|> as 50256" in result.finding
    assert glassgpt.check(ch02.GPTDatasetV1).ok
    result = glassgpt.check(ch02.create_dataloader_v1)
    assert result.ok, result.to_text()


def test_a_unknown_word_dropped_is_placed_at_its_token():
    result = glassgpt.check(DropsUnk(vocab()))
    assert result.where == "token 0"  # "Hello" is not in the vocabulary
    assert "the book's" in result.finding and "'<|unk|>'" in result.finding


def test_a_dataset_already_built_is_checked_against_its_text():
    tok = glassgpt.get_tokenizer("gpt2")
    assert glassgpt.check(ch02.GPTDatasetV1(BOOK_TEXT, tok, 4, 4), text=BOOK_TEXT, max_length=4, stride=4).ok
    bad = TargetsNotShifted(BOOK_TEXT, tok, 4, 4)
    assert glassgpt.check(bad, text=BOOK_TEXT, max_length=4, stride=4).mistake == "not_shifted"
    alone = glassgpt.check(bad)  # no text: its windows alone show targets equal to the inputs
    assert (alone.stage, alone.where, alone.prop, alone.mistake) == ("windows", "window 0", "shift", "not_shifted")


# --- chapters 4 to 7: the book's functions, one change each -----------------------------------------------

def generate_temperature_after_softmax(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None,
                                       eos_id=None):
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])[:, -1, :]
        if top_k is not None:
            top_logits, _ = torch.topk(logits, top_k)
            logits = torch.where(logits < top_logits[:, -1], torch.tensor(float("-inf")), logits)
        if temperature > 0.0:
            probs = torch.softmax(logits, dim=-1) / temperature  # planted: after the softmax
            idx_next = torch.multinomial(probs, num_samples=1)
        else:
            idx_next = torch.argmax(logits, dim=-1, keepdim=True)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def generate_top_k_minus_1(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, eos_id=None):
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])[:, -1, :]
        if top_k is not None:
            top_logits, _ = torch.topk(logits, top_k)
            logits = torch.where(logits <= top_logits[:, -1], torch.tensor(float("-inf")), logits)  # planted: <=
        if temperature > 0.0:
            idx_next = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1)
        else:
            idx_next = torch.argmax(logits, dim=-1, keepdim=True)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def calc_loss_batch_not_flattened(input_batch, target_batch, model, device):
    logits = model(input_batch.to(device))
    return torch.nn.functional.cross_entropy(logits, target_batch.to(device))  # planted: no flatten


def calc_accuracy_first_token(data_loader, model, device, num_batches=None):
    model.eval()
    correct, seen = 0, 0
    for input_batch, target_batch in data_loader:
        with torch.no_grad():
            logits = model(input_batch)[:, 0, :]  # planted: the first token
        correct += (torch.argmax(logits, dim=-1) == target_batch).sum().item()
        seen += target_batch.shape[0]
    return correct / seen


def calc_loss_batch_first_token(input_batch, target_batch, model, device):
    logits = model(input_batch)[:, 0, :]  # planted: the first token
    return torch.nn.functional.cross_entropy(logits, target_batch)


def collate_no_ignore(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    inputs, targets = ch07.custom_collate_draft_2(batch, pad_token_id, device)  # planted: the draft, no -100
    if allowed_max_length is not None:
        inputs, targets = inputs[:, :allowed_max_length], targets[:, :allowed_max_length]
    return inputs, targets


def collate_first_eot_masked(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    inputs, targets = ch07.custom_collate_fn(batch, pad_token_id, ignore_index, allowed_max_length, device)
    targets = targets.clone()
    targets[targets == pad_token_id] = ignore_index  # planted: the first end token too
    return inputs, targets


def generate_text_first_position(model, idx, max_new_tokens, context_size):
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(idx[:, -context_size:])
        idx_next = torch.argmax(logits[:, 0, :], dim=-1, keepdim=True)  # planted: the first position
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def collate_not_shifted(batch, pad_token_id=50256, ignore_index=-100, allowed_max_length=None, device="cpu"):
    inputs, _ = ch07.custom_collate_fn(batch, pad_token_id, ignore_index, allowed_max_length, device)
    targets = inputs.clone()  # planted: the targets are the inputs
    for row, item in enumerate(batch):
        targets[row, len(item) + 1:] = ignore_index
    return inputs, targets


def rename(fn, name):
    fn.__name__ = name
    return fn


FUNCTION_PLANTED = {  # id: (function, stage, mistake, words)
    "temperature_after_softmax": (rename(generate_temperature_after_softmax, "generate"), "tokens",
                                  "temperature_after_softmax", "softmax(logits / temperature)"),
    "top_k_minus_1": (rename(generate_top_k_minus_1, "generate"), "tokens", "top_k_minus_1", "k - 1"),
    "not_flattened": (rename(calc_loss_batch_not_flattened, "calc_loss_batch"), "loss", "not_flattened",
                      "logits.flatten(0, 1)"),
    "first_token_accuracy": (rename(calc_accuracy_first_token, "calc_accuracy_loader"), "accuracy", "first_token",
                             "[:, -1, :]"),
    "first_token_loss": (rename(calc_loss_batch_first_token, "calc_loss_batch"), "loss", "first_token",
                         "[:, -1, :]"),
    "first_position": (rename(generate_text_first_position, "generate_text_simple"), "tokens", "first_position",
                       "logits[:, -1, :]"),
    "collate_not_shifted": (rename(collate_not_shifted, "custom_collate_fn"), "targets", "not_shifted",
                            "padded[1:]"),
    "no_ignore_index": (rename(collate_no_ignore, "custom_collate_fn"), "targets", "no_ignore_index", "-100"),
    "first_eot_masked": (rename(collate_first_eot_masked, "custom_collate_fn"), "targets", "first_eot_masked",
                         "indices[1:]"),
}


@pytest.mark.parametrize("bug", sorted(FUNCTION_PLANTED))
def test_each_planted_function_mistake_is_named(bug):
    fn, stage, mistake, words = FUNCTION_PLANTED[bug]
    result = glassgpt.check(fn)
    assert (result.stage, result.mistake) == (stage, mistake), result.to_text()
    assert words in result.finding and "\n" not in result.finding


def test_every_known_mistake_of_chapters_2_and_5_to_7_is_planted_in_a_test():
    from glassgpt.explain.pieces import data, functions
    planted = {m for _, _, m, _ in DATA_PLANTED.values()} | {m for _, _, m, _ in FUNCTION_PLANTED.values()}
    assert set(data.MISTAKES) | set(functions.MISTAKES) == planted


def test_a_sampling_mistake_names_the_first_new_token_that_differs_and_both_ids():
    result = glassgpt.check(rename(generate_top_k_minus_1, "generate"))
    assert re.match(r"with temperature=1\.5, top_k=3, new token \d+ first differs: yours \d+, glassgpt's \d+",
                    result.finding), result.finding


def test_padding_left_unmasked_is_placed_at_its_row_and_position():
    result = glassgpt.check(rename(collate_no_ignore, "custom_collate_fn"))
    assert result.where == "row 1, position 2"  # [5, 6]: its targets are 6, 50256 (kept), then padding


@pytest.mark.parametrize("fn", [ch04.generate_text_simple, ch05.generate, ch05.calc_loss_batch, ch05.calc_loss_loader,
                                ch06.calc_loss_batch, ch06.calc_accuracy_loader, ch07.custom_collate_fn,
                                ch07.format_input])
def test_the_books_functions_match(fn):
    result = glassgpt.check(fn)
    assert result.ok, result.to_text()


def test_chapter_6s_loss_is_told_from_chapter_5s_by_what_it_does():
    assert glassgpt.check(ch05.calc_loss_batch).kind == "calc_loss_batch (chapter 5)"
    assert glassgpt.check(ch06.calc_loss_batch).kind == "calc_loss_batch (chapter 6)"


def test_a_format_input_without_the_input_header_is_placed_at_its_character():
    def format_input(entry):
        return ch07.format_input(entry).replace("### Input:", "### Input")
    result = glassgpt.check(format_input)
    k = ch07.format_input({"instruction": "Identify the correct spelling of the following word.",
                           "input": "Ocassion"}).index("### Input:") + len("### Input")
    assert result.stage == "text" and result.where == f"character {k} of the entry with an input"


def test_a_dataset_class_of_its_own_is_not_a_dataset_of_windows():
    class Pairs(Dataset):
        def __init__(self, n):
            self.n = n
    with pytest.raises(PieceError, match="no kind glassgpt check knows"):
        glassgpt.check(Pairs(3))


def test_a_data_loader_already_built_is_checked_batch_by_batch():
    from torch.utils.data import DataLoader
    tok = glassgpt.get_tokenizer("gpt2")
    loader = DataLoader(ch02.GPTDatasetV1(BOOK_TEXT, tok, 4, 2), batch_size=3, shuffle=False)
    assert glassgpt.check(loader, text=BOOK_TEXT, max_length=4, stride=2).ok
    skipping = DataLoader(StrideSkips(BOOK_TEXT, tok, 4, 2), batch_size=3, shuffle=False)
    result = glassgpt.check(skipping, text=BOOK_TEXT, max_length=4, stride=2)
    assert result.mistake == "stride_skips" and result.where == "window 1"


class SimpleTokenizerV1:  # the book's chapter 2 listing: no <|unk|>, no <|endoftext|>
    def __init__(self, vocab):
        self.str_to_int = vocab
        self.int_to_str = {i: s for s, i in vocab.items()}

    def encode(self, text):
        preprocessed = [item.strip() for item in re.split(r'([,.:;?_!"()\']|--|\s)', text) if item.strip()]
        return [self.str_to_int[s] for s in preprocessed]

    def decode(self, ids):
        return re.sub(r'\s+([,.?!"()\'])', r'\1', " ".join([self.int_to_str[i] for i in ids]))


def test_simple_tokenizer_v1_is_checked_on_words_its_vocabulary_knows_and_a_decode_slip_is_placed():
    words = {w: i for i, w in enumerate(sorted(set(re.findall(r"\w+|[^\w\s]", BOOK_TEXT))))}
    result = glassgpt.check(SimpleTokenizerV1(words))
    assert result.ok and result.kind == "SimpleTokenizerV1", result.to_text()

    class NoPunctuationFix(SimpleTokenizerV1):
        def decode(self, ids):
            return " ".join(self.int_to_str[i] for i in ids)  # planted: the space before punctuation stays
    result = glassgpt.check(NoPunctuationFix(words))
    assert result.stage == "decode" and "remove the space before punctuation" in result.finding


def test_a_whole_gpt_class_goes_to_the_stage_by_stage_check():
    result = glassgpt.check(ch04.GPTModel, args={"vocab_size": 50257, "context_length": 16, "emb_dim": 32,
                                                 "n_heads": 2, "n_layers": 1, "drop_rate": 0.1, "qkv_bias": False})
    assert result.ok and result.finding.startswith("matches the book's formulas at every stage")
