"""glassgpt.trace on a model whose positions enter inside the attention (RoPE: Qwen3, Llama 3.2) reads every
option GPT-2's trace reads: about, cancel, progress, block, embedding_check and temperature (issue 47)."""

from __future__ import annotations

import threading

import pytest
import torch

from glassgpt.errors import PromptError, TraceCancelled
from glassgpt.explain.options import TraceOptions
from glassgpt.explain.trace import trace, trace_with_logits
from glassgpt.families import build_model
from glassgpt.formats.source import About

from helpers import CHAR_LLAMA as LLAMA, CHAR_QWEN as QWEN, CHAR_TEXT as TEXT, CHAR_TOK as TOK


def model_of(cfg):
    torch.manual_seed(0)
    return build_model(cfg).eval()


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen3", "llama3"])
def test_a_set_cancel_event_stops_the_rotary_trace(cfg):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TraceCancelled):
        trace(model_of(cfg), TOK, TEXT, cancel=cancel)


def test_progress_reports_each_block_the_lens_and_the_embedding_check_in_order():
    model, steps = model_of(QWEN), []
    trace(model, TOK, TEXT, options=TraceOptions(logit_lens=True), progress=lambda *step: steps.append(step))
    n = model.cfg.n_layers
    assert [s[0] for s in steps[:n]] == [f"trf_blocks.{i}" for i in range(n)]
    assert steps[-1] == ("embedding_check", 2 * n + 1, 2 * n + 1)
    assert [s[1] for s in steps] == list(range(1, 2 * n + 2))


def test_the_probabilities_are_the_softmax_of_the_last_logits_over_the_temperature():
    model = model_of(QWEN)
    tr, last = trace_with_logits(model, TOK, TEXT, options=TraceOptions(temperature=0.25, top_k=3))
    expected = torch.softmax(last.float() / 0.25, dim=-1).topk(3)
    assert [t["id"] for t in tr.next_tokens] == expected.indices.tolist()
    torch.testing.assert_close(torch.tensor([t["prob"] for t in tr.next_tokens]), expected.values)
    assert tr.temperature == 0.25 and "softmax(last_logits / 0.25)" in tr.to_text()


def test_a_temperature_that_is_not_positive_is_refused_in_one_line():
    with pytest.raises(PromptError, match="temperature must be a positive number"):
        trace(model_of(QWEN), TOK, TEXT, options=TraceOptions(temperature=0.0))


def test_embedding_check_off_skips_the_one_hot_proof_and_says_so():
    tr = trace(model_of(QWEN), TOK, TEXT, options=TraceOptions(embedding_check=False))
    assert tr.answers["one_hot"] is None
    assert "not checked on this prompt (embedding_check is off)" in tr.to_text()
    assert trace(model_of(QWEN), TOK, TEXT).answers["one_hot"]["equal_one_hot_matmul"] is True


def test_the_block_option_reads_the_stages_shapes_in_that_block_and_a_missing_block_is_refused():
    model = model_of(LLAMA)
    tr = trace(model, TOK, TEXT, options=TraceOptions(block=1))
    assert tr.block == 1 and "read in trf_blocks.1 (--block 1)" in tr.to_text()
    with pytest.raises(PromptError, match="block 9 does not exist"):
        trace(model, TOK, TEXT, options=TraceOptions(block=9))


def test_about_names_the_model_and_warns_of_random_weights():
    tr = trace(model_of(QWEN), TOK, TEXT, about=About(name="my-qwen", random_weights=True, notes=("n_heads assumed",)))
    text = tr.to_text()
    assert tr.about["name"] == "my-qwen" and "model my-qwen" in text
    assert "RANDOM WEIGHTS" in text and "n_heads assumed" in text


def test_glassgpt_explain_of_a_family_folder_reads_block_and_temperature(tmp_path, monkeypatch, capsys):
    import json

    from glassgpt.cli import main
    from glassgpt.formats import families
    from glassgpt.formats.families import export_family_hf
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: TOK)
    folder = str(export_family_hf(model_of(QWEN), tmp_path / "qwen"))
    out = tmp_path / "trace.json"
    assert main(["explain", TEXT, "--model", folder, "--block", "1", "--temperature", "0.5", "--format", "json",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["block"] == 1 and data["temperature"] == 0.5
    assert data["answers"]["one_hot"]["equal_one_hot_matmul"] is True  # the third answer, always checked here
