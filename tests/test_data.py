"""data.py: files -> checked, cached token ids -> train/val split -> windows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glassgpt.training.tasks import data
from glassgpt.training.tasks.data import (EVAL_BATCHES, DataError, TextTask, build_tokenizer, load_corpus, resolve_files,
                                    split_ids, token_dtype, tokenize_files)
from glassgpt.tokenizer import CharTokenizer, get_tokenizer, train_bpe

TEXT = "".join(f"line {i}: the quick brown fox, café 🙂 jumps over {i * 7} lazy dogs.\n" for i in range(300))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# --- finding and checking files ----------------------------------------------------------

def test_a_folder_means_its_txt_files_in_sorted_order_skipping_hidden(tmp_path):
    (tmp_path / "b.txt").write_text("b")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("c")
    (tmp_path / "notes.md").write_text("not text for training")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "d.txt").write_text("d")
    assert [p.name for p in resolve_files(tmp_path)] == ["a.txt", "b.txt", "c.txt"]


def test_a_glob_and_a_single_file(tmp_path, text_file):
    (tmp_path / "x.md").write_text("x")
    assert resolve_files(str(tmp_path / "*.md")) == [tmp_path / "x.md"]
    assert resolve_files(text_file) == [text_file]


@pytest.mark.parametrize("spec, message", [
    ("missing.txt", "no such file or directory"),
    ("*.nothing", "no file matches"),
])
def test_missing_data_is_a_clear_error(tmp_path, spec, message):
    with pytest.raises(DataError, match=message):
        resolve_files(tmp_path / spec)


def test_a_folder_without_txt_files_is_refused(tmp_path):
    with pytest.raises(DataError, match="holds no .txt files"):
        resolve_files(tmp_path)


@pytest.mark.parametrize("content, message", [
    (b"", "empty"),
    (b"text\x00\x01binary", r"looks binary \(a NUL byte at byte 4\)"),
    ("caf\u00e9 au lait".encode("latin-1"), r"is not UTF-8 text \(byte 0xe9 at byte 3\)"),
    ("ok 🙂".encode("utf-8")[:-1], "ends inside a multi-byte character"),
])
def test_bad_files_are_refused_naming_the_file(tmp_path, content, message):
    bad = tmp_path / "bad_file.txt"
    bad.write_bytes(content)
    (tmp_path / "good.txt").write_text("fine text\n")
    with pytest.raises(DataError, match=message) as err:
        load_corpus(tmp_path, "gpt2", tmp_path / "cache")
    assert "bad_file.txt" in str(err.value)


def test_non_utf8_offset_counts_bytes_across_read_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "READ_BYTES", 16)
    bad = tmp_path / "late.txt"
    bad.write_bytes("é".encode() * 20 + b"\xff")  # 40 bytes of valid 2-byte characters, then junk
    with pytest.raises(DataError, match="byte 0xff at byte 40"):
        data.scan_file(bad)


# --- tokenizing and the cache ----------------------------------------------------------

@pytest.mark.parametrize("spec", ["gpt2", "char", "bpe"])
def test_cached_ids_equal_encoding_the_whole_text(tmp_path, text_file, spec, monkeypatch):
    monkeypatch.setattr("glassgpt.tokenizer.iter_text_blocks.__defaults__", (500,))  # many blocks
    tokenizer = train_bpe(TEXT, 300) if spec == "bpe" else build_tokenizer(spec, [text_file])
    cache = tokenize_files([text_file], tokenizer, tmp_path / "cache")
    assert cache.ids().tolist() == tokenizer.encode(TEXT)
    assert cache.dtype == "uint16"


def test_files_are_joined_by_endoftext_when_the_tokenizer_has_one(tmp_path):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.txt").write_text("second")
    files = resolve_files(tmp_path)
    gpt2 = get_tokenizer("gpt2")
    ids = tokenize_files(files, gpt2, tmp_path / "c1").ids().tolist()
    assert ids == gpt2.encode("first") + [gpt2.eot_id] + gpt2.encode("second")
    char = build_tokenizer("char", files)
    assert tokenize_files(files, char, tmp_path / "c2").ids().tolist() == char.encode("firstsecond")


def test_token_dtype_is_uint16_until_the_vocabulary_needs_more():
    assert token_dtype(65) == "uint16"
    assert token_dtype(50257) == "uint16"
    assert token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32"


def test_cache_is_reused_when_nothing_changed(tmp_path, text_file, monkeypatch):
    tok = get_tokenizer("gpt2")
    first = tokenize_files([text_file], tok, tmp_path / "cache")

    def no_encoding(*a, **k):
        raise AssertionError("tokenized again although the cache was valid")

    monkeypatch.setattr(data, "_encode_file", no_encoding)
    again = tokenize_files([text_file], tok, tmp_path / "cache")
    assert again.path == first.path and again.n_tokens == first.n_tokens


def test_temporary_files_of_a_killed_tokenizer_are_removed(tmp_path, text_file):
    cache = tmp_path / "cache"
    cache.mkdir()
    orphans = [cache / ".tokens-0123456789abcdef.bin.4242.tmp", cache / ".tokens-0123456789abcdef.json.4242.tmp"]
    for orphan in orphans:
        orphan.write_bytes(b"half")  # what SIGKILL during tokenizing leaves
    tokenize_files([text_file], get_tokenizer("gpt2"), cache)
    assert not any(o.exists() for o in orphans) and not list(cache.glob(".tokens-*"))


def test_an_expected_fingerprint_refuses_changed_files_before_tokenizing(tmp_path, text_file, monkeypatch):
    tok = get_tokenizer("gpt2")
    key = tokenize_files([text_file], tok, tmp_path / "cache").key
    assert tokenize_files([text_file], tok, tmp_path / "cache", expect_key=key).key == key
    text_file.write_text(TEXT + "one more line\n")
    monkeypatch.setattr(data, "_encode_file", lambda *a: pytest.fail("tokenized data that was refused"))
    with pytest.raises(DataError, match="the data changed since the run started"):
        tokenize_files([text_file], tok, tmp_path / "cache", expect_key=key)


def test_a_cache_that_cannot_be_written_is_one_error_naming_it(tmp_path, text_file):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    with pytest.raises(DataError, match=r"could not write the token cache in .*blocked/cache \(.*\): free some space"):
        tokenize_files([text_file], get_tokenizer("gpt2"), blocked / "cache")


def test_changing_the_data_or_the_tokenizer_invalidates_the_cache(tmp_path, text_file):
    gpt2 = get_tokenizer("gpt2")
    first = tokenize_files([text_file], gpt2, tmp_path / "cache")
    text_file.write_text(TEXT + "one more line\n")
    changed = tokenize_files([text_file], gpt2, tmp_path / "cache")
    assert changed.key != first.key
    assert changed.ids().tolist() == gpt2.encode(TEXT + "one more line\n")
    char = build_tokenizer("char", [text_file])
    other = tokenize_files([text_file], char, tmp_path / "cache")
    assert other.key not in (first.key, changed.key)
    assert other.ids().tolist() == char.encode(TEXT + "one more line\n")


def test_moving_the_files_keeps_the_cache(tmp_path, text_file):
    tok = get_tokenizer("gpt2")
    first = tokenize_files([text_file], tok, tmp_path / "cache")
    moved = text_file.rename(tmp_path / "renamed.txt")
    assert tokenize_files([moved], tok, tmp_path / "cache").key == first.key


def test_a_truncated_cache_file_is_rebuilt(tmp_path, text_file):
    tok = get_tokenizer("gpt2")
    first = tokenize_files([text_file], tok, tmp_path / "cache")
    with open(first.path, "r+b") as f:
        f.truncate(10)
    again = tokenize_files([text_file], tok, tmp_path / "cache")
    assert again.ids().tolist() == tok.encode(TEXT)


def test_char_tokenizer_refuses_characters_it_was_not_built_with(tmp_path, text_file):
    with pytest.raises(DataError, match="not in the char tokenizer"):
        tokenize_files([text_file], CharTokenizer("abc"), tmp_path / "cache")


# --- split and windows -------------------------------------------------------------------

def test_split_is_the_first_90_percent_and_the_last_10():
    ids = np.arange(1000)
    train, val = split_ids(ids)
    assert len(train) == 900 and len(val) == 100
    assert train[-1] == 899 and val[0] == 900
    train, val = split_ids(ids, 0.25)
    assert len(val) == 250
    with pytest.raises(DataError, match="val_fraction"):
        split_ids(ids, 1.0)


def make_task(batch_size=4, **kw):
    ids = np.arange(5000) % 60000
    train, val = split_ids(ids.astype(np.uint16))
    return TextTask(train, val, context_length=16, batch_size=batch_size, seed=7, **kw)


def test_targets_are_the_inputs_shifted_by_one():
    batch = make_task().train_batch(0, 0, 0, 1)
    assert batch["input_ids"].shape == (4, 16) and batch["input_ids"].dtype == torch.int64
    # ids are arange, so each window is consecutive numbers and targets are +1.
    assert torch.equal(batch["targets"], batch["input_ids"] + 1)


def test_a_step_batch_is_a_function_of_its_arguments():
    a, b = make_task(), make_task()
    assert torch.equal(a.train_batch(5, 1, 0, 1)["input_ids"], b.train_batch(5, 1, 0, 1)["input_ids"])
    assert not torch.equal(a.train_batch(5, 0, 0, 1)["input_ids"], a.train_batch(6, 0, 0, 1)["input_ids"])


def test_global_batch_is_the_same_however_it_is_split_over_ranks_and_micro_steps():
    whole = make_task(batch_size=8).train_batch(3, 0, 0, 1)["input_ids"]
    half = make_task(batch_size=4)
    by_rank = torch.cat([half.train_batch(3, 0, r, 2)["input_ids"] for r in range(2)])
    by_micro = torch.cat([half.train_batch(3, m, 0, 1)["input_ids"] for m in range(2)])
    assert torch.equal(whole, by_rank) and torch.equal(whole, by_micro)


def test_eval_windows_are_fixed_and_spread_over_the_validation_split():
    task = make_task(eval_batches=3)
    batches = list(task.eval_batches())
    assert len(batches) == 3 and all(b["input_ids"].shape == (4, 16) for b in batches)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, task.eval_batches()))
    starts = torch.cat([b["input_ids"][:, 0] for b in batches])
    assert starts[0] == 4500 and starts[-1] == 5000 - 17  # first and last possible window of val


def test_without_a_count_the_eval_windows_score_each_held_out_token_once():
    """The-verdict's case: 515 validation tokens, context 256, batch 8. Twenty batches of 8 (160
    windows, 20 forward passes) scored each token ~80 times; the windows that cover the split are 3,
    in one forward pass, and every target of the split is among them."""
    train, val = split_ids(np.arange(5150, dtype=np.uint16))
    assert len(val) == 515
    task = TextTask(train, val, context_length=256, batch_size=8, eval_batches=None)
    batches = list(task.eval_batches())
    assert [tuple(b["input_ids"].shape) for b in batches] == [(3, 256)]
    assert set(torch.cat([b["targets"].flatten() for b in batches]).tolist()) == set(val[1:].tolist())
    assert len(list(TextTask(train, val, 256, 8, eval_batches=20).eval_batches())) == 20  # a count is kept
    long = TextTask(*split_ids(np.arange(50_000) % 60000), context_length=16, batch_size=4, eval_batches=None)
    assert len(long.eval_offsets()) == EVAL_BATCHES * 4  # 313 windows cover it: at most 20 batches


def test_text_too_short_for_one_window_is_refused():
    ids = np.arange(100, dtype=np.uint16)
    with pytest.raises(DataError, match="training split has 90 tokens, fewer than context_length"):
        TextTask(*split_ids(ids), context_length=128, batch_size=2)
    with pytest.raises(DataError, match="validation split has 10 tokens"):
        TextTask(*split_ids(ids), context_length=32, batch_size=2)


def test_sample_starts_from_held_out_text_and_decodes(tmp_path, text_file):
    from glassgpt.formats import random_model
    from glassgpt.config import GPTConfig

    tok, train, val = load_corpus(text_file, "char", tmp_path / "cache")
    task = TextTask(train, val, 32, 4, tokenizer=tok, sample_tokens=5)
    model = random_model(GPTConfig(vocab_size=tok.n_vocab, context_length=32, emb_dim=16, n_heads=2, n_layers=1),
                         torch.device("cpu"), torch.float32)
    sample = task.sample(model)
    assert sample.startswith(tok.decode(val[:8].tolist())) and len(sample) == 8 + 5
