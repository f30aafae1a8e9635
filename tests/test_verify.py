"""glassgpt.check: a reader's copy of the book's GPTModel, with one planted mistake at a time, is named
at the stage that makes the mistake, with the mistake; a correct one matches at every stage.

Each stage's tolerance is 1e-5 of its largest value (float32 against model.py in float64).
"""

from __future__ import annotations

import json

import pytest
import torch

import glassgpt
from glassgpt.cli import main
from glassgpt.explain.verify import MISTAKES

from conftest import randomize_
from readers import NanoGPT, book_model, my_model

PLANTED = {  # mistake -> the first stage that must differ
    "no_mask": "trf_blocks.0.att", "mask_wrong_side": "trf_blocks.0.att", "softmax_dim": "trf_blocks.0.att",
    "no_scale": "trf_blocks.0.att", "view_no_transpose": "trf_blocks.0.att", "dropout": "trf_blocks.0.att",
    "no_shortcut": "trf_blocks.0.shortcut1", "unbiased_var": "trf_blocks.0.norm1", "no_eps": "trf_blocks.0.norm1",
    "exact_gelu": "trf_blocks.0.ff", "pos_from_1": "pos_emb", "mask_diagonal": "trf_blocks.0.att",
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_mistake_is_named_at_its_stage(bug):
    result = glassgpt.check(my_model(bug))
    assert not result.ok
    assert result.first.name == PLANTED[bug]
    assert result.mistake == bug, result.to_text()
    assert result.finding.startswith(f"{PLANTED[bug]} is the first stage that differs")
    assert "\n" not in result.finding


def test_a_diagonal_masked_too_is_named_as_a_nan_row_not_as_dropout():
    model = my_model("mask_diagonal")
    model.drop_emb.p = 0.0
    result = glassgpt.check(model)
    assert result.first.name == "trf_blocks.0.att" and result.first.non_finite == "NaN"
    assert result.first.where["position"] == 0
    assert "its output is NaN, first at block 0, position 0" in result.finding
    assert "row 0 of the attention weights is masked, the diagonal too" in result.finding
    assert "dropout" not in result.finding and "max |diff| inf" not in result.to_text()
    assert "NaN from" in result.to_text()


def test_a_nan_in_one_weight_is_named_with_the_weight_not_dropout():
    from glassgpt.errors import NonFiniteError
    model = book_model()
    with torch.no_grad():
        model.trf_blocks[1].ff.layers[0].weight[3, 7] = float("nan")
    with pytest.raises(NonFiniteError) as caught:
        glassgpt.check(model)
    assert "trf_blocks.1.ff.layers.0.weight holds 1 NaN of its 16,384 values" in str(caught.value)
    assert "dropout" not in str(caught.value)


def test_dropout_is_named_only_when_two_eval_runs_differ():
    result = glassgpt.check(my_model("dropout"))
    assert result.mistake == "dropout"
    assert result.first.non_finite is None


def test_a_correct_copy_and_the_books_own_model_match_at_every_stage():
    for model in (my_model(), book_model()):
        result = glassgpt.check(model)
        assert result.ok, result.to_text()
        assert result.finding.startswith("matches the book's formulas at every stage (largest difference")
        assert len(result.stages) == 3 + 2 * 6 + 2


def test_the_largest_difference_is_placed_by_block_position_and_feature():
    result = glassgpt.check(my_model("no_mask"))
    where = result.first.where
    assert where["block"] == 0 and 0 <= where["position"] < 4 and 0 <= where["feature"] < 64
    assert where["position"] < 3  # the last token sees every token whether masked or not


def test_a_head_tied_by_copying_gets_a_note():
    model = book_model()
    with torch.no_grad():
        model.out_head.weight.copy_(model.tok_emb.weight)
    result = glassgpt.check(model)
    assert result.ok and "is a copy, not the same tensor" in result.notes[0]


def test_nanogpts_exact_gelu_is_named_against_the_books_formulas():
    result = glassgpt.check(randomize_(NanoGPT(), std=0.3))  # GELU's inputs as large as a trained model's
    assert result.first.name == "trf_blocks.0.ff" and result.mistake == "exact_gelu"


def test_every_known_mistake_is_planted_in_a_test():
    assert set(MISTAKES) - set(PLANTED) == {"scale_emb_dim", "relu"}  # two extra guesses, not in the list


def test_check_on_the_command_line(tmp_path, capsys):
    source = tmp_path / "my_gpt.py"
    source.write_text("from readers import MyGPT\n\nclass GPTModel(MyGPT):\n"
                      "    def __init__(self, cfg):\n        super().__init__(cfg, bug='no_scale')\n")
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"vocab_size": 50257, "context_length": 32, "emb_dim": 64, "n_heads": 4,
                                  "n_layers": 2, "drop_rate": 0.1, "qkv_bias": False}))
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    assert main(["check", f"{source}:GPTModel", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "trf_blocks.0.att is the first stage that differs" in out and "sqrt(head_dim)" in out


@pytest.mark.parametrize("text, expected", [
    ("import torch\ndef broken(:\n", "does not import: a syntax error at line 2"),
    ("raise RuntimeError('no GPU here')\n", "does not import: RuntimeError: no GPU here"),
    ("class Other:\n    pass\n", "has no class 'GPTModel': it defines Other"),
])
def test_a_file_that_does_not_import_or_lacks_the_class_is_one_line(tmp_path, capsys, text, expected):
    source = tmp_path / "my_gpt.py"
    source.write_text(text)
    (tmp_path / "cfg.json").write_text("{}")
    assert main(["check", f"{source}:GPTModel", "--config", str(tmp_path / "cfg.json")]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err
