"""The layer debugger (explain/debugger.py): a port against transformers, layer by layer, and the first cause.

The book's GPT-2, Qwen3 and Llama 3.2 classes and glassgpt's own, built on a tiny random config and given
transformers' random weights through glassgpt's maps, match transformers at every layer (rtol = atol =
1e-5, the maintainer's). A reader's port in memory with one planted mistake is named at its layer, the
part inside it, the property it breaks and, where the catalogue has it, the exact mistake. Loading a
state dict into a port: each way it goes wrong is named (check_state_dict).
"""

from __future__ import annotations

import json

import llms_from_scratch.kv_cache.gpt2 as book_kv_gpt2
import llms_from_scratch.kv_cache.qwen3 as book_kv_qwen
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
import pytest
import torch
from llms_from_scratch import ch04
from torch import nn

import glassgpt
from glassgpt.errors import GlassError
from glassgpt.explain.debugger import TINY, TINY_GPT2, LayerReport, debug
from glassgpt.explain.loading import check_state_dict, load_state_dict
from glassgpt.families import Llama3Model, Qwen3Model

from helpers import assert_one_line_error, run
from readers import MyGPT

LAYERS = ["embedding", "trf_blocks.0", "trf_blocks.1", "final_norm", "logits"]


# --- the table: every described model, the book's classes and glassgpt's -------------------------

@pytest.mark.parametrize("cls, reference", [
    (ch04.GPTModel, "GPT2LMHeadModel"), (book_qwen.Qwen3Model, "Qwen3ForCausalLM"),
    (book_llama.Llama3Model, "LlamaForCausalLM"), (glassgpt.GPTModel, "GPT2LMHeadModel"),
    (Qwen3Model, "Qwen3ForCausalLM"), (Llama3Model, "LlamaForCausalLM"), (ch04.GPTModelFast, "GPT2LMHeadModel"),
    (book_kv_gpt2.GPTModel, "GPT2LMHeadModel"), (book_kv_qwen.Qwen3Model, "Qwen3ForCausalLM")],
    ids=["book-gpt2", "book-qwen3", "book-llama3", "glass-gpt2", "glass-qwen3", "glass-llama3", "book-gpt2-fast",
         "book-kv-cache-gpt2", "book-kv-cache-qwen3"])
def test_every_layer_of_each_model_matches_transformers_given_the_same_random_weights(cls, reference):
    report = glassgpt.check(cls, against="transformers")
    assert isinstance(report, LayerReport)
    assert report.reference == f"transformers' {reference}"
    assert [line.name for line in report.layers] == LAYERS
    assert [line.status for line in report.layers] == ["OK"] * 5, report.to_text()
    assert all(line.max_diff < 1e-5 for line in report.layers)
    assert report.ok and report.layer is None and report.parts == []
    assert report.to_text().splitlines()[2:7] == [line.line for line in report.layers]
    assert report.to_text().splitlines()[2].startswith("[OK] embedding: max=")


def test_the_table_can_fail_a_port_whose_weights_are_not_transformers():
    # The [OK] lines above come from the mapped weights: a layer the map did not reach would differ.
    model = ch04.GPTModel(TINY_GPT2).eval()
    report = debug(model)
    assert report.ok
    from glassgpt.explain import debugger
    original = debugger.map_weights
    try:
        debugger.map_weights = lambda port, ref: None  # nothing copied: random against random
        assert [line.status for line in debug(model).layers] == ["DIFF"] * 5
    finally:
        debugger.map_weights = original


def test_a_models_own_weights_are_left_as_they_are():
    torch.manual_seed(1)
    model = book_qwen.Qwen3Model(TINY["qwen3"].to_book_dict(torch.float32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    debug(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_readers_own_config_is_the_one_built():
    cfg = TINY["llama3"].to_book_dict(torch.float32) | {"n_layers": 3, "emb_dim": 48, "hidden_dim": 40}
    report = glassgpt.check(book_llama.Llama3Model, args=cfg, against="transformers")
    assert report.ok, report.to_text()
    assert [line.name for line in report.layers][:5] == ["embedding", "trf_blocks.0", "trf_blocks.1",
                                                         "trf_blocks.2", "final_norm"]
    assert "emb_dim 48, 3 layers" in report.config


# --- the first cause: one planted mistake per model, in a reader's port held in memory -----------

def rope_interleaved(x, cos, sin):
    """A reader's RoPE on neighbouring pairs (Meta's original layout), with the book's tables."""
    t, hd = x.shape[2], x.shape[-1]
    c, s = cos[:t, : hd // 2].repeat_interleave(2, dim=-1), sin[:t, : hd // 2].repeat_interleave(2, dim=-1)
    pairs = x.view(*x.shape[:-1], hd // 2, 2)
    return x * c + torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2) * s


class ReaderGQA(nn.Module):
    """A reader's grouped-query attention forward with the book's names; `mistake` plants one."""

    mistake: str | None = None

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        q = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        v = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if getattr(self, "q_norm", None) is not None:
            if self.mistake not in ("no_q_norm", "no_qk_norm"):
                q = self.q_norm(q)
            if self.mistake != "no_qk_norm":
                k = self.k_norm(k)
        rope = rope_interleaved if self.mistake == "rope_interleaved" else book_qwen.apply_rope
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = k.repeat_interleave(self.group_size, dim=1), v.repeat_interleave(self.group_size, dim=1)
        scores = (q @ k.transpose(2, 3)).masked_fill(mask[:t, :t], -torch.inf)
        weights = torch.softmax(scores / self.head_dim ** 0.5, dim=-1)
        return self.out_proj((weights @ v).transpose(1, 2).reshape(b, t, self.d_out))


def reader_port(book_class: type, mistake: str | None) -> type:
    """A class as a reader writes it in a notebook: the book's model with its own attention (no file)."""
    class MyPort(book_class):
        def __init__(self, cfg):
            super().__init__(cfg)
            for blk in self.trf_blocks:
                blk.att.__class__ = type("MyAttention", (ReaderGQA, type(blk.att)), {"mistake": mistake})
    return MyPort


@pytest.mark.parametrize("book_class", [book_qwen.Qwen3Model, book_llama.Llama3Model], ids=["qwen3", "llama3"])
def test_a_correct_port_in_memory_matches_at_every_layer(book_class):
    assert debug(reader_port(book_class, None)).ok


def test_gpt2_with_the_exact_gelu_is_named_at_the_feed_forward_with_its_activation():
    report = glassgpt.check(MyGPT(TINY_GPT2, "exact_gelu"), against="transformers")
    assert (report.layer, report.part, report.mistake) == ("trf_blocks.0", "ff", "exact_gelu")
    assert [p.status for p in report.parts][:5] == ["OK"] * 5  # norm1, q, k, v and the attention
    assert report.broken == "the activation is the exact GELU (erf), where transformers uses GPT-2's tanh GELU"
    assert report.finding.startswith("first cause: trf_blocks.0 is the first layer that differs from "
                                     "transformers' GPT2LMHeadModel")
    assert "inside it, ff first: the activation is the exact GELU (erf)" in report.finding
    assert "The catalogue: the feed forward uses the exact GELU (erf)" in report.finding


def test_gpt2_without_its_first_shortcut_is_named_at_the_first_sum():
    report = debug(MyGPT(TINY_GPT2, "no_shortcut"))
    assert (report.layer, report.part, report.mistake) == ("trf_blocks.0", "shortcut1", "no_shortcut")
    assert "the shortcut (x = x + shortcut) is missing" in report.broken


@pytest.mark.parametrize("bug, words", [
    ("softmax_dim", "attention weights sums to"), ("no_mask", "on the later position"),
    ("no_scale", "the scores are divided by 1 (not scaled at all) where the head size was meant: divide by "
                 "sqrt(head_dim) = sqrt(8)"),
    ("unbiased_var", "it divides by the unbiased variance (n - 1)")])
def test_gpt2_attention_and_norm_mistakes_are_named_by_the_property_they_break(bug, words):
    report = debug(MyGPT(TINY_GPT2, bug))
    assert report.layer == "trf_blocks.0" and report.part == ("norm1" if bug == "unbiased_var" else "att")
    assert words in report.broken
    assert report.mistake == bug


def test_gpt2_positions_from_1_are_named_at_the_embedding():
    report = debug(MyGPT(TINY_GPT2, "pos_from_1"))
    assert report.layer == "embedding" and report.mistake == "pos_from_1"
    assert "the positions count from 1, not 0" in report.finding


def test_llama_with_rope_on_neighbouring_pairs_is_named_at_the_attention():
    report = debug(reader_port(book_llama.Llama3Model, "rope_interleaved"))
    assert (report.layer, report.part, report.mistake) == ("trf_blocks.0", "att", "rope_interleaved")
    assert [p.status for p in report.parts][:4] == ["OK"] * 4  # norm1 and the projections agree
    assert report.broken == ("RoPE rotates neighbouring pairs (x[0], x[1]), (x[2], x[3]), ... where transformers "
                             "rotates the halves (x[i], x[i + 4])")


def test_qwen3_without_q_norm_is_named_at_q_norm_which_the_forward_never_calls():
    report = debug(reader_port(book_qwen.Qwen3Model, "no_q_norm"))
    assert (report.layer, report.part) == ("trf_blocks.0", "att.q_norm")
    missing = next(p for p in report.parts if p.name == "att.q_norm")
    assert missing.status == "MISSING" and missing.note == "your forward never calls it"
    assert report.broken == ("transformers runs att.q_norm here (an RMSNorm over each query head, before RoPE) "
                             "and your forward never calls it")


def test_qwen3_without_qk_norm_also_gets_the_catalogues_line():
    report = debug(reader_port(book_qwen.Qwen3Model, "no_qk_norm"))
    assert report.part == "att.q_norm" and report.mistake == "no_qk_norm"
    assert "The catalogue: QK-norm is missing" in report.finding


# --- the command line, the notebook, bad input ------------------------------------------------------

def test_the_command_prints_the_table_and_exits_1_on_a_planted_mistake(tmp_path, capsys):
    (tmp_path / "my_gpt.py").write_text(
        "from torch import nn\nfrom llms_from_scratch.ch04 import GPTModel as Book\n\n\n"
        "class GPTModel(Book):\n    def __init__(self, cfg):\n        super().__init__(cfg)\n"
        "        for blk in self.trf_blocks:\n            blk.ff.layers[1] = nn.GELU()  # the exact GELU\n")
    code, out, _ = run(["check", f"{tmp_path / 'my_gpt.py'}:GPTModel", "--against", "transformers"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert lines[2] == "[OK] embedding: max=0.00e+00, mean=0.00e+00"
    assert lines[3].startswith("[DIFF] trf_blocks.0: max=")
    assert "inside it, ff first: the activation is the exact GELU (erf)" in out
    code, out, _ = run(["check", f"{tmp_path / 'my_gpt.py'}:GPTModel", "--against", "transformers", "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["layer"] == "trf_blocks.0" and data["part"] == "ff" and data["mistake"] == "exact_gelu"


def test_the_command_takes_the_readers_config(tmp_path, capsys):
    (tmp_path / "port.py").write_text("from llms_from_scratch.qwen3 import Qwen3Model\n")
    (tmp_path / "cfg.json").write_text(json.dumps(TINY["qwen3"].to_book_dict("float32") | {"n_layers": 1}))
    code, out, _ = run(["check", f"{tmp_path / 'port.py'}:Qwen3Model", "--against", "transformers",
                        "--config", str(tmp_path / "cfg.json")], capsys)
    assert code == 0 and "[OK] trf_blocks.0" in out and "trf_blocks.1" not in out


def test_weights_with_against_is_one_line(tmp_path, capsys):
    (tmp_path / "port.py").write_text("from llms_from_scratch.qwen3 import Qwen3Model\n")
    code, _, err = run(["check", f"{tmp_path / 'port.py'}:Qwen3Model", "--against", "transformers",
                        "--weights", "w.pth"], capsys)
    assert_one_line_error(code, err, "leave out --weights")


def test_the_notebook_shows_the_table_and_the_first_cause():
    html = debug(MyGPT(TINY_GPT2, "exact_gelu"))._repr_html_()
    assert html.startswith('<div class="glassgpt"><svg') and "[DIFF] trf_blocks.0: max=" in html
    assert "first cause: trf_blocks.0" in html


def test_a_class_of_no_known_family_is_one_line():
    class Nothing(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.lin = nn.Linear(2, 2)
    with pytest.raises(GlassError) as caught:
        debug(Nothing)
    assert "Nothing could not be built as a GPT-2, Qwen3 or Llama 3 model" in str(caught.value)
    assert "give its config" in str(caught.value) and "\n" not in str(caught.value)


def test_against_anything_but_transformers_is_refused():
    with pytest.raises(GlassError, match="compares with transformers"):
        glassgpt.check(ch04.GPTModel, against="onnx")


# --- loading a state dict: each mistake named ---------------------------------------------------------

def book_gpt() -> ch04.GPTModel:
    torch.manual_seed(0)
    return ch04.GPTModel(TINY_GPT2)


def test_layer_norm_names_weight_and_bias_are_named_with_their_map():
    state = {(k[:-6] + ".weight" if k.endswith(".scale") else k[:-6] + ".bias" if k.endswith(".shift") else k): v
             for k, v in book_gpt().state_dict().items()}
    errors, _ = check_state_dict(book_gpt(), state)
    assert errors == ["the state dict names a norm's parameters weight where your model has scale "
                      "(final_norm.weight -> final_norm.scale): nn.LayerNorm says weight/bias, the book's LayerNorm "
                      "scale/shift; rename .weight -> .scale and .bias -> .shift (or the reverse) before load_state_dict"]


def test_transformers_names_are_named_with_the_map_and_an_example():
    hf_state = {f"model.layers.{k.split('.')[1]}.x" if k.startswith("trf_blocks") else k: v
                for k, v in book_qwen.Qwen3Model(TINY["qwen3"].to_book_dict(torch.float32)).state_dict().items()}
    hf_state["model.layers.0.self_attn.q_proj.weight"] = hf_state.pop("model.layers.0.x")
    errors, _ = check_state_dict(book_qwen.Qwen3Model(TINY["qwen3"].to_book_dict(torch.float32)), hf_state)
    assert len(errors) == 1
    assert "transformers' Qwen3/Llama names (model.layers.N, model.embed_tokens)" in errors[0]
    assert "convert them with formats/families.py's hf_names" in errors[0]
    assert "e.g. model.layers.0.self_attn.q_proj.weight is trf_blocks.0.att.W_query.weight" in errors[0]


def test_gpt2s_transformers_names_are_named_with_the_conv1d_map():
    from glassgpt.formats.hf import hf_state_dict
    glass = glassgpt.GPTModel(glassgpt.GPTConfig(**TINY_GPT2, tie_embeddings=False))
    errors, _ = check_state_dict(book_gpt(), hf_state_dict(glass))
    assert "transformers' GPT-2 names (transformer.h.N, wte" in errors[0]
    assert "formats/hf.py's hf_to_glassgpt, which also transposes the Conv1D matrices" in errors[0]


def test_a_transposed_matrix_is_named_as_conv1d_layout():
    state = book_gpt().state_dict()
    state["trf_blocks.1.ff.layers.0.weight"] = state["trf_blocks.1.ff.layers.0.weight"].t().contiguous()
    errors, _ = check_state_dict(book_gpt(), state)
    assert errors == ["trf_blocks.1.ff.layers.0.weight is [32, 128], the transpose of your nn.Linear's [128, 32] "
                      "([out, in]): it is stored as GPT-2's Conv1D stores it ([in, out]): transpose it (w.t()), as "
                      "formats/hf.py's map does"]


def test_a_missing_and_an_unexpected_key_are_named():
    state = book_gpt().state_dict()
    state.pop("trf_blocks.0.att.W_query.weight")
    state["trf_blocks.0.att.rotary.inv_freq"] = torch.zeros(4)
    errors, _ = check_state_dict(book_gpt(), state)
    assert errors == ["the state dict lacks 1 key(s) your model has (trf_blocks.0.att.W_query.weight) and holds 1 "
                      "your model has not (trf_blocks.0.att.rotary.inv_freq): it was saved from another model or "
                      "config"]


def test_a_head_that_is_a_copy_of_the_embedding_is_a_note_and_a_tie_is_not():
    state = book_gpt().state_dict()
    state["out_head.weight"] = state["tok_emb.weight"].clone()
    model = book_gpt()
    assert load_state_dict(model, state) == ["the state dict's out_head.weight holds the same numbers as "
                                             "tok_emb.weight but in separate storage: a copy, not a tie (training "
                                             "moves them apart); to tie them, assign model.out_head.weight = "
                                             "model.tok_emb.weight"]
    assert torch.equal(model.out_head.weight, state["tok_emb.weight"])
    state["out_head.weight"] = state["tok_emb.weight"]  # one tensor: a tie
    assert check_state_dict(book_gpt(), state) == ([], [])


def test_the_command_names_why_a_state_dict_does_not_load(tmp_path, capsys):
    (tmp_path / "my_gpt.py").write_text("from llms_from_scratch.ch04 import GPTModel\n")
    (tmp_path / "cfg.json").write_text(json.dumps(TINY_GPT2))
    state = book_gpt().state_dict()
    state["trf_blocks.0.ff.layers.2.weight"] = state["trf_blocks.0.ff.layers.2.weight"].t().contiguous()
    torch.save(state, tmp_path / "w.pth")
    code, _, err = run(["check", f"{tmp_path / 'my_gpt.py'}:GPTModel", "--config", str(tmp_path / "cfg.json"),
                        "--weights", str(tmp_path / "w.pth")], capsys)
    assert_one_line_error(code, err, "does not load into GPTModel: trf_blocks.0.ff.layers.2.weight is [128, 32], "
                                     "the transpose of your nn.Linear's [32, 128]", "Conv1D")
    state = book_gpt().state_dict()
    state["out_head.weight"] = state["tok_emb.weight"].clone()
    torch.save(state, tmp_path / "w.pth")
    code, out, _ = run(["check", f"{tmp_path / 'my_gpt.py'}:GPTModel", "--config", str(tmp_path / "cfg.json"),
                        "--weights", str(tmp_path / "w.pth")], capsys)
    assert code == 0 and "note: the state dict's out_head.weight holds the same numbers as tok_emb.weight" in out


def test_positions_counted_from_any_offset_are_named_by_the_rows_of_pos_emb_used():
    class FromTwo(ch04.GPTModel):  # outside the catalogue (which knows an offset of 1)
        def forward(self, in_idx):
            t = in_idx.shape[1]
            x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(2, 2 + t, device=in_idx.device))
            return self.out_head(self.final_norm(self.trf_blocks(self.drop_emb(x))))
    report = debug(FromTwo)
    assert (report.layer, report.part, report.mistake) == ("embedding", "pos_emb", None)
    assert [p.name for p in report.parts] == ["tok_emb", "pos_emb"] and report.parts[0].status == "OK"
    assert report.broken == ("it adds the rows 2..9 of pos_emb to the 8 tokens: the positions count from 2, not 0 "
                             "(torch.arange(num_tokens))")


def test_nanogpts_fused_qkv_is_no_missing_part():
    from readers import NanoGPT
    report = debug(NanoGPT(vocab_size=257, block_size=16, n_layer=2, n_head=4, n_embd=32))
    assert report.reference == "transformers' GPT2LMHeadModel"
    # nanoGPT's nn.GELU() is the exact one: named at its feed-forward, with no line for the q, k, v it fuses
    assert (report.layer, report.part) == ("trf_blocks.0", "ff"), report.to_text()
    assert [p.name for p in report.parts][:3] == ["norm1", "att", "shortcut1"]
    assert "the exact GELU (erf)" in report.broken


def test_a_layer_norm_where_llama_has_rms_norm_is_named_by_its_rows_mean():
    class MeanNorm(nn.Module):  # a reader's "RMSNorm" that also subtracts the mean
        def __init__(self, d, eps=1e-5):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

        def forward(self, x):
            x = x - x.mean(-1, keepdim=True)
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class MyLlama(book_llama.Llama3Model):
        def __init__(self, cfg):
            super().__init__(cfg)
            for blk in self.trf_blocks:
                blk.norm1 = MeanNorm(cfg["emb_dim"])

    report = debug(MyLlama)
    assert (report.layer, report.part, report.mistake) == ("trf_blocks.0", "norm1", None)
    assert report.broken.startswith("its rows come out with mean 0: it subtracts each row's mean, as LayerNorm does")


def test_a_rope_base_outside_the_config_is_named_by_the_base_that_fits():
    class MyQwen(book_qwen.Qwen3Model):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.cos, self.sin = book_qwen.compute_rope_params(cfg["head_dim"], theta_base=10_000,
                                                               context_length=cfg["context_length"])

    report = debug(MyQwen)
    assert (report.layer, report.part, report.mistake) == ("trf_blocks.0", "att", "rope_base")
    assert report.broken == "RoPE turns at theta base 10,000, where the config's rope_base is 1,000,000"


def test_gpt2s_transformers_names_get_an_example_mapped_by_glassgpts_own_table():
    from glassgpt.formats.hf import hf_state_dict
    glass = glassgpt.GPTModel(glassgpt.GPTConfig(**TINY_GPT2, tie_embeddings=False))
    errors, _ = check_state_dict(book_gpt(), hf_state_dict(glass))
    assert errors[0].endswith("; e.g. transformer.h.0.attn.c_attn.bias is trf_blocks.0.att.W_query.bias + "
                              "trf_blocks.0.att.W_key.bias + trf_blocks.0.att.W_value.bias")


def test_the_table_docs_check_md_shows_is_what_the_debugger_prints():
    from pathlib import Path
    page = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text(encoding="utf-8")
    shown = [block for block in page.split("```\n") if block.startswith("glassgpt check: ") and " against transformers'" in block]

    class MyGPTModel(ch04.GPTModel):  # the page's notebook port
        def __init__(self, cfg):
            super().__init__(cfg)
            for block in self.trf_blocks:
                block.ff.layers[1] = nn.GELU()

    from glassgpt.explain.debugger import tiny_config
    from glassgpt.families import Olmo3Model

    olmo = Olmo3Model(tiny_config("olmo3"))  # the page's OLMo 3 with its norms before each sublayer

    def forward(self, x, cos, sin, cache=None):
        x = x + self.att(self.post_attention_layernorm(x), cos, sin, cache)
        return x + self.ff(self.post_feedforward_layernorm(x))

    for block in olmo.blocks:
        block.forward = forward.__get__(block)
    assert [block.strip() for block in shown] == [glassgpt.check(book_qwen.Qwen3Model, against="transformers").to_text(),
                                                  glassgpt.check(MyGPTModel, against="transformers").to_text(),
                                                  glassgpt.check(olmo, against="transformers").to_text()]
