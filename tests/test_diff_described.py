"""glassgpt diff on every described model but GPT-2 (issue 47 point 2, issue 48 point 4): the bonus models and
chapter 4's variants, each under its own names (kinds.describe says where its blocks are), on tiny random models;
exactly the tensors that changed moved, by ||B - A|| / ||A||; another model or another shape is refused in one
line; a setting no tensor holds is noted; the CLI on folders a reader has."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import glassgpt
from glassgpt.errors import GlassError
from glassgpt.explain.diff import diff_weights
from glassgpt.explain.views.diff import diff_layout, diff_text
from helpers import DESCRIBED, tiny_described as tiny


@pytest.mark.parametrize("name", list(DESCRIBED))
def test_diff_names_exactly_the_changed_tensor_under_the_models_own_names(name):
    a = tiny(name)
    b = copy.deepcopy(a)
    anatomy = glassgpt.describe(a)
    changed = f"{anatomy.blocks[1].attention.out.path}.weight"  # every attention has its out projection
    with torch.no_grad():
        b.get_parameter(changed).mul_(1.5)  # ||B - A|| = 0.5 ||A||
    d = diff_weights(a, b)
    assert d.moved == [changed] and len(d.unmoved) == len(a.state_dict()) - 1
    by = {t.name: t for t in d.tensors}
    assert by[changed].rel_change == pytest.approx(0.5, rel=1e-6)
    assert by[changed].group == f"{anatomy.blocks_path}.1" and d.model == anatomy.name and d.notes == []
    assert f"(two {anatomy.name} models)" in diff_text(d)
    cells = [r.key for r in diff_layout(d).keyed("cell:")]
    assert f"cell:{changed}:moved" in cells
    assert len([c for c in cells if c.endswith(":moved")]) == 1
    # every tensor of a block has its cell, and every block its row
    first = [n for n in a.state_dict() if n.startswith(f"{anatomy.blocks_path}.0.")]
    assert {f"cell:{n}:still" for n in first} <= set(cells)
    assert all(any(c.startswith(f"cell:{anatomy.blocks_path}.{i}.") for c in cells) for i in range(anatomy.n_layers))


def test_two_described_models_of_other_kinds_are_refused_in_one_line():
    with pytest.raises(GlassError, match=r"^A is a Gemma 3 model and B is a OLMo 3 model: diff compares two models "
                                         r"of one family and one shape"):
        diff_weights(tiny("gemma3"), tiny("olmo3"))
    with pytest.raises(GlassError, match=r"^A is a GPT-2 with grouped-query attention model and B is a GPT-2 with "
                                         r"multi-head latent attention model"):
        diff_weights(tiny("gqa"), tiny("mla"))


def test_the_same_model_of_another_shape_is_refused_naming_the_first_tensor():
    from glassgpt.families import build_model
    wider = build_model(dataclasses.replace(DESCRIBED["gemma3"], hidden_dim=64))
    with pytest.raises(GlassError, match=r"blocks.0.ff.fc1.weight is \[48, 32\] in A and \[64, 32\] in B: diff "
                                         r"compares models of the same config"):
        diff_weights(tiny("gemma3"), wider)


def test_a_setting_that_no_tensor_holds_is_noted_when_it_differs():
    from glassgpt.families import build_model
    a = tiny("gemma3")
    b = build_model(dataclasses.replace(DESCRIBED["gemma3"], sliding_window=8))
    b.load_state_dict(a.state_dict())
    d = diff_weights(a, b)
    assert d.moved == []
    assert d.notes == ["the configs differ where no tensor shows it (sliding_window 4 in A and 8 in B): the same "
                       "tensors compute otherwise, so the predictions differ beyond the weights' changes"]


# (Gemma 3's folder: diff's weights as these, but the command's next-token comparison, compare.py, does not read
# Gemma 3 yet; OLMo 3, Tiny Aya and chapter 4's variants have no folder glassgpt writes.)
@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-moe"])
def test_glassgpt_diff_of_two_folders_lists_the_moved_tensor(name, tmp_path, monkeypatch, capsys):
    from glassgpt.cli import main
    from glassgpt.formats import families
    from glassgpt.tokenizer import get_tokenizer
    monkeypatch.setattr(families, "load_family_tokenizer", lambda spec: get_tokenizer("char", text="Every effort moves you, abcdefghijklmnopqrstuvwxyz."))
    a = tiny(name)
    b = copy.deepcopy(a)
    changed = f"{glassgpt.describe(a).blocks[0].attention.out.path}.weight"
    with torch.no_grad():
        b.get_parameter(changed).mul_(1.5)
    folder_a, folder_b = (str(families.export_family_hf(m, tmp_path / n)) for m, n in ((a, "a"), (b, "b")))
    assert main(["diff", folder_a, folder_b, "--prompt", "Every effort", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights"]["moved"] == [changed] and out["weights"]["model"] == glassgpt.describe(a).name
    assert out["next_token"]["kl_ab"] > 0
