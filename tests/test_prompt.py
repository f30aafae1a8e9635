"""One rule for a prompt longer than the model reads at once, in every command: it is cut to fit, never
refused, and a note says what was kept (a language model keeps the end, a classifier the start)."""

from __future__ import annotations

import json

import pytest

import glassgpt
from glassgpt.cli import main
from glassgpt.errors import PromptError
from glassgpt.prompt import PAD_ID, Reading, check_ids, classifier_reading, encode, fit_for, fit_prompt

CTX = 16
CFG = glassgpt.GPTConfig(vocab_size=50257, context_length=CTX, emb_dim=8, n_heads=2, n_layers=1)
LONG = " ".join(["word"] * 40)  # 40 tokens


def test_fit_keeps_the_last_or_the_first_tokens_and_says_which():
    ids = list(range(40))
    last = fit_prompt(ids, 16)
    assert last.ids == ids[24:] and last.start == 24 and last.total == 40
    assert last.note == ("the prompt is 40 tokens, more than the 16 the model reads at once (its context_length): "
                         "it saw the last 16 (tokens 24..39)")
    first = fit_prompt(ids, 16, keep="first")
    assert first.ids == ids[:16] and first.note.endswith("it saw the first 16 (tokens 0..15)")
    assert fit_prompt(ids[:16], 16).note is None and fit_prompt(ids[:16], 16).ids == ids[:16]


def test_a_classifier_is_read_as_its_record_says_padded_to_the_book_s_length_or_at_its_last_real_token():
    book, notes = classifier_reading({"recipe": "book", "padded_length": 6})
    assert book == Reading(6, padded=True) and notes == []
    padded = book.fit([5, 6, 7], CTX)
    assert padded.ids == [5, 6, 7, PAD_ID, PAD_ID, PAD_ID] and padded.padding == 3
    assert "last position, padding included (position 5)" in book.line(padded)
    assert book.fit(list(range(10)), CTX).ids == list(range(6))  # cut at the padded length, as SpamDataset cuts
    glass, _ = classifier_reading({"recipe": "glassgpt", "max_length": 4})
    cut = glass.fit(list(range(10)), CTX)
    assert not glass.padded and cut.ids == [0, 1, 2, 3] and "last real token (position 3)" in glass.line(cut)
    assert fit_for(list(range(40)), CTX, None, book).ids == list(range(24, 40))  # a language model: no reading


def test_reading_a_glassgpt_classifier_as_the_book_says_so_and_a_missing_length_is_refused():
    reading, notes = classifier_reading({"recipe": "glassgpt", "max_length": None}, padded=True, length=8)
    assert reading == Reading(8, padded=True) and "finetuned by glassgpt's recipe, on the last real token" in notes[0]
    with pytest.raises(PromptError, match="pass --max-length N"):
        classifier_reading(None, padded=True)
    with pytest.raises(PromptError, match="more than its context_length 16"):
        Reading(32, padded=True).fit([1, 2], CTX)


def test_bad_prompts_are_refused_with_what_to_do():
    tok = glassgpt.get_tokenizer("gpt2")
    with pytest.raises(PromptError, match="empty: give some text"):
        encode(tok, "")
    with pytest.raises(PromptError, match="token id 50257 is out of range: valid ids are 0..50256"):
        check_ids([1, 50257], 50257)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = glassgpt.load_model("gpt2", config=CFG, seed=0)
    return model, str(glassgpt.save_model(model, tmp_path_factory.mktemp("tiny") / "ckpt",
                                          tokenizer=glassgpt.get_tokenizer("gpt2")))


def test_generate_json_says_what_the_model_saw_of_a_long_prompt(tiny, capsys):
    model, path = tiny
    tok = glassgpt.get_tokenizer("gpt2")
    assert main(["generate", LONG, "--model", path, "--max-new-tokens", "3", "--json"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    ids = tok.encode(LONG)
    assert got["prompt_ids"] == ids and got["seen"] == {"from": 24, "tokens": CTX}
    assert got["note"].startswith("the prompt is 40 tokens, more than the 16") and got["note"] in captured.err
    assert got["new_ids"] == glassgpt.generate(model, ids[-CTX:], 3)[0, CTX:].tolist()


def test_explain_keeps_the_last_tokens_and_says_so(tiny, capsys):
    _, path = tiny
    assert main(["explain", LONG, "--model", path, "--format", "json"]) == 0
    captured = capsys.readouterr()
    got = json.loads(captured.out)
    assert len(got["tokens"]) == CTX and got["notes"][0].endswith("it saw the last 16 (tokens 24..39)")
    assert f"note: {got['notes'][0]}" in captured.err


def test_classify_keeps_the_first_tokens_as_it_was_trained_and_says_so(tmp_path, capsys):
    clf = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(**{**CFG.to_dict(), "num_classes": 2,
                                                                   "tie_embeddings": False}), seed=0)
    path = glassgpt.save_model(clf, tmp_path / "clf", tokenizer=glassgpt.get_tokenizer("gpt2"))
    assert main(["classify", LONG, "--model", str(path), "--json"]) == 0
    captured = capsys.readouterr()
    assert "note: the prompt is 40 tokens" in captured.err and "it saw the first 16 (tokens 0..15)" in captured.err
    from glassgpt.training.tasks.classify import predict

    want = predict(clf, glassgpt.get_tokenizer("gpt2"), [" ".join(["word"] * 16)])[0]
    assert json.loads(captured.out)["prob"] == pytest.approx(float(want.max()), rel=1e-6)


def test_chat_says_what_the_model_saw(tiny, capsys):
    _, path = tiny
    assert main(["chat", LONG, "--model", path, "--max-new-tokens", "2"]) == 0
    assert "note: the prompt is" in capsys.readouterr().err
