"""A model describes itself once (anatomy.py, issue 47 point 1): every kind of model object glassgpt reads is
described with paths into the object itself, and the description agrees with the module it describes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from torch import nn

import glassgpt
import llms_from_scratch.ch04 as book_ch04
import llms_from_scratch.kv_cache.llama3 as book_kv_llama
import llms_from_scratch.kv_cache.qwen3 as book_kv_qwen
import llms_from_scratch.kv_cache_batched.qwen3 as book_batched_qwen
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt import anatomy as an
from glassgpt.config import GPTConfig
from glassgpt.errors import UnreadableModelError
from glassgpt.families import build_model
from glassgpt.families.layers import RMSNorm
from glassgpt.kinds import description_mismatches, norm_kind_by_behaviour
from glassgpt.model import LayerNorm

from glassgpt.explain import TraceOptions

from helpers import CHAR_TEXT, CHAR_TOK, TINY, check_description, randomize_, transformers_config
from readers import BOOK_TINY, NanoGPT, book_model, my_model

GPT2_SMALL = GPTConfig(vocab_size=61, context_length=16, emb_dim=32, n_heads=4, n_layers=2)
BOOK_CLASSES = {"qwen3": book_qwen.Qwen3Model, "llama3": book_llama.Llama3Model,
                "kv_cache.qwen3": book_kv_qwen.Qwen3Model, "kv_cache.llama3": book_kv_llama.Llama3Model,
                "kv_cache_batched.qwen3": book_batched_qwen.Qwen3Model}


def hf_gpt2(tie: bool = True) -> nn.Module:
    cfg = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def hf_family(family: str) -> nn.Module:
    cls = transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.LlamaForCausalLM
    return randomize_(cls(transformers_config(family, TINY[family])))


def book_family(name: str) -> nn.Module:
    family = name.rpartition(".")[2]
    torch.manual_seed(0)
    return randomize_(BOOK_CLASSES[name](TINY[family].to_book_dict(torch.float32)))


# name -> (build, the positions it has, the path of block 1's query matrix in the object)
KINDS = {
    "glass GPT-2": (lambda: glassgpt.GPTModel(GPT2_SMALL), "learned", "trf_blocks.1.att.W_query"),
    "glass GPT-2, untied": (lambda: glassgpt.GPTModel(dataclasses.replace(GPT2_SMALL, tie_embeddings=False)),
                            "learned", "trf_blocks.1.att.W_query"),
    "glass Qwen3": (lambda: build_model(TINY["qwen3"]), "rope", "trf_blocks.1.att.W_query"),
    "glass Llama 3.2": (lambda: build_model(TINY["llama3"]), "rope", "trf_blocks.1.att.W_query"),
    "book GPTModel": (book_model, "learned", "trf_blocks.1.att.W_query"),
    "book GPTModelFast": (lambda: book_ch04.GPTModelFast(BOOK_TINY), "learned", "trf_blocks.1.att.qkv"),
    "a reader's copy": (my_model, "learned", "trf_blocks.1.att.W_query"),
    "nanoGPT": (lambda: NanoGPT(), "learned", "transformer.h.1.attn.c_attn"),
    "nanoGPT without biases": (lambda: NanoGPT(bias=False), "learned", "transformer.h.1.attn.c_attn"),
    "transformers GPT2LMHeadModel": (hf_gpt2, "learned", "transformer.h.1.attn.c_attn"),
    "transformers GPT2LMHeadModel, untied": (lambda: hf_gpt2(tie=False), "learned", "transformer.h.1.attn.c_attn"),
    **{f"book {name}": (lambda name=name: book_family(name), "rope", "trf_blocks.1.att.W_query") for name in BOOK_CLASSES},
    "transformers Qwen3ForCausalLM": (lambda: hf_family("qwen3"), "rope", "model.layers.1.self_attn.q_proj"),
    "transformers LlamaForCausalLM": (lambda: hf_family("llama3"), "rope", "model.layers.1.self_attn.q_proj"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_is_described_by_paths_into_itself_and_agrees_with_its_module(kind):
    build, positions, query_path = KINDS[kind]
    model = build()
    anatomy = check_description(model)
    assert anatomy.positions.kind == positions
    assert anatomy.blocks[1].attention.query.path == query_path
    assert anatomy.n_layers == 2
    # every part is found through the description: the query matrix is the object's own tensor
    query = model.get_submodule(anatomy.blocks[1].attention.query.path).weight
    assert query.data_ptr() == dict(model.named_parameters())[query_path + ".weight"].data_ptr()


def test_the_glass_files_describe_the_three_models_as_the_book_builds_them():
    gpt2 = glassgpt.describe(glassgpt.GPTModel(GPT2_SMALL))
    qwen = glassgpt.describe(build_model(TINY["qwen3"]))
    llama = glassgpt.describe(build_model(TINY["llama3"]))
    assert (gpt2.positions.path, gpt2.blocks[0].placement, gpt2.blocks[0].norms[0].kind, gpt2.blocks[0].ff.kind) == (
        "pos_emb", "pre", "layernorm", "gelu_mlp")
    assert gpt2.blocks[0].attention.rope is None and gpt2.head.tied
    assert [n.kind for n in qwen.norms()][:4] == ["rmsnorm"] * 4 and qwen.blocks[0].attention.q_norm is not None
    assert (qwen.blocks[0].attention.n_heads, qwen.blocks[0].attention.n_kv_groups, qwen.blocks[0].ff.kind) == (4, 2, "swiglu")
    assert qwen.blocks[0].attention.rope.base == 10_000.0 and qwen.blocks[0].attention.rope.scaling is None
    assert llama.blocks[0].attention.q_norm is None and llama.blocks[0].attention.rope.scaling == "llama3"
    assert llama.final_norm.weight == "weight" and qwen.final_norm.weight == "scale"


def test_transformers_gpt2_is_described_as_slices_of_c_attn_stored_transposed():
    anatomy = check_description(hf_gpt2())
    att = anatomy.blocks[0].attention
    assert [(lin.path, lin.rows, lin.transposed) for lin in (att.query, att.key, att.value)] == [
        ("transformer.h.0.attn.c_attn", (0, 32), True), ("transformer.h.0.attn.c_attn", (32, 64), True),
        ("transformer.h.0.attn.c_attn", (64, 96), True)]
    assert anatomy.final_norm == an.Norm("transformer.ln_f", "layernorm", 32, 1e-5, "weight", "bias", "final")


def test_the_tie_is_told_by_storage_not_by_equal_values():
    model = glassgpt.GPTModel(dataclasses.replace(GPT2_SMALL, tie_embeddings=False))
    with torch.no_grad():
        model.out_head.weight.copy_(model.tok_emb.weight)  # equal values, two tensors
    assert not check_description(model).head.tied
    model.out_head.weight = model.tok_emb.weight  # one tensor
    assert check_description(model).head.tied


def test_a_norm_kind_is_told_by_what_the_module_computes():
    class PlusOne(nn.Module):  # Gemma's RMSNorm: (1 + weight) * x / rms
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16) * 0.1)

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    layer_norm, rms_norm, plus_one = randomize_(LayerNorm(16)), randomize_(RMSNorm(16)), PlusOne()
    assert norm_kind_by_behaviour(layer_norm, layer_norm.scale, layer_norm.shift, 1e-5) == "layernorm"
    assert norm_kind_by_behaviour(rms_norm, rms_norm.scale, None, 1e-6) == "rmsnorm"
    assert norm_kind_by_behaviour(plus_one, plus_one.weight, None, 1e-6) == "rmsnorm_plus_one"
    assert norm_kind_by_behaviour(nn.Identity(), rms_norm.scale, None, 1e-6) is None


def _first_block_changed(anatomy: an.Anatomy, **changes) -> an.Anatomy:
    return dataclasses.replace(anatomy, blocks=(dataclasses.replace(anatomy.blocks[0], **changes),) + anatomy.blocks[1:])


def test_a_description_that_disagrees_with_its_module_names_the_part_and_what_differs():
    model = randomize_(build_model(TINY["qwen3"]))
    right = check_description(model)
    att = right.blocks[0].attention
    norm = dataclasses.replace(right.blocks[0].norms[0], kind="layernorm")
    assert description_mismatches(model, _first_block_changed(right, norms=(norm, right.blocks[0].norms[1]))) == [
        "norm trf_blocks.0.norm1: computes rmsnorm on a probe, described layernorm"]
    assert description_mismatches(model, _first_block_changed(right, attention=dataclasses.replace(att, n_kv_groups=4))) == [
        "attention trf_blocks.0.att: 4 heads and 4 groups of 16 do not fill W_query's 64 and W_key's 32 rows"]
    wrong_key = dataclasses.replace(att, key=dataclasses.replace(att.key, out_features=64))
    assert description_mismatches(model, _first_block_changed(right, attention=wrong_key))[0] == (
        "matrix trf_blocks.0.att.W_key: [out, in] [32, 32], described [64, 32]")
    assert description_mismatches(model, dataclasses.replace(right, head=dataclasses.replace(right.head, tied=True))) == [
        "head out_head: described tied, but its weight does not share the embedding's storage"]
    moved = dataclasses.replace(right, final_norm=dataclasses.replace(right.final_norm, path="norm"))
    assert description_mismatches(model, moved) == ["norm: no module at 'norm'"]


@pytest.mark.parametrize("thing", [nn.Linear(4, 4), nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5)), "gpt2"])
def test_a_model_glassgpt_cannot_read_is_one_line_naming_what_it_looked_for_and_the_kinds_it_reads(thing):
    with pytest.raises(UnreadableModelError) as err:
        glassgpt.describe(thing)
    message = str(err.value)
    assert "\n" not in message and "looked for" in message or "must be an nn.Module" in message
    assert "Qwen3ForCausalLM" in message and "the book's" in message


def test_a_module_with_the_books_children_but_no_blocks_inside_is_one_line_not_an_attribute_error():
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb, self.pos_emb = nn.Embedding(5, 4), nn.Embedding(8, 4)
            self.trf_blocks, self.final_norm, self.out_head = nn.Sequential(nn.Identity()), nn.Identity(), nn.Linear(4, 5)

    with pytest.raises(UnreadableModelError, match="looked for"):
        glassgpt.describe(Half())


# --- one trace for every described object (issue 47 point 3) -----------------------------------

def _char_sized(cfg):
    return dataclasses.replace(cfg, vocab_size=CHAR_TOK.n_vocab)


def _own_next_token(model: nn.Module, text: str) -> int:
    with torch.no_grad():
        out = model(torch.tensor([CHAR_TOK.encode(text)]))
    logits = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
    return int(logits[0, -1].argmax())


TRACED = {
    "book Qwen3Model": lambda: randomize_(book_qwen.Qwen3Model(_char_sized(TINY["qwen3"]).to_book_dict(torch.float32))),
    "book Llama3Model": lambda: randomize_(book_llama.Llama3Model(_char_sized(TINY["llama3"]).to_book_dict(torch.float32))),
    "book kv_cache Qwen3Model": lambda: randomize_(
        book_kv_qwen.Qwen3Model(_char_sized(TINY["qwen3"]).to_book_dict(torch.float32))),
    "transformers Qwen3ForCausalLM": lambda: randomize_(transformers.Qwen3ForCausalLM(
        transformers_config("qwen3", _char_sized(TINY["qwen3"])))),
    "transformers LlamaForCausalLM": lambda: randomize_(transformers.LlamaForCausalLM(
        transformers_config("llama3", _char_sized(TINY["llama3"])))),
    "transformers GPT2LMHeadModel": lambda: randomize_(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=CHAR_TOK.n_vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4))),
    "nanoGPT": lambda: randomize_(NanoGPT(vocab_size=CHAR_TOK.n_vocab)),
}


@pytest.mark.parametrize("kind", list(TRACED))
@pytest.mark.parametrize("adopted_first", [False, True])
def test_trace_takes_the_object_as_the_reader_built_it_and_gives_its_own_next_token(kind, adopted_first):
    torch.manual_seed(0)
    model = TRACED[kind]()
    traced = glassgpt.adopt(model) if adopted_first else model
    tr = glassgpt.trace(traced, CHAR_TOK, CHAR_TEXT)
    assert tr.next_token["id"] == _own_next_token(model, CHAR_TEXT)


def test_the_books_qwen3_traced_directly_shows_its_heads_groups_and_attention():
    model = TRACED["book Qwen3Model"]()
    tr = glassgpt.trace(model, CHAR_TOK, CHAR_TEXT, options=TraceOptions(attention=True, logit_lens=True, top_k=3))
    t = len(CHAR_TOK.encode(CHAR_TEXT))
    assert tr.attention["q_shape"] == [1, 4, t, 16] and tr.attention["kv_shape"] == [1, 2, t, 16]
    assert tr.attention_weights["shape"] == [2, 4, t, t] and len(tr.next_tokens) == 3
    assert tr.logit_lens["layers"][-1]["top"][-1]["id"] == tr.next_token["id"]
    assert "Where does" in tr.to_text()


def test_trace_on_an_object_it_cannot_read_is_one_line_not_an_attribute_error():
    with pytest.raises(UnreadableModelError, match="looked for"):
        glassgpt.trace(nn.Sequential(nn.Embedding(5, 4)), CHAR_TOK, CHAR_TEXT)


@pytest.mark.parametrize("kind", ["book Qwen3Model", "book Llama3Model", "transformers Qwen3ForCausalLM"])
def test_why_takes_the_object_as_the_reader_built_it_and_its_parts_sum_to_its_own_logit(kind):
    model = TRACED[kind]()
    result = glassgpt.why(model, CHAR_TOK, CHAR_TEXT)
    assert result.target["id"] == _own_next_token(model, CHAR_TEXT)
    assert result.total == pytest.approx(result.metric, abs=1e-3 * max(1.0, abs(result.metric)))


def test_a_transformers_architecture_not_described_is_one_line_naming_it_and_the_kinds_read():
    cfg = transformers.MistralConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    with pytest.raises(UnreadableModelError) as err:
        glassgpt.describe(transformers.MistralForCausalLM(cfg))
    assert "\n" not in str(err.value) and "mistral" in str(err.value) and "LlamaForCausalLM" in str(err.value)


@pytest.mark.parametrize("kind", list(KINDS))
def test_only_glassgpts_own_glass_modules_are_described_by_their_own_file(kind):
    model = KINDS[kind][0]()
    own = an.own_description(model)
    if kind.startswith("glass "):
        assert own is not None and own.source == glassgpt.describe(model).source
        assert own.decoding in ("engine", "twin")  # how generate runs it over a cache
    else:  # a reader's module: read through a name map (kinds.describe), never taken as glassgpt's own
        assert own is None


def test_a_block_that_holds_a_config_is_not_taken_for_its_model():
    model = build_model(TINY["qwen3"])
    model.trf_blocks[0].cfg = model.cfg  # a config beside a block's children: no tok_emb among them
    assert an.own_description(model.trf_blocks[0]) is None
    assert an.own_description(model).name == "Qwen3"
