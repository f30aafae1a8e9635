"""explain for Qwen3 and Llama 3.2 (explain/family.py): the four answers, positions, heads and groups, from the live model."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import llms_from_scratch.qwen3 as book_qwen
from glassgpt.explain.trace import family_trace
from glassgpt.families import FamilyConfig, build_model
from glassgpt.formats.families import export_family_hf, hf_names

from helpers import CHAR_LLAMA as LLAMA, CHAR_QWEN as QWEN, CHAR_TEXT as TEXT, CHAR_TOK as TOK


def model_of(cfg: FamilyConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(cfg).eval()


def test_the_four_answers_name_this_models_widths_and_the_one_hot_proof_holds():
    tr = family_trace(model_of(QWEN), TOK, TEXT)
    text = tr.to_text()
    V, t = TOK.n_vocab, len(TEXT)
    assert f"1. Where does {V} become 32?  At tok_emb: ids -> [1, {t}, 32], a lookup in the [{V}, 32] weight" in text
    assert f"2. Where does 32 become {V}?  At out_head: -> logits [1, {t}, {V}]" in text
    assert tr.answers["one_hot"]["equal_one_hot_matmul"] and "are identical here" in text
    assert "share their storage (the same data_ptr)" in text


def test_the_tie_is_told_by_storage_not_by_equal_values():
    # the book's load_weights_into_qwen copies the embedding into the head: equal values, two tensors
    cfg = dataclasses.replace(QWEN, tie_embeddings=False)
    source = model_of(cfg)
    params = {hf: source.state_dict()[b] for b, hf in hf_names(dataclasses.replace(cfg, tie_embeddings=True))}
    book = book_qwen.Qwen3Model(cfg.to_book_dict(torch.float32))
    book_qwen.load_weights_into_qwen(book, cfg.to_book_dict(torch.float32), params)
    ours = build_model(cfg).eval()
    ours.load_state_dict(book.state_dict())
    assert torch.equal(ours.out_head.weight, ours.tok_emb.weight)
    tr = family_trace(ours, TOK, TEXT)
    assert not tr.answers["tied"] and tr.answers["equal_values"]
    assert "two tensors with equal values: a copy, not a tie" in tr.to_text()
    assert "two separate tensors (untied)" in family_trace(model_of(cfg), TOK, TEXT).to_text()


def test_positions_enter_as_rope_and_the_heads_show_the_group_sharing():
    tr = family_trace(model_of(LLAMA), TOK, TEXT)
    t = len(TEXT)
    assert tr.attention["q_shape"] == [1, 8, t, 4] and tr.attention["kv_shape"] == [1, 2, t, 4]
    assert tr.attention["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    text = tr.to_text()
    assert "No pos_emb" in text and "with Llama 3's frequency scaling" in text and "QK-norm" not in text
    assert "kv0: q0..q3  kv1: q4..q7" in text
    assert "QK-norm: each query and key head is RMS-normed before the rotation" in family_trace(
        model_of(QWEN), TOK, TEXT).to_text()


def run_explain(monkeypatch, capsys, *argv: str) -> str:
    """`glassgpt explain ...` in-process, the folder's tokenizer being TOK (any tokenizer serves the view)."""
    from glassgpt.cli import main
    from glassgpt.formats import families
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: TOK)
    assert main(["explain", *argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_glassgpt_explain_runs_on_a_qwen3_folder(tmp_path, monkeypatch, capsys):
    export_family_hf(model_of(QWEN), tmp_path)
    out = json.loads(run_explain(monkeypatch, capsys, TEXT, "--model", str(tmp_path), "--format", "json"))
    assert out["family"] == "qwen3" and out["answers"]["tied"] and out["attention"]["group_size"] == 2


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen3", "llama3"])
def test_what_changed_from_gpt2_accounts_for_every_parameter_of_both_live_models(cfg):
    import glassgpt
    from glassgpt.config import GPTConfig
    from glassgpt.explain.trace import changes_from_gpt2
    gpt2 = glassgpt.load_model("gpt2", config=GPTConfig(vocab_size=TOK.n_vocab, context_length=32, emb_dim=24,
                                                        n_heads=3, n_layers=3))
    model = model_of(cfg)
    rows = changes_from_gpt2(model, gpt2).rows
    assert [r["change"] for r in rows] == ["LayerNorm -> RMSNorm", "GELU -> SwiGLU", "pos_emb -> RoPE",
                                           "multi-head -> grouped-query attention", "QK-norm", "the head", "total"]
    for side, m in (("gpt2", gpt2), ("family", model)):
        parts = sum(r[f"{side}_params"] for r in rows[:-1])
        assert parts + m.tok_emb.weight.numel() == rows[-1][f"{side}_params"] == sum(p.numel() for p in m.parameters())
    by = {r["change"]: r for r in rows}
    assert by["pos_emb -> RoPE"]["gpt2_params"] == 32 * 24 and by["pos_emb -> RoPE"]["family_params"] == 0
    assert by["LayerNorm -> RMSNorm"]["gpt2_params"] == (2 * 3 + 1) * 2 * 24
    assert by["LayerNorm -> RMSNorm"]["family_params"] == (2 * 2 + 1) * 32
    assert by["QK-norm"]["family_params"] == (2 * 2 * 16 if cfg.qk_norm else 0)
    assert "W_key [32, 32]" in by["multi-head -> grouped-query attention"]["family"] if cfg is QWEN else \
        "W_key [8, 32]" in by["multi-head -> grouped-query attention"]["family"]


def test_glassgpt_explain_compare_gpt2_prints_the_changes(tmp_path, monkeypatch, capsys):
    export_family_hf(model_of(LLAMA), tmp_path / "llama")
    (tmp_path / "gpt2.json").write_text(json.dumps({"vocab_size": TOK.n_vocab, "context_length": 32, "emb_dim": 24,
                                                    "n_heads": 3, "n_layers": 3}))
    out = run_explain(monkeypatch, capsys, "hi", "--model", str(tmp_path / "llama"), "--compare",
                      str(tmp_path / "gpt2.json"))
    assert "what changed from GPT-2 to Llama 3" in out
    assert "no weights: cos/sin tables [32, 4] rotate q and k inside every attention" in out


def test_a_family_trace_and_a_port_check_show_in_a_notebook_cell():
    import glassgpt
    tr = family_trace(model_of(QWEN), TOK, TEXT)
    cell = tr._repr_html_()
    assert cell.startswith("<svg") and "<pre>" in cell and "the four questions" in cell
    assert "&#x27;" in cell  # the text's quotes escaped
    result = glassgpt.check(book_qwen.Qwen3Model(QWEN.to_book_dict(torch.float32)))
    assert result.ok and "tok_emb" in result._repr_html_()


def test_the_picture_draws_every_stage_and_each_key_value_group(tmp_path, monkeypatch, capsys):
    tr = family_trace(model_of(LLAMA), TOK, TEXT)
    d = tr.picture()
    assert [r.key for r in d.keyed("stage:")] == [f"stage:{s['name']}" for s in tr.stages]
    assert len(d.keyed("kv:")) == LLAMA.n_kv_groups
    export_family_hf(model_of(LLAMA), tmp_path / "llama")
    run_explain(monkeypatch, capsys, TEXT, "--model", str(tmp_path / "llama"), "--format", "svg", "--out",
                str(tmp_path / "flow.svg"))
    svg = (tmp_path / "flow.svg").read_text()
    assert svg.startswith("<svg") and "repeat_interleave" in svg and "kv1" in svg
