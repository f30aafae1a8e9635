"""The panels GPT-2's trace has beside its flow, for Qwen3 and Llama 3.2 (explain/family.py, issue 35 point 3):
every query head's attention weights, the logit lens through the model's own RMSNorm and out_head, and the head's
logits as dot products; computed from the family model itself and checked against transformers and the model's
own output, on tiny random models built here, offline."""

from __future__ import annotations

import json

import pytest
import torch

from glassgpt.cli import main
from glassgpt.explain.trace import family_trace
from glassgpt.families import build_model
from glassgpt.formats.families import export_family_hf
from glassgpt.prompt import encode

from helpers import CHAR_LLAMA as LLAMA, CHAR_QWEN as QWEN, CHAR_TEXT as TEXT, CHAR_TOK as TOK, randomize_

CONFIGS = {"qwen3": QWEN, "llama3": LLAMA}  # Qwen3 tied, with QK-norm; Llama untied, with scaled RoPE, 4 per group


def model_of(family: str) -> torch.nn.Module:
    return randomize_(build_model(CONFIGS[family])).eval()  # norms away from 1: QK-norm and RMSNorm matter


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_every_query_heads_weights_are_transformers_eager_attentions(family, tmp_path):
    from transformers import AutoModelForCausalLM
    model = model_of(family)
    export_family_hf(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tr = family_trace(model, TOK, TEXT, attention=True)
    with torch.no_grad():
        out = hf(torch.tensor([encode(TOK, TEXT)]), output_attentions=True)
    cfg, t = model.cfg, len(TEXT)
    att = tr.attention_weights
    assert att["shape"] == [cfg.n_layers, cfg.n_heads, t, t] and att["tokens"] == list(TEXT)
    assert att["groups"] == [j // cfg.group_size for j in range(cfg.n_heads)]
    for i, theirs in enumerate(out.attentions):  # [1, h, t, t] per layer
        torch.testing.assert_close(torch.tensor(att["layers"][i]), theirs[0], atol=1e-5, rtol=0)
    assert tr.logit_lens is None  # only what was asked for


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_lens_after_the_last_block_is_the_models_own_prediction_and_earlier_ones_go_through_its_rmsnorm(family):
    model = model_of(family)
    tr = family_trace(model, TOK, TEXT, logit_lens=True)
    ids = torch.tensor([encode(TOK, TEXT)])
    outputs = []
    handles = [b.register_forward_hook(lambda m, i, o: outputs.append(o)) for b in model.trf_blocks]
    with torch.no_grad():
        logits = model(ids)[0].float()  # [t, V]
        for h in handles:
            h.remove()
        first = model.out_head(model.final_norm(outputs[0]))[0].float()  # block 0's residual, RMSNorm, out_head
    layers = tr.logit_lens["layers"]
    assert [layer["layer"] for layer in layers] == list(range(model.cfg.n_layers))
    last = layers[-1]["top"]
    assert [p["id"] for p in last] == logits.argmax(-1).tolist()
    # the same numbers as the model's softmax, to float32 rounding (the lens takes exp(max - logsumexp))
    assert [p["prob"] for p in last] == pytest.approx(logits.softmax(-1).max(-1).values.tolist(), rel=1e-6)
    assert last[-1]["id"] == tr.next_tokens[0]["id"]
    assert [p["id"] for p in layers[0]["top"]] == first.argmax(-1).tolist()
    assert [p["id"] for p in layers[0]["top"]] != [p["id"] for p in last]  # a lens that only copied would pass


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_the_heads_dot_products_are_the_logits_from_the_rmsnormed_last_vector(family):
    model = model_of(family)
    tr = family_trace(model, TOK, TEXT, top_k=3)
    ids = torch.tensor([encode(TOK, TEXT)])
    with torch.no_grad():
        logits = model(ids)[0, -1]
        x = {}
        model.trf_blocks[-1].register_forward_hook(lambda m, i, o: x.__setitem__("last", o[0, -1]))
        model(ids)
        h = model.final_norm(x["last"])  # RMSNorm: x * weight / rms
    hd = tr.head
    assert [r["id"] for r in hd["rows"]] == [t["id"] for t in tr.next_tokens]
    assert hd["h_norm"] == pytest.approx(float(h.norm()), rel=1e-6)
    for r in hd["rows"]:
        with torch.no_grad():
            assert r["dot"] == pytest.approx(float(model.out_head.weight[r["id"]] @ h), abs=1e-5)
        assert r["logit"] == float(logits[r["id"]])
    assert hd["max_abs_diff"] < 1e-5 and hd["family"] == family and not hd["has_bias"]
    assert hd["tied"] == (family == "qwen3")
    if family == "llama3":  # untied: each top token's two rows and their cosine, and no word of GPT-2's layout
        assert "cos_emb_head" in hd["rows"][0] and "book's layout" not in hd["tying_note"]
    else:
        assert hd["tying_note"].startswith("tied: W is tok_emb.weight (one storage)")


@pytest.fixture
def char_tokenizer(monkeypatch):
    from glassgpt.formats import families
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: TOK)


def test_explain_of_a_family_folder_gives_the_panels_in_json_text_and_a_heatmap_png(tmp_path, char_tokenizer, capsys):
    folder = str(export_family_hf(model_of("llama3"), tmp_path / "llama"))
    out = tmp_path / "trace.json"
    assert main(["explain", TEXT, "--model", folder, "--format", "json", "--logit-lens", "--attention",
                 "--attention-out", str(tmp_path / "heat.png"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["attention_weights"]["shape"] == [2, 8, len(TEXT), len(TEXT)]
    assert len(data["logit_lens"]["layers"]) == 2 and data["head"]["rows"][0]["id"] == data["next_tokens"][0]["id"]
    assert (tmp_path / "heat.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    assert main(["explain", TEXT, "--model", folder, "--logit-lens", "--attention", "--layer", "1",
                 "--attention-out", str(tmp_path / "heat1.png")]) == 0
    text = capsys.readouterr().out
    assert "each logit is a dot product" in text and "logit lens: the top token" in text
    assert "attention in trf_blocks.1" in text and "head 7 kv1" in text


def test_the_family_notebook_cell_and_picture_carry_the_dot_products():
    tr = family_trace(model_of("qwen3"), TOK, TEXT, logit_lens=True)
    html = tr._repr_html_()
    assert "each logit is a dot product" in html and "logit lens: the top token" in html
