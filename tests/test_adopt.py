"""adopt(): a reader's own module (the book's GPTModel, a copy of it, nanoGPT's GPT, transformers'
GPT2LMHeadModel) read in place, checked against its own logits, and used by every function.

Tolerances: logits equal to the module's own within 1e-5 absolute (float32; the book's formulas
are model.py's, and nanoGPT's F.layer_norm and fused attention differ in the last bits only).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import glassgpt
from glassgpt.adopt import adopt, adopted_from
from glassgpt.errors import GlassError, UnreadableModelError
from glassgpt.training import evaluate_text
from llms_from_scratch import ch04

from conftest import make_hf_model, randomize_
from readers import BOOK_TINY, PROMPT, NanoGPT, book_model, my_model


def storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in module.parameters()}


def own_logits(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = module(ids)
    out = out[0] if isinstance(out, tuple) else out
    return getattr(out, "logits", out)


def fast_model() -> nn.Module:
    torch.manual_seed(0)
    return ch04.GPTModelFast(BOOK_TINY)  # the book's variant: one qkv matrix, nn.LayerNorm, no mask buffers


READERS = {"book": book_model, "fast": fast_model, "copy": my_model, "nanogpt": NanoGPT,
           "hf": lambda: make_hf_model(seed=0)}


@pytest.mark.parametrize("kind", ["book", "fast", "copy", "nanogpt", "hf"])
def test_each_kind_is_read_in_place_and_gives_its_own_logits(kind):
    module = READERS[kind]().eval()
    ids = torch.tensor([PROMPT]) % (module.transformer.wte.num_embeddings if kind == "hf" else 50257)
    glass = adopt(module, ids)
    theirs = own_logits(module, ids)
    with torch.no_grad():
        ours = glass(ids)[:, -theirs.shape[1]:]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert {p.untyped_storage().data_ptr() for p in glass.parameters()} <= storages(module)  # nothing copied
    assert adopted_from(glass) is not None


def test_nanogpt_built_without_biases_gets_zeros_and_says_so():
    module = randomize_(NanoGPT(bias=False), std=0.3).eval()
    glass = adopt(module, torch.tensor([PROMPT]))
    torch.testing.assert_close(glass(torch.tensor([PROMPT]))[:, -1:], own_logits(module, torch.tensor([PROMPT])),
                               rtol=0, atol=1e-5)
    assert "has no bias on some layers" in adopted_from(glass) and "no shift" in adopted_from(glass)
    assert not glass.cfg.qkv_bias


@pytest.mark.parametrize("bias", [False, True])
def test_a_trace_counts_the_modules_own_parameters_and_names_its_kind(bias):
    """nanoGPT's bias=False: the zeros glassgpt adds for the missing biases are not the reader's parameters."""
    module = NanoGPT(bias=bias).eval()
    tr = glassgpt.trace(module, glassgpt.get_tokenizer("gpt2"), "Every effort moves you")
    assert tr.params["total"] == sum(p.numel() for p in module.parameters())  # a tied matrix once, as here
    assert tr.stage("trf_blocks.0").params == sum(p.numel() for p in module.transformer.h[0].parameters())
    assert tr.stage("trf_blocks.0.att.out_proj").module.endswith("bias=False)") is not bias
    assert ("zero biases glassgpt added" in tr.params.get("note", "")) is not bias
    assert tr.model["name"] == "nanoGPT's GPT" and "model nanoGPT's GPT" in tr.to_text()
    assert glassgpt.trace(module, glassgpt.get_tokenizer("gpt2"), "Every",
                          about=glassgpt.explain.About("mine")).model["name"] == "mine"


def test_a_copy_with_a_tensor_glassgpt_does_not_have_is_one_line():
    module = book_model()
    module.trf_blocks[0].att.gate = nn.Parameter(torch.ones(4))
    with pytest.raises(GlassError, match=r"has a tensor glassgpt's GPT-2 does not: trf_blocks.0.att.gate \[4\]"):
        adopt(module)


def test_the_config_is_read_from_tensors_and_attributes():
    cfg = adopt(book_model()).cfg
    assert (cfg.vocab_size, cfg.context_length, cfg.emb_dim, cfg.n_heads, cfg.n_layers) == (50257, 32, 64, 4, 2)
    assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.drop_rate) == (False, False, 0.1)
    nano = adopt(NanoGPT(n_head=8)).cfg
    assert (nano.n_heads, nano.qkv_bias, nano.tie_embeddings, nano.vocab_size) == (8, True, True, 50304)
    hf = adopt(make_hf_model(seed=0, n_head=6)).cfg
    assert (hf.n_heads, hf.tie_embeddings, hf.emb_dim) == (6, True, 48)


def test_a_change_to_the_modules_weights_is_seen_at_once():
    module = book_model()
    glass = adopt(module)
    with torch.no_grad():
        module.trf_blocks[1].ff.layers[0].weight.add_(1.0)
    assert torch.equal(glass.trf_blocks[1].ff.layers[0].weight, module.trf_blocks[1].ff.layers[0].weight)


def test_trace_of_the_books_model_names_its_kind_and_its_next_token():
    module = book_model()
    tok = glassgpt.get_tokenizer("gpt2")
    tr = glassgpt.trace(module, tok, "Every effort moves you")
    assert tr.notes[0].startswith("the book's GPTModel")
    assert tr.next_token["id"] == int(own_logits(module.eval(), torch.tensor([PROMPT]))[0, -1].argmax())


def test_a_module_in_training_mode_is_traced_in_eval_mode_and_left_as_found():
    module = book_model().train()
    module.trf_blocks[0].att.eval()  # a mixed state, to be given back as it was
    before = [m.training for m in module.modules()]
    tr = glassgpt.trace(module, glassgpt.get_tokenizer("gpt2"), "Every effort moves you")
    assert [m.training for m in module.modules()] == before
    expected = own_logits(module.eval(), torch.tensor([PROMPT]))[0, -1].softmax(-1).max()
    assert tr.next_token["top"][0]["prob"] == pytest.approx(float(expected), rel=1e-5)


def test_generate_with_the_books_model_gives_the_books_tokens():
    module = book_model().eval()
    ids = torch.tensor([PROMPT])
    book = ch04.generate_text_simple(module, ids, max_new_tokens=6, context_size=32)
    assert torch.equal(glassgpt.generate(module, ids, max_new_tokens=6), book)
    assert torch.equal(glassgpt.generate(module, ids, max_new_tokens=6, use_cache=False), book)


def test_eval_of_the_books_model_equals_eval_of_its_saved_state_dict(tmp_path):
    module = book_model()
    torch.save(module.state_dict(), tmp_path / "model.pth")
    ids = torch.randint(0, 50257, (400,), generator=torch.Generator().manual_seed(0)).numpy()
    loaded = glassgpt.load_model(str(tmp_path / "model.pth"), device="cpu", n_heads=4)  # shapes cannot tell it
    ours = evaluate_text(module, ids, 32, batch_size=2, eval_batches=3)
    theirs = evaluate_text(loaded, ids, 32, batch_size=2, eval_batches=3)
    assert ours[1] == theirs[1] == 6
    assert ours[0] == pytest.approx(theirs[0], abs=1e-6)


def test_a_module_that_computes_something_else_is_refused_and_pointed_to_check():
    module = my_model("no_mask")
    with pytest.raises(GlassError, match=r"glassgpt.check\(model\)") as err:
        glassgpt.trace(module, glassgpt.get_tokenizer("gpt2"), "Every effort moves you")
    assert "\n" not in str(err.value)
    with pytest.raises(GlassError, match="does not give its logits"):  # the verdict is kept for the module
        glassgpt.generate(module, torch.tensor([PROMPT]), max_new_tokens=2)


def test_a_module_of_no_known_kind_is_one_line_naming_what_is_looked_for_and_its_children():
    module = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    with pytest.raises(GlassError) as err:
        glassgpt.generate(module, [1, 2], max_new_tokens=1)
    message = str(err.value)
    assert "tok_emb" in message and "transformer.wte" in message and "children are: 0, 1" in message
    assert "\n" not in message


def test_adopts_message_for_an_unknown_module_names_every_kind_it_reads():
    # adopt reads GPT-2's kinds and the next models' (Qwen3, Llama 3.2, Gemma 3) alike: its one line says so.
    with pytest.raises(UnreadableModelError) as err:
        adopt(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)))
    message = str(err.value)
    for kind in ("GPT2LMHeadModel", "Qwen3ForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3Model",
                 "Llama3Model", "nanoGPT's GPT", "model.embed_tokens", "transformer.wte", "children are: 0, 1"):
        assert kind in message, kind
    assert "\n" not in message


def test_a_bfloat16_module_works_and_mixed_dtypes_get_one_line():
    module = book_model().to(torch.bfloat16)
    out = glassgpt.generate(module, torch.tensor([PROMPT]), max_new_tokens=3)
    assert out.shape == (1, 7)
    mixed = book_model()
    mixed.out_head.to(torch.float64)
    with pytest.raises(GlassError, match=r"float32 and float64: give them one dtype first"):
        adopt(mixed)
    split = book_model()
    split.out_head.to("meta")  # stands for a second device on a machine with one
    with pytest.raises(GlassError, match=r"on cpu and meta: move it to one device first"):
        adopt(split)  # read only; run (trace), its meta tensors are named first (test_broken_weights.py)


# --- load_model(spec, config=...): the file's weights under a config that fits them, or a refusal ----

def test_load_model_with_a_fitting_config_uses_the_files_weights(tmp_path):
    module = book_model()
    torch.save(module.state_dict(), tmp_path / "model.pth")
    cfg = glassgpt.GPTConfig.from_dict({**readers_cfg(), "tie_embeddings": False})
    model = glassgpt.load_model(str(tmp_path / "model.pth"), config=cfg)
    assert model.cfg == cfg
    state = module.state_dict()
    assert all(torch.equal(t, state[name]) for name, t in model.state_dict().items())


@pytest.mark.parametrize("field, value", [("context_length", 1024), ("context_length", 16), ("n_layers", 3),
                                          ("qkv_bias", True), ("tie_embeddings", True)])
def test_load_model_with_a_config_that_does_not_fit_refuses_naming_the_field(tmp_path, field, value):
    torch.save(book_model().state_dict(), tmp_path / "model.pth")
    cfg = glassgpt.GPTConfig.from_dict({**readers_cfg(), "tie_embeddings": False, field: value})
    with pytest.raises(glassgpt.GlassError, match=f"holds weights for {field} ") as err:
        glassgpt.load_model(str(tmp_path / "model.pth"), config=cfg)
    assert "\n" not in str(err.value)


def readers_cfg() -> dict:
    from readers import BOOK_TINY
    return dict(BOOK_TINY)


def test_the_readmes_reader_gets_the_books_shapes_and_the_checks_verdict(tmp_path):
    """The README's notebook block, run as written, on the book's own GPTModel."""
    import re
    import subprocess
    import sys
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("**2. Your notebook.**"):]
    code = re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600).stdout.splitlines()
    assert out[0].startswith("the book's GPTModel (vocab_size 50257, context_length 256, emb_dim 256, n_heads 4")
    assert out[0].endswith("read in place")
    assert out[1] == "[1, 4, 256] [1, 4, 50257]"
    assert out[2].startswith("matches the book's formulas at every stage")