"""memory_needs counts what the model and its cache really hold (measured peaks: benchmarks/bench_memory.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import glassgpt
from glassgpt.memory import memory_needs, parameter_counts
from glassgpt.engine import KVCache, quantize_int8
from glassgpt.model import GPTModel
from glassgpt.weights import random_model

SMALL = glassgpt.GPTConfig(vocab_size=300, context_length=32, emb_dim=48, n_heads=4, n_layers=3)
VARIANTS = [SMALL, dataclasses.replace(SMALL, qkv_bias=False),
            dataclasses.replace(SMALL, tie_embeddings=False),
            dataclasses.replace(SMALL, tie_embeddings=False, num_classes=3)]


def stored_bytes(model: torch.nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("name", list(glassgpt.PRESETS))
def test_parameter_counts_equal_the_models_for_every_preset(name):
    cfg = glassgpt.PRESETS[name]
    with torch.device("meta"):
        model = GPTModel(cfg)
    counts = parameter_counts(cfg)
    assert counts["linear"] + counts["other"] == model.num_parameters()
    assert memory_needs(cfg)["parameters"] == model.num_parameters()


@pytest.mark.parametrize("cfg", VARIANTS, ids=["tied", "no-qkv-bias", "untied", "classifier"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_exactly_the_bytes_the_model_stores(cfg, dtype):
    model = random_model(cfg, torch.device("cpu"), dtype)
    assert memory_needs(cfg, dtype)["weights"] == stored_bytes(model)


@pytest.mark.parametrize("cfg", VARIANTS[:3], ids=["tied", "no-qkv-bias", "untied"])
def test_int8_weights_are_exactly_the_bytes_a_quantized_model_stores(cfg):
    model = quantize_int8(random_model(cfg, torch.device("cpu"), torch.float32))
    assert memory_needs(cfg, "int8")["weights"] == stored_bytes(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_is_exactly_a_real_kv_caches_bytes(dtype):
    cache = KVCache(SMALL, batch_size=3, max_len=20, dtype=dtype)
    needs = memory_needs(SMALL, dtype, batch_size=3, seq_len=20)
    assert needs["kv_cache"] == cache.nbytes


def test_training_is_the_sum_of_its_parts_and_grows_with_the_batch():
    one = memory_needs(glassgpt.PRESETS["gpt2"], "float32", batch_size=1, seq_len=256)
    four = memory_needs(glassgpt.PRESETS["gpt2"], "float32", batch_size=4, seq_len=256)
    assert one["training"] == one["weights"] + one["gradients"] + one["adamw_state"] + one["activations"]
    assert one["gradients"] == one["weights"] and one["adamw_state"] == 2 * one["weights"]
    assert four["activations"] > 3.9 * one["activations"] - 4 * one["weights"]  # activations scale with b
    assert four["weights"] == one["weights"] and four["inference"] > one["inference"]


def test_bfloat16_halves_every_float32_count():
    f32 = memory_needs(glassgpt.PRESETS["gpt2"], torch.float32, 2, 128)
    bf16 = memory_needs(glassgpt.PRESETS["gpt2"], "bfloat16", 2, 128)
    for key in ("weights", "kv_cache", "gradients", "adamw_state"):
        assert bf16[key] * 2 == f32[key]


def test_seq_len_defaults_to_the_context_and_every_count_has_a_note():
    needs = memory_needs(glassgpt.PRESETS["gpt2"], torch.float32)
    assert needs["seq_len"] == 1024 and needs["batch_size"] == 1 and needs["dtype"] == "float32"
    counts = ("weights", "kv_cache", "inference", "gradients", "adamw_state", "activations", "training")
    assert set(needs["notes"]) == set(counts)
    assert all(isinstance(needs[k], int) and needs[k] > 0 for k in counts)


def test_an_unknown_dtype_is_an_error_that_names_it():
    with pytest.raises(glassgpt.GlassError, match="int4"):
        memory_needs(SMALL, "int4")
