"""A byte-level BPE learned from a corpus (tokenizer.train_bpe), and block-wise reading."""

from __future__ import annotations

import io
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import glassgpt
from glassgpt.tokenizer import (GPT2_PATTERN, TokenizerError, get_tokenizer, iter_text_blocks,
                                tokenizer_from_dict, train_bpe)

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café", "日本語", "🙂",
         "don't", "we'll", "42", "3.14", "!", "--"]


def corpus(n_words: int = 3000, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines, line = [], []
    for _ in range(n_words):
        line.append(rng.choice(WORDS))
        if rng.random() < 0.1:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def bpe():
    return train_bpe(corpus(), 320)


def test_learned_bpe_has_the_requested_vocabulary_with_eot_last(bpe):
    assert bpe.n_vocab == 320
    assert bpe.eot_id == 319
    assert bpe.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [319]


def test_first_256_tokens_are_the_bytes(bpe):
    assert [bpe.token_bytes(i) for i in range(256)] == [bytes([b]) for b in range(256)]


def test_merges_make_frequent_words_single_tokens(bpe):
    assert len(bpe.encode(" quick")) == 1
    assert len(bpe.encode(" jumps")) == 1
    text = corpus(500, seed=1)
    assert len(bpe.encode(text)) < len(text.encode("utf-8")) / 2


def test_first_merge_is_the_most_frequent_pair():
    # "ab" occurs 3 times inside pieces, "cd" twice: the first merge must be a+b.
    tok = train_bpe("ab ab ab cd cd", 258)
    assert tok.token_bytes(256) == b"ab"


def test_merges_never_cross_pretokenized_pieces():
    # The pieces are "xy", " xy", " xy", ...: a space always starts a piece, so no
    # learned token may hold "y " or end in a space.
    tok = train_bpe("xy xy xy xy xy xy", 300)
    learned = {tok.token_bytes(i) for i in range(256, tok.n_vocab - 1)}
    assert all(b"y " not in t and not t.endswith(b" ") for t in learned)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text())
def test_learned_bpe_round_trips_any_unicode(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab \n\t'é1🙂")), max_size=60))
def test_learned_bpe_round_trips_whitespace_and_contractions(text):
    tok = train_bpe("ab ab 'll\n\n a\t1 🙂🙂 éé", 270)
    assert tok.decode(tok.encode(text)) == text


def test_ids_are_stable_after_save_and_load(bpe, tmp_path):
    text = corpus(400, seed=2) + "unseen words: zebra, Ωmega 🙂"
    ids = bpe.encode(text)
    path = tmp_path / "bpe.json"
    bpe.save(path)
    loaded = glassgpt.get_tokenizer(str(path))  # a tokenizer file is read by formats/
    assert loaded.encode(text) == ids
    assert loaded.decode(ids) == text
    assert json.loads(path.read_text())["type"] == "bpe"
    assert tokenizer_from_dict(bpe.to_dict()).encode(text) == ids


def test_training_is_deterministic():
    a, b = train_bpe(corpus(seed=3), 300), train_bpe(corpus(seed=3), 300)
    assert a.to_dict() == b.to_dict()


def test_files_and_text_learn_the_same_merges(tmp_path):
    text = corpus(seed=4)
    path = tmp_path / "c.txt"
    path.write_text(text, encoding="utf-8")
    assert train_bpe(path, 300).to_dict()["tokens"] == train_bpe(text, 300).to_dict()["tokens"]
    assert train_bpe([path, path], 300).to_dict()["pattern"] == GPT2_PATTERN


def test_small_corpus_stops_when_no_pair_repeats():
    tok = train_bpe("abc", 1000)
    assert tok.n_vocab == 257  # nothing occurs twice: the 256 bytes and <|endoftext|>


@pytest.mark.parametrize("vocab_size", [0, 256, 2.5])
def test_vocab_size_below_the_byte_alphabet_is_refused(vocab_size):
    with pytest.raises(TokenizerError, match="vocab_size must be at least 257"):
        train_bpe("hello", vocab_size)


def test_empty_corpus_and_non_utf8_file_are_refused(tmp_path):
    with pytest.raises(TokenizerError, match="empty"):
        train_bpe("", 300)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(TokenizerError, match="latin1.txt is not UTF-8"):
        train_bpe(bad, 300)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([" ", "\n", "\r\n", "\t", "a", "Bc", "1", "'s", "  ", "\n\n", " \n", "é", "\u3000", "!"]),
                max_size=40),
       st.integers(1, 8))
def test_text_blocks_encode_exactly_like_the_whole_text(parts, block_chars):
    text = "".join(parts)
    gpt2 = get_tokenizer("gpt2")
    blocks = list(iter_text_blocks(io.StringIO(text, newline=""), block_chars))
    assert "".join(blocks) == text
    assert [i for b in blocks for i in gpt2.encode(b)] == gpt2.encode(text)
