"""The pieces, seen: explain --windows prints a text's windows with their inputs, targets, stride and
overlap; glassgpt.show(piece, input) draws a checked piece (the reader's attention weights beside
glassgpt's, the reader's windows beside the book's)."""

from __future__ import annotations

import json

import torch

import glassgpt
from glassgpt.cli import main
from glassgpt.explain.pieces import build
from glassgpt.explain.pieces.data import BOOK_TEXT
from llms_from_scratch import ch02, ch03

from helpers import MaskDiagonal, StrideSkips, named


def test_windows_overlap_by_max_length_minus_stride_and_targets_are_one_token_later():
    w = glassgpt.explain.sliding_windows(BOOK_TEXT, max_length=4, stride=2)
    assert w.overlap == 2
    assert all(x[2:] == nxt[:2] for x, nxt in zip(w.inputs, w.inputs[1:]))
    assert all(y == w.ids[2 * k + 1:2 * k + 5] for k, y in enumerate(w.targets))
    assert len(w.inputs) == len(range(0, len(w.ids) - 4, 2))


def test_explain_windows_prints_inputs_targets_stride_and_overlap(capsys):
    assert main(["explain", "--windows", BOOK_TEXT, "--window-length", "4", "--stride", "6"]) == 0
    out = capsys.readouterr().out
    assert "max_length 4, stride 6" in out and "2 tokens between windows are in no input" in out
    assert "window 1: tokens 6..9" in out and "  targets [" in out
    assert main(["explain", "--windows", BOOK_TEXT, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["stride"] == data["max_length"] == 4 and data["overlap"] == 0


def test_a_text_too_short_for_one_window_is_one_line(capsys):
    assert main(["explain", "--windows", "Every effort moves you"]) == 2
    err = capsys.readouterr().err
    assert "the text is 4 tokens: a window needs max_length + 1 = 5" in err and err.count("\n") == 1


def test_show_draws_the_readers_attention_weights_beside_glassgpts_with_the_nan_row_in_red():
    att = build(named(MaskDiagonal, "CausalAttention"))
    result = glassgpt.show(att, torch.rand(1, 5, 3))
    html = result._repr_html_()
    assert "<svg" in html and "yours" in html and "glassgpt&#x27;s" in html
    assert "row 0 of the attention weights is NaN" in html
    assert html.count('fill="#b91c1c"') >= 5  # row 0 of yours: five NaN cells drawn red


def test_show_of_a_dataset_class_and_a_text_draws_its_windows_beside_the_books():
    result = glassgpt.show(type("GPTDatasetV1", (StrideSkips,), {}), BOOK_TEXT)
    assert result.mistake == "stride_skips"
    html = result._repr_html_()
    assert "<svg" in html and "blue: inputs; orange: targets" in html and "window 1" in html
    assert glassgpt.show(ch02.GPTDatasetV1, BOOK_TEXT).ok


def test_show_of_a_whole_model_is_still_its_trace():
    from readers import book_model
    tr = glassgpt.show(book_model(), "Every effort moves you")
    assert isinstance(tr, glassgpt.Trace) and "<svg" in tr._repr_html_()


def test_show_of_the_books_attention_matches_and_says_so():
    html = glassgpt.show(ch03.MultiHeadAttention)._repr_html_()
    assert "matches glassgpt&#x27;s attention formula" in html


def test_the_api_answers_a_texts_windows_and_refuses_a_text_too_short_in_one_line():
    from fastapi.testclient import TestClient
    from glassgpt.formats import random_model
    from glassgpt.web import create_app
    cfg = glassgpt.GPTConfig(vocab_size=50257, context_length=16, emb_dim=8, n_heads=2, n_layers=1)
    app = create_app(random_model(cfg, torch.device("cpu"), torch.float32, seed=0), glassgpt.get_tokenizer("gpt2"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        answer = client.post("/api/windows", json={"prompt": BOOK_TEXT, "max_length": 4, "stride": 3})
        assert answer.status_code == 200
        w = answer.json()
        assert w["overlap"] == 1 and w["inputs"][1] == w["ids"][3:7] and w["targets"][1] == w["ids"][4:8]
        short = client.post("/api/windows", json={"prompt": "Every effort", "max_length": 4})
        assert short.status_code == 400 and "a window needs max_length + 1 = 5" in short.json()["error"]
