"""why for Qwen3 and Llama 3.2 (explain/family.py: why_family): the logit as an exact sum of parts through RMSNorm."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import glassgpt
from glassgpt.errors import GlassError
from glassgpt.explain.family import FamilyWhy
from glassgpt.families import build_model
from glassgpt.formats.families import export_family_hf
from glassgpt.prompt import encode
from glassgpt.tokenizer import CharTokenizer
from helpers import TINY, randomize_

TEXT = "every effort moves you"
TOK = CharTokenizer.from_text(TEXT + " abcdefghijklmnopqrstuvwxyz")
# Qwen3 tied (and QK-norm), Llama untied (and Llama 3's frequency scaling)
CONFIGS = {"qwen3": dataclasses.replace(TINY["qwen3"], tie_embeddings=True),
           "llama3": dataclasses.replace(TINY["llama3"], tie_embeddings=False)}


def model_of(family: str) -> torch.nn.Module:
    return randomize_(build_model(CONFIGS[family]))


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_parts_sum_to_the_models_logit_one_term_per_query_head(family):
    model = model_of(family)
    assert model.tied == (family == "qwen3") and (model.cfg.rope_freq is not None) == (family == "llama3")
    w = glassgpt.why(model, TOK, TEXT)
    assert isinstance(w, FamilyWhy)
    cfg = model.cfg
    with torch.no_grad():
        logits = model(torch.tensor([encode(TOK, TEXT)]))[0, -1]
    assert w.target["id"] == int(logits.argmax())
    assert abs(w.target["logit"] - float(logits[w.target["id"]])) == 0
    assert abs(w.total - w.target["logit"]) < 1e-5
    assert len(w.heads) == cfg.n_layers and all(len(row) == cfg.n_heads for row in w.heads)
    assert w.groups == [j // (cfg.n_heads // cfg.n_kv_groups) for j in range(cfg.n_heads)] == [0, 0, 1, 1]
    assert len(w.parts) == 1 + cfg.n_layers * (cfg.n_heads + 1)
    # another target's logit splits as exactly
    other = glassgpt.why(model, TOK, TEXT, target=3)
    assert abs(other.total - float(logits[3])) < 1e-5


def test_a_head_term_is_what_zeroing_that_heads_slice_of_out_proj_removes_at_frozen_rms():
    """The head's term is its own: zero its slice of out_proj and the attention's output loses exactly that vector."""
    model = model_of("llama3")
    w = glassgpt.why(model, TOK, TEXT)
    hd = model.cfg.head_dim_value
    seen = {}
    model.trf_blocks[1].att.register_forward_hook(lambda m, i, o: seen.__setitem__("x", o[0, -1].clone()))
    ids = torch.tensor([encode(TOK, TEXT)])
    with torch.no_grad():
        model(ids)
        before = seen["x"]
        model.trf_blocks[1].att.out_proj.weight[:, 2 * hd:3 * hd] = 0
        model(ids)
        removed = before - seen["x"]
        direction = model.out_head.weight[w.target["id"]] * model.final_norm.weight / w.rms
    assert abs(float(removed @ direction) - w.heads[1][2]) < 1e-5


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_logit_the_parts_sum_to_is_transformers_logit(family, tmp_path):
    from transformers import AutoModelForCausalLM
    model = model_of(family)
    export_family_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    w = glassgpt.why(model, TOK, TEXT)
    with torch.no_grad():
        hf_logit = float(hf(torch.tensor([encode(TOK, TEXT)])).logits[0, -1, w.target["id"]])
    assert abs(w.total - hf_logit) < 1e-4


def test_the_text_shows_the_sum_the_top_parts_and_the_heads_grid_with_groups():
    text = glassgpt.why(model_of("qwen3"), TOK, TEXT).to_text()
    assert "= sum of 11 parts" in text and "final_norm's 1/rms frozen" in text
    assert "(read key/value group 1)" in text or "(read key/value group 0)" in text
    assert "h0 g0" in text and "h3 g1" in text and "no pos_emb" in text


def test_versus_and_a_target_outside_the_vocabulary_are_refused_for_a_family_model_in_one_line():
    with pytest.raises(GlassError, match="drop versus, patch"):
        glassgpt.why(model_of("qwen3"), TOK, TEXT, versus="e")
    with pytest.raises(GlassError, match="not a row of out_head: give an id from 0 to 96"):
        glassgpt.why(model_of("qwen3"), TOK, TEXT, target=97)


def test_glassgpt_explain_why_prints_the_attribution_of_a_family_folder(tmp_path, monkeypatch, capsys):
    from glassgpt.cli import main
    from glassgpt.formats import families
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: TOK)  # any tokenizer serves the view
    export_family_hf(model_of("llama3"), tmp_path)
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "Llama 3: why" in out and "= sum of 11 parts" in out and "h3 g1" in out
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)["why"]
    assert abs(sum(p["value"] for p in data["parts"]) - data["target"]["logit"]) < 1e-5
    assert main(["explain", "--why", "--model", str(tmp_path), TEXT, "--versus", "e"]) == 2
    assert "without --versus or --patch: drop them" in capsys.readouterr().err
