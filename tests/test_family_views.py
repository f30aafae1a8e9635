"""diff, explain --compare and the web page for Qwen3 and Llama 3.2 (issue 35, point 3), on tiny random models
built here and saved as Hugging Face folders, offline (the folders' tokenizer is a character tokenizer)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import glassgpt
from glassgpt.cli import main
from glassgpt.errors import GlassError
from glassgpt.explain.compare import compare
from glassgpt.explain.diff import diff_weights
from glassgpt.explain.views.diff import diff_layout, diff_text
from glassgpt.families import FamilyConfig, build_model
from glassgpt.formats.families import export_family_hf

from helpers import CHAR_LLAMA as LLAMA, CHAR_QWEN as QWEN, CHAR_TEXT as TEXT, CHAR_TOK as TOK, randomize_


def model_of(cfg: FamilyConfig, seed: int = 0) -> torch.nn.Module:
    return randomize_(build_model(cfg), seed)  # norms away from 1: every tensor matters to the logits


def finetuned(model: torch.nn.Module, steps: int = 3) -> torch.nn.Module:
    """A copy after a few AdamW steps on TEXT: every tensor moves."""
    tuned = copy.deepcopy(model).train()
    tuned.tie_weights()  # deepcopy keeps the tie; said again for clarity
    opt = torch.optim.AdamW(tuned.parameters(), lr=1e-2)
    ids = torch.tensor([TOK.encode(TEXT)])
    for _ in range(steps):
        logits = tuned(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return tuned.eval()


def folder(tmp_path, name: str, model: torch.nn.Module):
    return str(export_family_hf(model, tmp_path / name))


@pytest.fixture
def char_tokenizer(monkeypatch):
    """The folders' tokenizer is TOK (tokenizer.json and tokenizer.model are tested in test_family_tokenizers.py)."""
    from glassgpt.formats import families
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: TOK)


# --- diff ----------------------------------------------------------------------------------------

def test_diff_of_two_qwen3_models_names_exactly_the_changed_tensors_by_the_books_names():
    a = model_of(QWEN)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.trf_blocks[1].att.W_query.weight.mul_(1.5)  # ||B - A|| = 0.5 ||A||
        b.trf_blocks[0].att.q_norm.scale.add_(0.1)
        b.trf_blocks[0].ff.fc3.weight.add_(0.01)
    d = diff_weights(a, b)
    assert d.family == "qwen3"
    assert set(d.moved) == {"trf_blocks.1.att.W_query.weight", "trf_blocks.0.att.q_norm.scale",
                            "trf_blocks.0.ff.fc3.weight"}
    by = {t.name: t for t in d.tensors}
    assert by["trf_blocks.1.att.W_query.weight"].rel_change == pytest.approx(0.5, rel=1e-6)
    assert "pos_emb.weight" not in by and by["trf_blocks.0.att.q_norm.scale"].group == "trf_blocks.0"
    text = diff_text(d)
    assert "(two Qwen3 models)" in text and "att.q_norm.scale" in text and "ff.fc3.weight" in text
    # the picture: a column per tensor of a Qwen3 block (q_norm and k_norm included), no pos_emb row
    cells = [r.key for r in diff_layout(d).keyed("cell:")]
    assert "cell:trf_blocks.1.att.W_query.weight:moved" in cells
    assert "cell:trf_blocks.1.att.k_norm.scale:still" in cells and "cell:trf_blocks.0.ff.fc3.weight:moved" in cells
    assert len([c for c in cells if c.startswith("cell:trf_blocks.0.")]) == 11
    assert not any("pos_emb" in c for c in cells)


def test_a_tied_head_is_told_by_storage_and_a_copied_one_is_noted():
    tied = dataclasses.replace(LLAMA, tie_embeddings=True)  # Llama 3.2 1B and 3B tie theirs
    a = model_of(tied)
    b = copy.deepcopy(a)
    with torch.no_grad():
        b.tok_emb.weight[3] += 0.1
    d = diff_weights(a, b)
    head = next(t for t in d.tensors if t.name == "out_head.weight")
    assert head.moved and head.tied_to == "tok_emb.weight" and "(= tok_emb.weight, tied)" in diff_text(d)
    # the same values in a head of its own (the book's loader copies the embedding): not a tie
    copied = build_model(LLAMA).eval()
    copied.load_state_dict(a.state_dict())
    d = diff_weights(a, copied)
    assert d.moved == [] and next(t for t in d.tensors if t.name == "out_head.weight").tied_to is None
    assert any("tok_emb.weight's own storage in A (tied) and a tensor of its own in B" in n for n in d.notes)


def test_settings_that_no_tensor_holds_are_named_when_they_differ():
    a = model_of(QWEN)
    b = build_model(dataclasses.replace(QWEN, rope_base=10_000.0)).eval()
    b.load_state_dict(a.state_dict())
    d = diff_weights(a, b)
    assert d.moved == []
    assert d.notes == ["the configs differ where no tensor shows it (rope_base 1000000.0 in A and 10000.0 in B): the "
                       "same tensors compute otherwise, so the predictions differ beyond the weights' changes"]
    assert diff_weights(a, copy.deepcopy(a)).notes == []


def test_models_of_another_family_or_shape_are_refused_in_one_line_naming_the_first_difference():
    with pytest.raises(GlassError, match=r"^A is a Qwen3 model and B is a Llama 3.2 model: diff compares two models "
                                         r"of one family and one shape"):
        diff_weights(model_of(QWEN), model_of(LLAMA))
    gpt2 = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(vocab_size=TOK.n_vocab, context_length=32,
                                                                 emb_dim=32, n_heads=4, n_layers=2))
    with pytest.raises(GlassError, match=r"^A is a GPT-2 model and B is a Qwen3 model"):
        diff_weights(gpt2, model_of(QWEN))
    with pytest.raises(GlassError, match=r"trf_blocks.0.att.W_key.weight is \[16, 32\] in A and \[32, 32\] in B: diff "
                                         r"compares models of the same config \(sizes, heads, key/value groups"):
        diff_weights(model_of(dataclasses.replace(QWEN, n_kv_groups=1)), model_of(QWEN))


def test_glassgpt_diff_of_a_qwen3_folder_and_its_finetune_lists_every_tensor_and_the_kl(tmp_path, char_tokenizer,
                                                                                          capsys):
    base = model_of(QWEN)
    a, b = folder(tmp_path, "base", base), folder(tmp_path, "tuned", finetuned(base))
    assert main(["diff", a, b, "--prompt", TEXT, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    weights, nxt = out["weights"], out["next_token"]
    assert weights["family"] == "qwen3" and weights["unmoved"] == []  # AdamW moved every tensor
    assert len(weights["moved"]) == len(base.state_dict())
    assert next(t for t in weights["tensors"] if t["name"] == "out_head.weight")["tied_to"] == "tok_emb.weight"
    assert nxt["kl_ab"] > 0 and nxt["kl_ba"] > 0 and len(nxt["a"]["lens_last"]) == QWEN.n_layers
    assert main(["diff", a, b, "--prompt", TEXT, "--format", "svg", "--out", str(tmp_path / "d.svg")]) == 0
    assert "q_norm" in (tmp_path / "d.svg").read_text()


def test_glassgpt_diff_refuses_other_kinds_and_shapes_in_one_line_before_loading(tmp_path, char_tokenizer, capsys):
    qwen, llama = folder(tmp_path, "qwen", model_of(QWEN)), folder(tmp_path, "llama", model_of(LLAMA))
    wide = folder(tmp_path, "wide", model_of(dataclasses.replace(QWEN, hidden_dim=64)))
    (tmp_path / "wide" / "model.safetensors").write_bytes(b"not read")  # refused before the weights are read
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"vocab_size": TOK.n_vocab, "context_length": 32, "emb_dim": 32, "n_heads": 4,
                                "n_layers": 2}))
    for b, words in ((llama, f"{qwen} is a Qwen3 model and {llama} is a Llama 3.2 model"),
                     (str(gpt2), f"{qwen} is a Qwen3 model and {gpt2} is a GPT-2 model"),
                     (wide, f"trf_blocks.0.ff.fc1.weight is [48, 32] in {qwen} and [64, 32] in {wide}")):
        assert main(["diff", qwen, b]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: ") and words in err[-1] and "Traceback" not in "".join(err)


# --- compare -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen3", "llama3"])
def test_compare_two_family_models_gives_their_kl_and_a_lens_that_ends_in_the_prediction(cfg):
    a = model_of(cfg)
    same = compare(a, a, TOK, TEXT)
    assert same.kl_ab == pytest.approx(0.0, abs=1e-12) and same.kl_ba == pytest.approx(0.0, abs=1e-12)
    b = finetuned(a)
    c = compare(a, b, TOK, TEXT, top_k=5)
    assert c.kl_ab > 0 and c.kl_ba > 0 and c.tokens_b is None
    with torch.no_grad():
        probs = [m(torch.tensor([TOK.encode(TEXT)]))[0, -1].softmax(-1) for m in (a, b)]
    for side, p, q in ((c.a, probs[0], probs[1]), (c.b, probs[1], probs[0])):
        top = side["top"][0]
        assert top["id"] == int(p.argmax()) and top["prob"] == pytest.approx(float(p.max()), rel=1e-5)
        assert top["other_prob"] == pytest.approx(float(q[top["id"]]), rel=1e-5)
        # the lens after the last block goes through final_norm and out_head: the model's own prediction
        assert len(side["lens_last"]) == cfg.n_layers
        assert side["lens_last"][-1]["id"] == top["id"]
        assert side["lens_last"][-1]["prob"] == pytest.approx(top["prob"], rel=1e-5)
        assert side["head_top"]["logit"] == pytest.approx(side["head_top"]["dot"], rel=1e-5)


def test_compare_with_a_gpt2_reads_the_text_with_each_models_own_tokenizer_and_says_so():
    gpt2 = glassgpt.load_model("gpt2", config=glassgpt.GPTConfig(vocab_size=50257, context_length=32, emb_dim=16,
                                                                 n_heads=2, n_layers=3))
    c = compare(gpt2, model_of(QWEN), glassgpt.get_tokenizer("gpt2"), TEXT, tokenizer_b=TOK)
    assert c.kl_ab is None and c.kl_ba is None
    assert [t["text"] for t in c.tokens_b] == list(TEXT) and len(c.tokens) < len(TEXT)  # GPT-2 reads whole words
    assert any(n.startswith("each model reads the text with its own tokenizer (A: gpt2") for n in c.notes)
    assert all(t["other_prob"] is None for t in c.a["top"] + c.b["top"])
    assert len(c.a["lens_last"]) == 3 and len(c.b["lens_last"]) == 2
    text = c.to_text()
    assert f"B reads {len(TEXT)} tokens" in text and "trf_blocks.2   A" in text and "B (no such block)" in text


def test_explain_compare_of_two_family_folders_sets_them_side_by_side(tmp_path, char_tokenizer, capsys):
    base = model_of(LLAMA)
    a, b = folder(tmp_path, "a", base), folder(tmp_path, "b", finetuned(base))
    assert main(["explain", TEXT, "--model", a, "--compare", b]) == 0
    out = capsys.readouterr().out
    assert f"the next token of A = {a} and B = {b}" in out and "KL(A || B) = " in out
    assert "logit lens at the last position" in out and "own tokenizer" not in out
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"vocab_size": 50257, "context_length": 32, "emb_dim": 16, "n_heads": 2,
                                "n_layers": 2}))
    assert main(["explain", TEXT, "--model", str(gpt2), "--compare", a, "--format", "json"]) == 0
    c = json.loads(capsys.readouterr().out)
    assert c["kl_ab"] is None and len(c["tokens_b"]) == len(TEXT) and "llama3" in c["b"]["layout"]
    assert main(["explain", TEXT, "--model", a, "--compare", str(gpt2)]) == 0  # a family's --compare gpt2:
    assert "what changed from GPT-2 to Llama 3" in capsys.readouterr().out   # the stage-by-stage changes


# --- the page's API ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def family_client():
    from fastapi.testclient import TestClient
    from glassgpt.formats import About
    from glassgpt.web import create_app
    app = create_app(model_of(QWEN), TOK, About("qwen3-tiny"))
    with TestClient(app, base_url="http://127.0.0.1") as client:  # as a browser on this machine addresses it
        yield client


def test_the_page_gets_the_family_trace_and_only_the_options_that_apply(family_client):
    info = family_client.get("/api/model").json()
    assert info["family"] == "qwen3" and info["params"]["tied"]
    assert info["layout"].startswith("qwen3: vocab_size")
    assert [c["name"] for c in info["controls"]["trace"]] == ["top_k", "logit_lens", "attention"]  # the last two: panels
    assert [c["name"] for c in info["controls"]["why"]] == ["why", "versus", "patch"]
    r = family_client.post("/api/explain", json={"prompt": TEXT, "top_k": 3})
    assert r.status_code == 200, r.text
    tr = r.json()
    f = tr["family"]
    assert f["answers"]["tied"] and f["answers"]["one_hot"]["equal_one_hot_matmul"]
    assert f["attention"]["q_shape"] == [1, 4, len(TEXT), 16] and f["attention"]["kv_shape"] == [1, 2, len(TEXT), 16]
    assert f["attention"]["groups"] == [[0, 1], [2, 3]] and f["attention"]["qk_norm"]
    assert [t["id"] for t in tr["tokens"]] == TOK.encode(TEXT) and len(tr["next_token"]["top"]) == 3
    assert "not_shown" not in tr and "attention" not in tr and "logit_lens" not in tr  # only what was asked for
    assert tr["head"]["rows"][0]["id"] == tr["next_token"]["id"] and tr["head"]["tied"]


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen3", "llama3"])
def test_the_pages_head_lens_and_heatmaps_of_a_family_model_are_its_own(cfg, monkeypatch):
    """What the page's three panels draw, under the names GPT-2's answer gives them, from the family model itself."""
    from fastapi.testclient import TestClient
    from glassgpt.formats import About
    from glassgpt.web import create_app
    model = model_of(cfg)
    ids = torch.tensor([TOK.encode(TEXT)])
    with torch.no_grad():
        logits = model(ids)[0].float()  # [t, V]
    with TestClient(create_app(model, TOK, About("tiny")), base_url="http://127.0.0.1") as client:
        tr = client.post("/api/explain", json={"prompt": TEXT, "top_k": 3, "attention": True, "logit_lens": True}).json()
        from glassgpt.web import service
        monkeypatch.setattr(service, "MAX_ATTENTION_WEIGHTS", cfg.n_layers * cfg.n_heads * 10 ** 2)  # 10 tokens fit
        fits = client.post("/api/explain", json={"prompt": TEXT[:10], "attention": True}).json()["attention"]
        left_out = client.post("/api/explain", json={"prompt": TEXT[:11], "attention": True}).json()["attention"]
    t, g = len(TEXT), cfg.n_heads // cfg.n_kv_groups
    att = tr["attention"]
    assert att["shape"] == [cfg.n_layers, cfg.n_heads, t, t] and att["tokens"] == list(TEXT)
    assert att["groups"] == [j // g for j in range(cfg.n_heads)]
    for layer in att["layers"]:  # causal rows that sum to 1 (rounded to 4 decimals for the page)
        for head in layer:
            assert all(abs(sum(row) - 1) < 1e-3 and not any(row[j + 1:]) for j, row in enumerate(head))
    assert "layers" not in tr["family"]["attention"] and "head" not in tr["family"]  # each thing once in the JSON
    assert [p["id"] for p in tr["logit_lens"]["layers"][-1]["top"]] == logits.argmax(-1).tolist()
    assert [r["id"] for r in tr["head"]["rows"]] == [t_["id"] for t_ in tr["next_token"]["top"]]
    assert tr["head"]["rows"][0]["logit"] == pytest.approx(float(logits[-1].max()), abs=1e-6)
    assert tr["head"]["tied"] == model.tied
    assert fits["shape"][-1] == 10 and set(left_out) == {"omitted"}  # as GPT-2's: said in one line
    assert left_out["omitted"].startswith(f"11 tokens give {cfg.n_layers * cfg.n_heads * 121:,} attention weights")


def test_the_pages_append_why_and_picture_work_on_a_family_model(family_client):
    ids = TOK.encode(TEXT)
    appended = family_client.post("/api/append", json={"ids": ids, "token": 5}).json()
    assert [t["id"] for t in appended["tokens"]] == ids + [5]
    w = family_client.post("/api/why", json={"ids": ids, "target": 7}).json()
    assert w["family"] == "qwen3" and w["target"]["id"] == 7
    assert sum(p["value"] for p in w["parts"]) == pytest.approx(w["target"]["logit"], abs=1e-4)
    assert len(w["heads"]) == 2 and w["groups"] == [0, 0, 1, 1] and len(w["sources"]) == len(ids)
    with_why = family_client.post("/api/explain", json={"ids": ids, "why": True}).json()
    assert with_why["why"]["target"]["id"] == with_why["next_token"]["id"]
    versus = family_client.post("/api/why", json={"ids": ids, "target": 7, "versus": "e"}).json()
    assert versus["versus"]["id"] == TOK.encode("e")[0]
    assert versus["metric"] == pytest.approx(versus["target"]["logit"] - versus["versus"]["logit"], abs=1e-4)
    svg = family_client.post("/api/diagram.svg", json={"prompt": TEXT})
    assert svg.status_code == 200 and svg.text.startswith("<svg") and "kv1" in svg.text
    lines = [json.loads(x) for x in family_client.post("/api/explain", json={"prompt": TEXT},
                                                        headers={"accept": "application/x-ndjson"}).text.splitlines()]
    assert lines[-1]["trace"]["family"]["family"] == "qwen3"


def test_the_page_of_a_llama_model_has_its_groups_its_scaled_rope_and_its_why():
    from fastapi.testclient import TestClient
    from glassgpt.formats import About
    from glassgpt.web import create_app
    with TestClient(create_app(model_of(LLAMA), TOK, About("llama-tiny")), base_url="http://127.0.0.1") as client:
        tr = client.post("/api/explain", json={"prompt": TEXT, "why": True}).json()
    att = tr["family"]["attention"]
    assert att["rope_scaled"] and not att["qk_norm"] and att["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not tr["family"]["answers"]["tied"]  # Llama's head here is its own tensor
    assert tr["why"]["groups"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sum(p["value"] for p in tr["why"]["parts"]) == pytest.approx(tr["why"]["metric"], abs=1e-4)
