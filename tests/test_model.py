"""GPTModel, the glass model: GPT-2's parameter counts, the book's pieces, parity with transformers.

Parity: a random `GPT2LMHeadModel` (every parameter random, see conftest) is saved with
`save_pretrained` and loaded through glassgpt's own `load_model`; in fp32 the logits
and the output of every transformer block must agree to an absolute 1e-4
(TOL below), so a failure names the first block that differs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import glassgpt
from glassgpt import PRESETS, GPTConfig, GPTModel
from glassgpt.errors import PromptError
from glassgpt.model import GELU, LayerNorm, MultiHeadAttention, attention_weights

from conftest import layer_norm_and_input, make_hf_model, save_hf_model

TOL = dict(atol=1e-4, rtol=0.0)  # fp32 logits / block outputs: max |diff| <= 1e-4


# --- parameter counts (built on the meta device: no memory, instant) ---------------------

def meta_model(cfg: GPTConfig) -> GPTModel:
    with torch.device("meta"):
        return GPTModel(cfg)


@pytest.mark.parametrize("name, expected", [
    ("gpt2", 124_439_808),
    ("gpt2-medium", 354_823_168),
    ("gpt2-large", 774_030_080),
    ("gpt2-xl", 1_557_611_200),
])
def test_parameter_counts_equal_gpt2s(name, expected):
    model = meta_model(PRESETS[name])
    assert model.tied
    assert model.num_parameters() == expected
    assert sum(p.numel() for p in model.parameters()) == expected
    untied = expected + PRESETS[name].vocab_size * PRESETS[name].emb_dim
    assert model.num_parameters(count_tied_twice=True) == untied


def test_gpt2_untied_has_163_037_184_parameters():
    assert meta_model(PRESETS["gpt2"]).num_parameters(count_tied_twice=True) == 163_037_184
    untied = meta_model(dataclasses.replace(PRESETS["gpt2"], tie_embeddings=False))
    assert not untied.tied
    assert untied.num_parameters() == 163_037_184
    assert untied.num_parameters(count_tied_twice=True) == 163_037_184


def test_tied_out_head_is_tok_emb_one_tensor():
    model = meta_model(PRESETS["gpt2"])
    assert model.out_head.weight is model.tok_emb.weight
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "out_head.weight" not in names


def test_modules_carry_the_books_names(tiny_model):
    cfg = tiny_model.cfg
    assert isinstance(tiny_model.tok_emb, torch.nn.Embedding)
    assert tiny_model.tok_emb.weight.shape == (cfg.vocab_size, cfg.emb_dim)
    assert tiny_model.pos_emb.weight.shape == (cfg.context_length, cfg.emb_dim)
    assert len(tiny_model.trf_blocks) == cfg.n_layers
    block = tiny_model.trf_blocks[0]
    for name in ("norm1", "att", "norm2", "ff", "drop_shortcut"):
        assert hasattr(block, name)
    for name in ("W_query", "W_key", "W_value", "out_proj"):
        assert isinstance(getattr(block.att, name), torch.nn.Linear)
    assert tiny_model.out_head.bias is None
    assert tiny_model.out_head.weight.shape == (cfg.vocab_size, cfg.emb_dim)


def test_qkv_bias_false_drops_the_biases():
    model = meta_model(GPTConfig(vocab_size=11, context_length=8, emb_dim=8, n_heads=2, n_layers=1, qkv_bias=False))
    assert model.trf_blocks[0].att.W_query.bias is None
    assert model.trf_blocks[0].att.out_proj.bias is not None


def test_classifier_head_has_num_classes_outputs():
    cfg = GPTConfig(vocab_size=11, context_length=8, emb_dim=8, n_heads=2, n_layers=1,
                    num_classes=3, tie_embeddings=False)
    model = GPTModel(cfg).eval()
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 3)


def test_reset_parameters_is_seeded_and_follows_gpt2_init(tiny_config):
    a = glassgpt.load_model("gpt2", config=tiny_config, seed=3)
    b = glassgpt.load_model("gpt2", config=tiny_config, seed=3)
    c = glassgpt.load_model("gpt2", config=tiny_config, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
    block = a.trf_blocks[0]
    assert torch.all(block.norm1.scale == 1) and torch.all(block.norm1.shift == 0)
    assert torch.all(block.att.W_query.bias == 0)
    assert a.tied
    # Residual projections are scaled down by 1/sqrt(2 * n_layers); others use std 0.02.
    big = glassgpt.load_model("gpt2", config=dataclasses.replace(tiny_config, emb_dim=256, n_layers=8), seed=0)
    assert big.trf_blocks[0].ff.layers[0].weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert big.trf_blocks[0].att.out_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)


# --- forward properties -----------------------------------------------------------------

def test_forward_maps_ids_to_logits_of_shape_b_t_V(tiny_model):
    ids = torch.randint(0, 97, (3, 7))
    logits = tiny_model(ids)
    assert logits.shape == (3, 7, 97)
    assert logits.dtype == torch.float32


def test_layer_norm_is_the_books_formula():
    # scale * (x - mean) / sqrt(var + eps) + shift with the biased variance, written as the book
    # writes it, so the same inputs give the same bits (engine/fused.py has the one-kernel form).
    norm, x = layer_norm_and_input()
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=False)
    expected = norm.scale * ((x - mean) / torch.sqrt(var + 1e-5)) + norm.shift
    assert torch.equal(norm(x), expected)
    assert [n for n, _ in norm.named_parameters()] == ["scale", "shift"]


def test_gelu_is_the_books_formula_with_its_float32_constant():
    x = torch.randn(1000) * 4
    expected = 0.5 * x * (1 + torch.tanh(torch.sqrt(torch.tensor(2.0 / torch.pi)) * (x + 0.044715 * torch.pow(x, 3))))
    assert torch.equal(GELU()(x), expected)


def test_attention_weights_are_causal_rows_that_sum_to_one():
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    w = attention_weights(q, k)
    assert w.shape == (2, 3, 6, 6)
    assert torch.all(w.triu(diagonal=1) == 0)  # no token looks ahead
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 6))
    # Row 0 can only attend to token 0.
    assert torch.all(w[..., 0, 0] == 1)


def test_attention_weights_of_the_last_queries_are_the_last_rows_of_the_full_weights():
    # With a cache, t queries sit at the last t of s positions: their rows are those of the full
    # [s, s] weights, bit for bit (the same scores, the same mask, the same softmax).
    torch.manual_seed(0)
    q, k = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    assert torch.equal(attention_weights(q[..., 4:, :], k), attention_weights(q, k)[..., 4:, :])


def test_the_glass_model_imports_nothing_from_the_engine():
    # model.py must stand alone: the KV cache, the fused kernels and int8 live in glassgpt.engine.
    # (GPTModel.forward takes the engine's cache, duck-typed, as the book's KV-cache chapter does.)
    import ast
    import inspect

    import glassgpt.model as model_module
    tree = ast.parse(inspect.getsource(model_module))
    imported = {node.module or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}  # `from . import anatomy`: the module is the name
    # anatomy.py is the model's description (plain data, the model layer), never the engine
    assert imported <= {"__future__", "anatomy", "config", "errors", "torch", "torch.nn.functional"}, imported


def test_embedding_equals_one_hot_matmul(tiny_model):
    ids = torch.tensor([[3, 0, 96, 3]])
    one_hot = torch.nn.functional.one_hot(ids, 97).float()
    torch.testing.assert_close(tiny_model.tok_emb(ids), one_hot @ tiny_model.tok_emb.weight)


def test_attention_is_causal(tiny_model):
    ids = torch.randint(0, 97, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 97
    # Same shapes, same kernels: the earlier positions must not move beyond float32 round-off.
    torch.testing.assert_close(tiny_model(ids)[:, :8], tiny_model(changed)[:, :8], atol=1e-5, rtol=0)
    assert not torch.allclose(tiny_model(ids)[:, 8:], tiny_model(changed)[:, 8:])


def test_rows_of_a_batch_are_independent(tiny_model):
    ids = torch.randint(0, 97, (4, 10))
    batched = tiny_model(ids)
    for i in range(4):
        torch.testing.assert_close(batched[i:i + 1], tiny_model(ids[i:i + 1]), atol=1e-5, rtol=0)


def test_dropout_acts_only_in_training_mode(tiny_config):
    model = glassgpt.load_model("gpt2", config=dataclasses.replace(tiny_config, drop_rate=0.5), seed=0)
    ids = torch.randint(0, 97, (2, 10))
    torch.testing.assert_close(model(ids), model(ids))  # eval: deterministic
    model.train()
    torch.manual_seed(0)
    first = model(ids)
    assert not torch.allclose(first, model(ids))


def test_input_longer_than_context_is_a_prompt_error(tiny_model):
    ctx = tiny_model.cfg.context_length
    tiny_model(torch.zeros(1, ctx, dtype=torch.long))  # exactly the context fits
    with pytest.raises(PromptError) as err:
        tiny_model(torch.zeros(1, ctx + 1, dtype=torch.long))
    assert f"{ctx + 1}" in str(err.value) and f"{ctx}" in str(err.value)


# --- parity with transformers ---------------------------------------------------------------

def block_outputs(blocks, run) -> list[torch.Tensor]:
    """Run `run()` with a forward hook on each block; return each block's output."""
    outputs: list[torch.Tensor] = []

    def hook(module, args, output):
        outputs.append((output[0] if isinstance(output, tuple) else output).detach())

    handles = [b.register_forward_hook(hook) for b in blocks]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return outputs


def assert_matches_hf(hf, model, ids):
    """Every block's output, then the logits, agree with transformers' to TOL."""
    hf_blocks = block_outputs(hf.transformer.h, lambda: hf(ids))
    ours = block_outputs(model.trf_blocks, lambda: model(ids))
    assert len(ours) == len(hf_blocks) == model.cfg.n_layers
    for i, (a, b) in enumerate(zip(ours, hf_blocks)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"trf_blocks[{i}] differs from h.{i}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **TOL, msg=lambda m: f"logits differ: {m}")


def test_small_config_matches_transformers_block_by_block(hf_tiny):
    hf, path = hf_tiny
    model = glassgpt.load_model(path, device="cpu", dtype="float32")
    assert model.cfg == GPTConfig(vocab_size=101, context_length=96, emb_dim=48, n_heads=4, n_layers=3)
    assert model.tied
    ids = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(0))
    assert_matches_hf(hf, model, ids)


def test_untied_small_config_matches_transformers(hf_tiny_untied):
    hf, path = hf_tiny_untied
    model = glassgpt.load_model(path, device="cpu", dtype="float32")
    assert not model.cfg.tie_embeddings and not model.tied
    torch.testing.assert_close(model.out_head.weight, hf.lm_head.weight, atol=0, rtol=0)
    ids = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(1))
    assert_matches_hf(hf, model, ids)


def test_full_context_matches_transformers(hf_tiny):
    hf, path = hf_tiny
    model = glassgpt.load_model(path)
    ids = torch.randint(0, 101, (1, 96), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, **TOL)


@pytest.fixture(scope="module")
def hf_124m(tmp_path_factory):
    """A random GPT-2 124M (HF), every parameter drawn at GPT-2's std 0.02, saved to disk."""
    hf = make_hf_model(seed=0, std=0.02, vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("hf_124m"))


@pytest.mark.slow
def test_gpt2_124m_matches_transformers_block_by_block(hf_124m):
    hf, path = hf_124m
    model = glassgpt.load_model(path, device="cpu", dtype="float32")
    assert model.cfg == PRESETS["gpt2"]
    assert model.num_parameters() == 124_439_808
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    assert_matches_hf(hf, model, ids)


def test_the_initialisation_once_called_book_is_pytorch_default_by_either_name():
    from glassgpt.model import INIT_SCHEMES
    cfg = GPTConfig(vocab_size=97, context_length=8, emb_dim=16, n_heads=2, n_layers=1, tie_embeddings=False)
    models = [GPTModel(cfg) for _ in range(2)]
    models[0].reset_parameters(5, "pytorch-default")
    models[1].reset_parameters(5, "book")
    assert "book" not in INIT_SCHEMES and "PyTorch's defaults" in INIT_SCHEMES["pytorch-default"]
    assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()))
