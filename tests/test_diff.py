"""glassgpt diff: every tensor's relative change, exactly the tensors a finetune trained, and one line for
models of other shapes."""

from __future__ import annotations

import csv
import json
import xml.etree.ElementTree as ET

import pytest
import torch

import glassgpt
from glassgpt.cli import main
from glassgpt.errors import GlassError
from glassgpt.explain.diff import diff_weights
from glassgpt.explain.views.diff import diff_text
from glassgpt.formats import random_model

CFG = glassgpt.GPTConfig(vocab_size=50257, context_length=32, emb_dim=16, n_heads=2, n_layers=3)


def model(seed: int = 0, **changes):
    import dataclasses

    return random_model(dataclasses.replace(CFG, **changes), torch.device("cpu"), torch.float32, seed=seed)


def test_the_relative_change_of_each_tensor_is_the_norm_of_the_difference_over_the_norm():
    a = model()
    b = model()
    with torch.no_grad():
        b.trf_blocks[1].att.W_query.weight.mul_(1.5)  # ||B - A|| = 0.5 ||A||
        b.pos_emb.weight[3, 0] += 1.0
    d = diff_weights(a, b)
    changes = {t.name: t for t in d.tensors}
    assert changes["trf_blocks.1.att.W_query.weight"].rel_change == pytest.approx(0.5, rel=1e-6)
    pos = changes["pos_emb.weight"]
    assert pos.rel_change == pytest.approx(1.0 / float(a.pos_emb.weight.detach().norm()), rel=1e-5) and pos.max_abs == 1.0
    assert set(d.moved) == {"pos_emb.weight", "trf_blocks.1.att.W_query.weight"}
    assert len(d.unmoved) == len(d.tensors) - 2


def test_a_tied_head_moves_with_tok_emb_and_says_so():
    a, b = model(), model()
    with torch.no_grad():
        b.tok_emb.weight[7] += 0.1
    d = diff_weights(a, b)
    head = next(t for t in d.tensors if t.name == "out_head.weight")
    assert head.moved and head.tied_to == "tok_emb.weight"
    assert "(= tok_emb.weight, tied)" in diff_text(d)


def test_models_of_other_shapes_are_one_line_naming_the_first_tensor_that_differs(capsys, tmp_path):
    with pytest.raises(GlassError, match=r"trf_blocks.0.att.W_query.bias is \[16\] in A and missing in B"):
        diff_weights(model(), model(qkv_bias=False))
    small = tmp_path / "small.json"
    small.write_text(json.dumps(CFG.to_dict()))
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(glassgpt.GPTConfig(vocab_size=50257, context_length=32, emb_dim=32, n_heads=2,
                                                  n_layers=3).to_dict()))
    assert main(["diff", str(small), str(wide)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: {small} and {wide} have different shapes: tok_emb.weight is [50257, 16] in {small} and "
                       f"[50257, 32] in {wide}: diff compares models of the same config (sizes, qkv_bias, "
                       "context_length)")


@pytest.fixture(scope="module")
def classifier_run(tmp_path_factory):
    """A chapter-6 style run: finetune classify --trainable last-block on a small saved model."""
    root = tmp_path_factory.mktemp("ch06")
    base = glassgpt.save_model(model(seed=4), root / "base", tokenizer=glassgpt.get_tokenizer("gpt2"))
    data = root / "data.csv"
    with open(data, "w", newline="") as f:
        rows = csv.writer(f)
        rows.writerow(["text", "label"])
        rows.writerows([("you won a free prize, call now", "spam"), ("see you at lunch tomorrow", "ham")] * 12)
    run = root / "run"
    assert main(["finetune", "classify", "--model", str(base), "--data", str(data), "--out", str(run),
                 "--trainable", "last-block", "--max-steps", "3", "--no-progress", "--seed", "1"]) == 0
    return str(base), str(run)


def test_diff_of_a_last_block_finetune_lists_exactly_the_trained_tensors(classifier_run, capsys):
    base, run = classifier_run
    capsys.readouterr()
    a, b = glassgpt.load_model(base), glassgpt.load_model(run)
    d = diff_weights(a, b, base, run)
    last = f"trf_blocks.{CFG.n_layers - 1}."
    trained = {n for n in b.state_dict() if n.startswith(last) or n.startswith("final_norm.")}
    assert set(d.moved) == trained  # every one of them moved, and nothing else
    assert d.replaced == {"a": {"out_head.weight": [50257, 16]}, "b": {"out_head.weight": [2, 16], "out_head.bias": [2]}}
    assert main(["diff", base, run]) == 0
    out = capsys.readouterr().out
    assert f"tok_emb .. trf_blocks.{CFG.n_layers - 2}: did not move" in out
    assert "out_head: replaced" in out and "no KL divergence" in out
    assert (f"moved: 18 of 52 tensors: trf_blocks.2 (16), final_norm (2); out_head was replaced. Did not move at all: "
            f"tok_emb, pos_emb, trf_blocks.0 .. trf_blocks.1.") in out


def test_diff_json_and_picture(classifier_run, capsys):
    base, run = classifier_run
    capsys.readouterr()
    assert main(["diff", base, run, "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert set(got["weights"]["moved"]) == {t["name"] for t in got["weights"]["tensors"] if t["moved"]}
    assert got["next_token"]["kl_ab"] is None
    assert main(["diff", base, run, "--format", "svg"]) == 0
    root = ET.fromstring(capsys.readouterr().out)
    texts = " ".join(el.text or "" for el in root.iter("{http://www.w3.org/2000/svg}text"))
    assert "replaced: weight [50257, 16]" in texts and "Did not move at all" in texts


def test_diff_of_two_language_models_gives_the_kl_of_their_next_tokens(tmp_path, capsys):
    """Two GPT-2 initialisations with other seeds: every matrix differs, the zero biases and unit scales do not."""
    a, b = (str(glassgpt.save_model(model(seed=s), tmp_path / f"m{s}")) for s in (1, 2))
    assert main(["diff", a, b, "--prompt", "Every effort moves you", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    matrices = {n for n, t in model().state_dict().items() if t.dim() == 2}
    assert set(got["weights"]["moved"]) == matrices and len(got["weights"]["tensors"]) == len(model().state_dict())
    pa, pb = (glassgpt.load_model(p) for p in (a, b))
    ids = torch.tensor([glassgpt.get_tokenizer("gpt2").encode("Every effort moves you")])
    with torch.inference_mode():
        la, lb = (m(ids)[0, -1].double().log_softmax(-1) for m in (pa, pb))
    assert got["next_token"]["kl_ab"] == pytest.approx(float((la.exp() * (la - lb)).sum()), rel=1e-9)
