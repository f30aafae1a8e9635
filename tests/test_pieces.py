"""glassgpt.check(piece), chapters 3 and 4: the book's own classes (llms_from_scratch) match glassgpt's
formulas; the same classes with one planted mistake each (subclassed here, one change) are named at
the stage where the mistake shows, with the mistake and its words.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import glassgpt
from glassgpt.explain.pieces import PieceError
from llms_from_scratch import ch03, ch04
from helpers import MaskDiagonal, named

SMALL_CFG = {"vocab_size": 50257, "context_length": 32, "emb_dim": 64, "n_heads": 4, "n_layers": 1,
             "drop_rate": 0.1, "qkv_bias": False}
MHA_6 = {"d_in": 6, "d_out": 6, "context_length": 6, "dropout": 0.0, "num_heads": 2}  # head size 3, not d_out


# --- chapter 3: planted into the book's classes -------------------------------------------------------

class NoScale(ch03.CausalAttention):
    def forward(self, x):
        b, t, _ = x.shape
        scores = self.W_query(x) @ self.W_key(x).transpose(1, 2)
        scores.masked_fill_(self.mask.bool()[:t, :t], -torch.inf)
        return self.dropout(torch.softmax(scores, dim=-1)) @ self.W_value(x)  # planted: no / sqrt(d_k)


class DropoutBeforeSoftmax(ch03.CausalAttention):
    def forward(self, x):
        b, t, _ = x.shape
        keys = self.W_key(x)
        scores = self.W_query(x) @ keys.transpose(1, 2)
        scores.masked_fill_(self.mask.bool()[:t, :t], -torch.inf)
        scores = self.dropout(scores)  # planted: on the scores, before the softmax
        return torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1) @ self.W_value(x)


class MaskWrongSide(ch03.CausalAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mask = torch.tril(torch.ones_like(self.mask), diagonal=-1)  # planted: the past, not the future


class SoftmaxDim(ch03.SelfAttention_v1):
    def forward(self, x):
        keys, queries, values = x @ self.W_key, x @ self.W_query, x @ self.W_value
        weights = torch.softmax(queries @ keys.T / keys.shape[-1] ** 0.5, dim=0)  # planted: dim=0
        return weights @ values


class MyMHA(ch03.MultiHeadAttention):
    """The book's MultiHeadAttention, its forward written out, with the planted mistake `bug`."""

    bug = None

    def forward(self, x):
        b, t, _ = x.shape
        if self.bug == "view_no_transpose":
            split = lambda y: y.view(b, self.num_heads, t, self.head_dim)  # noqa: E731
        else:
            split = lambda y: y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        keys, queries, values = split(self.W_key(x)), split(self.W_query(x)), split(self.W_value(x))
        scores = (queries @ keys.transpose(2, 3)).masked_fill(self.mask.bool()[:t, :t], -torch.inf)
        scale = self.d_out ** 0.5 if self.bug == "scale_d_out" else keys.shape[-1] ** 0.5
        weights = self.dropout(torch.softmax(scores / scale, dim=-1))
        context = weights @ values
        context = context.reshape(b, t, self.d_out) if self.bug == "view_no_transpose" else \
            context.transpose(1, 2).reshape(b, t, self.d_out)
        return self.out_proj(context)


def planted_mha(bug):
    return type("MultiHeadAttention", (MyMHA,), {"bug": bug})


class WrapperConcatTokens(ch03.MultiHeadAttentionWrapper):
    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=1)  # planted: dim=1


# --- chapter 4 ----------------------------------------------------------------------------------------

class LayerNormNoEps(ch04.LayerNorm):
    def forward(self, x):
        mean, var = x.mean(dim=-1, keepdim=True), x.var(dim=-1, keepdim=True, unbiased=False)
        return self.scale * (x - mean) / torch.sqrt(var) + self.shift  # planted: no eps


class LayerNormUnbiased(ch04.LayerNorm):
    def forward(self, x):
        mean, var = x.mean(dim=-1, keepdim=True), x.var(dim=-1, keepdim=True)  # planted: unbiased (n - 1)
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


class ExactGELU(ch04.GELU):
    def forward(self, x):
        return F.gelu(x)  # planted: erf, not the tanh approximation


class FeedForward2x(ch04.FeedForward):
    def __init__(self, cfg):
        super().__init__(cfg)
        d = cfg["emb_dim"]
        self.layers = nn.Sequential(nn.Linear(d, 2 * d), ch04.GELU(), nn.Linear(2 * d, d))  # planted: 2x


class NoShortcut(ch04.TransformerBlock):
    def forward(self, x):
        x = self.drop_resid(self.att(self.norm1(x)))  # planted: no + shortcut, twice
        return self.drop_resid(self.ff(self.norm2(x)))


class PostNorm(ch04.TransformerBlock):
    def forward(self, x):
        x = self.norm1(x + self.drop_resid(self.att(x)))  # planted: normalize after the shortcut
        return self.norm2(x + self.drop_resid(self.ff(x)))


class NoMask(ch03.CausalAttention):
    def forward(self, x):
        keys = self.W_key(x)
        scores = self.W_query(x) @ keys.transpose(1, 2)  # planted: no masked_fill
        return self.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)) @ self.W_value(x)


class WrapperConcatBatch(ch03.MultiHeadAttentionWrapper):
    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=0)  # planted: dim=0


class ReLU(ch04.GELU):
    def forward(self, x):
        return torch.relu(x)  # planted


class NoFirstShortcut(ch04.TransformerBlock):
    def forward(self, x):
        x = self.drop_resid(self.att(self.norm1(x)))  # planted: no + shortcut here
        return x + self.drop_resid(self.ff(self.norm2(x)))


class NoSecondShortcut(ch04.TransformerBlock):
    def forward(self, x):
        x = x + self.drop_resid(self.att(self.norm1(x)))
        return self.drop_resid(self.ff(self.norm2(x)))  # planted: no + shortcut here


PLANTED = {  # id: (the class, its args, the stage, the mistake, words of the finding)
    "no_scale": (named(NoScale, "CausalAttention"), None, "attention weights", "no_scale", "sqrt(head size)"),
    "scale_d_out": (planted_mha("scale_d_out"), MHA_6, "attention weights", "scale_d_out", "sqrt(d_out)"),
    "softmax_dim": (named(SoftmaxDim, "SelfAttention_v1"), None, "attention weights", "softmax_dim", "dim=-1"),
    "mask_wrong_side": (named(MaskWrongSide, "CausalAttention"), None, "attention weights", "mask_wrong_side",
                        "not below it (tril)"),
    "mask_diagonal": (named(MaskDiagonal, "CausalAttention"), None, "attention weights", "mask_diagonal",
                      "row 0 of the attention weights is NaN: every position is masked, including the diagonal"),
    "dropout_before_softmax": (named(DropoutBeforeSoftmax, "CausalAttention"), None, "attention weights",
                               "dropout_before_softmax", "with dropout on, "),
    "view_no_transpose": (planted_mha("view_no_transpose"), MHA_6, "attention weights", "view_no_transpose",
                          ".transpose(1, 2)"),
    "concat_tokens": (named(WrapperConcatTokens, "MultiHeadAttentionWrapper"), None, "output", "concat_tokens",
                      "dim=-1"),
    "no_mask": (named(NoMask, "CausalAttention"), None, "attention weights", "no_mask", "triu(..., diagonal=1)"),
    "concat_batch": (named(WrapperConcatBatch, "MultiHeadAttentionWrapper"), None, "output", "concat_batch",
                     "dim 0 (the batch)"),
    "relu": (named(ReLU, "GELU"), None, "output", "relu", "ReLU"),
    "no_shortcut1": (named(NoFirstShortcut, "TransformerBlock"), SMALL_CFG, "output", "no_shortcut1",
                     "around the attention"),
    "no_shortcut2": (named(NoSecondShortcut, "TransformerBlock"), SMALL_CFG, "output", "no_shortcut2",
                     "around the feed forward"),
    "no_eps": (named(LayerNormNoEps, "LayerNorm"), None, "output", "no_eps", "torch.sqrt(var + self.eps)"),
    "unbiased_var": (named(LayerNormUnbiased, "LayerNorm"), None, "output", "unbiased_var", "unbiased=False"),
    "exact_gelu": (named(ExactGELU, "GELU"), None, "output", "exact_gelu", "tanh approximation"),
    "ff_2x": (named(FeedForward2x, "FeedForward"), SMALL_CFG, "shape", "ff_2x", "4 * emb_dim"),
    "no_shortcut": (named(NoShortcut, "TransformerBlock"), SMALL_CFG, "output", "no_shortcut", "x = x + shortcut"),
    "post_norm": (named(PostNorm, "TransformerBlock"), SMALL_CFG, "output", "post_norm", "post-norm"),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_each_planted_mistake_is_named_at_its_stage_with_its_words(bug):
    cls, args, stage, mistake, words = PLANTED[bug]
    result = glassgpt.check(cls, args=args)
    assert not result.ok
    assert result.stage == stage, result.to_text()
    assert result.mistake == mistake, result.to_text()
    assert words in result.finding and "\n" not in result.finding


def test_every_known_mistake_of_chapters_3_and_4_is_planted_in_a_test():
    from glassgpt.explain.pieces import attention, layers
    planted = {mistake for _, _, _, mistake, _ in PLANTED.values()} | {"dropout_eval"}  # the test below
    assert set(attention.MISTAKES) | set(layers.MISTAKES) == planted


def test_a_diagonal_masked_too_is_placed_at_row_0_as_nan_not_as_dropout():
    result = glassgpt.check(named(MaskDiagonal, "CausalAttention"))
    assert result.where == "row 0"
    assert result.finding.startswith("row 0 of the attention weights is NaN: every position is masked, including "
                                     "the diagonal")
    assert "triu(..., diagonal=1) masks only the future" in result.finding and "dropout" not in result.finding


@pytest.mark.parametrize("cls", [ch03.SelfAttention_v1, ch03.SelfAttention_v2, ch03.CausalAttention,
                                 ch03.MultiHeadAttentionWrapper, ch03.MultiHeadAttention, ch04.LayerNorm, ch04.GELU])
def test_the_books_own_classes_match_with_the_books_arguments(cls):
    result = glassgpt.check(cls)
    assert result.ok, result.to_text()
    assert result.kind == cls.__name__


@pytest.mark.parametrize("cls", [ch04.FeedForward, ch04.TransformerBlock])
def test_the_books_blocks_match_at_a_small_config(cls):
    result = glassgpt.check(cls, args=SMALL_CFG)
    assert result.ok, result.to_text()


def test_the_chapter_3_preset_builds_the_books_example_and_feeds_its_inputs():
    result = glassgpt.check(ch03.MultiHeadAttention, args="ch03")
    assert "[2, 6, 3] inputs (the book's 'Your journey starts with one step')" in result.fed
    torch.testing.assert_close(result.views["reader_weights"].double(), result.views["book_weights"],
                               rtol=0, atol=1e-6)


def test_an_instance_is_read_as_built_and_dropout_is_checked_with_it_on():
    torch.manual_seed(0)
    att = ch03.MultiHeadAttention(d_in=8, d_out=8, context_length=6, dropout=0.1, num_heads=2)
    result = glassgpt.check(att)
    assert result.ok and any("training mode, dropout p=0.5" in line for line in result.lines)


def test_dropout_left_on_in_eval_is_named_only_when_two_eval_runs_differ():
    class AlwaysDropout(ch03.CausalAttention):
        def forward(self, x):
            b, t, _ = x.shape
            keys = self.W_key(x)
            scores = (self.W_query(x) @ keys.transpose(1, 2)).masked_fill(self.mask.bool()[:t, :t], -torch.inf)
            weights = F.dropout(torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1), 0.5)  # training=True always
            return weights @ self.W_value(x)
    result = glassgpt.check(named(AlwaysDropout, "CausalAttention"))
    assert result.mistake == "dropout_eval" and "two eval runs" in result.finding


def test_a_mistake_inside_a_block_is_named_at_its_part():
    class Block(ch04.TransformerBlock):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.norm1 = LayerNormUnbiased(cfg["emb_dim"])
    result = glassgpt.check(named(Block, "TransformerBlock"), args=SMALL_CFG)
    assert result.stage == "norm1 output" and result.mistake == "unbiased_var"
    assert result.finding.startswith("norm1: row 0 of the normalized output has variance")


def test_a_class_it_does_not_know_is_one_line_naming_the_kinds_it_knows():
    class Tokenizer2000(nn.Module):
        def __init__(self, size):
            super().__init__()
            self.size = size
    with pytest.raises(PieceError) as err:
        glassgpt.check(Tokenizer2000(3))
    assert "no kind glassgpt check knows" in str(err.value) and "MultiHeadAttention" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_class_that_cannot_be_built_with_the_arguments_says_which_and_how():
    with pytest.raises(PieceError) as err:
        glassgpt.check(ch03.MultiHeadAttention, args={"d_in": 3})
    assert "could not be built with {'d_in': 3}" in str(err.value) and "--args" in str(err.value)


# --- the command line -----------------------------------------------------------------------------------

MY_ATTENTION = '''import torch
from llms_from_scratch import ch03


class MultiHeadAttention(ch03.MultiHeadAttention):  # the issue's trial: the mask also covers the diagonal
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.mask = torch.triu(torch.ones(context_length, context_length), diagonal=0)


class Mystery(torch.nn.Module):
    def __init__(self, size):
        super().__init__()
'''


@pytest.fixture
def my_attention(tmp_path):
    (tmp_path / "my_attention.py").write_text(MY_ATTENTION)
    return tmp_path / "my_attention.py"


@pytest.mark.parametrize("how", [["--args", "ch03"], ["--args", "ch04"], [],
                                 ["--args", '{"d_in": 8, "d_out": 8, "context_length": 6, "dropout": 0.0, '
                                            '"num_heads": 2}']])
def test_the_command_line_builds_a_piece_with_its_arguments_and_names_the_mistake(my_attention, capsys, how):
    from glassgpt.cli import main
    assert main(["check", f"{my_attention}:MultiHeadAttention", *how]) == 1
    out = capsys.readouterr().out
    assert "row 0 of head 0 of the attention weights is NaN: every position is masked, including the diagonal" in out


def test_the_issues_config_file_with_missing_arguments_is_one_line_not_a_type_error(my_attention, tmp_path, capsys):
    from glassgpt.cli import main
    (tmp_path / "att.json").write_text('{"d_in": 768}')
    assert main(["check", f"{my_attention}:MultiHeadAttention", "--config", str(tmp_path / "att.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "missing 4 required positional arguments" in err
    assert "--args ch03, ch04, qwen3, llama3, gemma3, olmo3, qwen3_5 or tiny_aya" in err


def test_the_command_line_says_which_kinds_it_knows_for_a_class_it_does_not(my_attention, capsys):
    from glassgpt.cli import main
    assert main(["check", f"{my_attention}:Mystery"]) == 2
    err = capsys.readouterr().err
    assert "Mystery is no kind glassgpt check knows" in err and "MultiHeadAttention, LayerNorm" in err
    assert err.count("\n") == 1


def test_the_command_line_checks_a_function_by_its_name(tmp_path, capsys):
    from glassgpt.cli import main
    (tmp_path / "mine.py").write_text("from llms_from_scratch.ch07 import custom_collate_fn\n")
    assert main(["check", f"{tmp_path / 'mine.py'}:custom_collate_fn", "--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_a_bad_args_value_is_one_line(my_attention, capsys):
    from glassgpt.cli import main
    assert main(["check", f"{my_attention}:MultiHeadAttention", "--args", "ch09"]) == 2
    assert "one of ch03, ch04" in capsys.readouterr().err


def test_the_docs_chapter_3_example_prints_what_the_docs_say():
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text()
    printed = docs.split("it prints:\n\n```\n")[1].split("\n```")[0]

    class MultiHeadAttention(ch03.MultiHeadAttention):
        def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
            super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
            self.mask = torch.triu(torch.ones(context_length, context_length), diagonal=0)
    assert glassgpt.check(MultiHeadAttention, args="ch03").finding == printed


def test_a_piece_whose_weight_holds_nan_is_refused_naming_the_weight():
    from glassgpt.errors import NonFiniteError
    from glassgpt.explain.pieces import build
    att = build(ch03.MultiHeadAttention)
    with torch.no_grad():
        att.W_key.weight[1, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"W_key\.weight holds 1 NaN"):
        glassgpt.check(att)
