"""Qwen3.5 (issue 48): the notebook's model (ch05/16_qwen3.5) as families/qwen3_5.py writes it, against
transformers' Qwen3_5ForCausalLM on tiny random models saved with save_pretrained (nothing downloads).

Tolerances: float32 logits within 1e-5 of transformers', relative to the row's largest logit (the glass
model runs the gated delta rule token by token, transformers' torch path in chunks of 64: the same sums in
another order); cached against uncached within the same 1e-5 (the cache changes only how many tokens a
forward pass sees at once). transformers' fast path needs flash-linear-attention and causal-conv1d (GPU
kernels); neither is installed here, so it runs its torch reference (test_transformers_runs_its_torch_path).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt.engine.hybrid_cache import HybridCache, cache_for
from glassgpt.errors import ConfigError
from glassgpt.families import Qwen3_5Config, build_model
from glassgpt.families.qwen3_5 import cache_bytes, kv_bytes_per_token, state_bytes
from glassgpt.formats.families import load_family, load_family_tokenizer
from glassgpt.formats.family_tokenizers import QWEN_SPECIALS
from glassgpt.kinds import description_mismatches

from helpers import assert_one_line_error, run

V = 320
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"]


def hf_config(tie: bool = True, value_heads: int = 4, layer_types=LAYERS, **changes):
    from transformers import Qwen3_5TextConfig
    values = dict(vocab_size=V, max_position_embeddings=160, hidden_size=32, num_attention_heads=4,
                  num_hidden_layers=len(layer_types), intermediate_size=64, head_dim=8, num_key_value_heads=2,
                  linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                  linear_num_value_heads=value_heads, layer_types=list(layer_types), tie_word_embeddings=tie,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
    return Qwen3_5TextConfig(**(values | changes))


def tokenizer_json(path: Path) -> Path:
    """A small byte-level BPE with Qwen's special tokens, trained here (the `tokenizers` library)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(QWEN_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. " * 10], trainer)
    tok.save(str(path))
    return path


def hf_folder(path: Path, seed: int = 0, **changes) -> tuple[Path, torch.nn.Module]:
    """A random Qwen3_5ForCausalLM saved with save_pretrained, with a tokenizer.json; and the transformers model.
    Every weight is moved by N(0, 0.05) from transformers' initialisation (norms off zero, the decay's A_log and
    dt_bias included). Not much more: at 0.2 the delta rule's sums are so ill-conditioned that transformers'
    own chunked and recurrent forms part by 1.5e-4 (and the glass model sits within 1e-5 of the recurrent one)."""
    from transformers import Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    hf = Qwen3_5ForCausalLM(hf_config(**changes)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(path)
    tokenizer_json(path / "tokenizer.json")
    return path, hf


def ids(b: int = 2, t: int = 80, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest |difference| of a row, over that row's largest |logit|, worst row."""
    return float(((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max())


@pytest.fixture
def tiny(tmp_path):
    return hf_folder(tmp_path / "qwen3.5")


def test_transformers_runs_its_torch_path():
    """Without flash-linear-attention and causal-conv1d, transformers' GatedDeltaNet runs its torch code:
    the reference the parity tests compare against (installed, its CUDA/Triton kernels would run instead)."""
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None


# --- exact: logits and greedy tokens against transformers ----------------------------------------

@pytest.mark.parametrize("tie, value_heads", [(True, 4), (False, 2)])
@torch.no_grad()
def test_logits_equal_transformers_within_1e5(tmp_path, tie, value_heads):
    """80 tokens: across transformers' chunk of 64; value heads shared by key heads (4 of 2) or one each."""
    path, hf = hf_folder(tmp_path / "m", tie=tie, value_heads=value_heads)
    model = load_family(path)
    x = ids()
    assert relative_error(model(x), hf(x).logits) < 1e-5
    assert model.tied == tie


@torch.no_grad()
def test_greedy_tokens_equal_transformers_generate(tiny):
    path, hf = tiny
    model = load_family(path)
    prompt = ids(1, 7)
    theirs = hf.generate(prompt, max_new_tokens=24, do_sample=False)[0, 7:].tolist()
    assert glassgpt.generate(model, prompt, 24)[0, 7:].tolist() == theirs
    assert glassgpt.generate(model, prompt, 24, use_cache=False)[0, 7:].tolist() == theirs


@torch.no_grad()
def test_cli_generate_gives_transformers_greedy_tokens(tiny, capsys):
    path, hf = tiny
    code, out, _ = run(["generate", "the quick brown", "--model", str(path), "--max-new-tokens", "12", "--json"],
                       capsys)
    assert code == 0
    answer = json.loads(out)
    prompt = torch.tensor([answer["prompt_ids"]])
    theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert answer["new_ids"] == theirs


# --- the cache: full layers' keys and values, linear layers' state and convolution inputs -----------

@pytest.mark.parametrize("pieces", [(80,), (5, 1, 1, 1), (3, 4, 1, 9)])
@torch.no_grad()
def test_cached_logits_equal_uncached_at_every_step(tiny, pieces):
    """The prompt fed in pieces through a HybridCache gives the whole sequence's logits at every position."""
    model = load_family(tiny[0])
    t = sum(pieces)
    x = ids(2, t)
    whole = model(x)
    cache = cache_for(model.cfg, 2, t)
    assert isinstance(cache, HybridCache)
    start, steps = 0, []
    for n in pieces:
        steps.append(model(x[:, start:start + n], cache))
        start += n
    assert cache.pos == t
    assert relative_error(torch.cat(steps, dim=1), whole) < 1e-5


@torch.no_grad()
def test_linear_layers_keep_the_same_bytes_at_any_length(tiny):
    """After 4 tokens and after 60, the linear layers' states are the same size (state_bytes); only the full
    layers' keys and values grow, by kv_bytes_per_token a token."""
    model = load_family(tiny[0])
    cfg = model.cfg
    sizes = []
    for t in (4, 60):
        cache = HybridCache(cfg, 2, t)
        model(ids(2, t), cache)
        sizes.append(sum(s.nbytes for s in cache.conv + cache.state if s is not None))
        kv = sum(k.nbytes for k in cache.k + cache.v)
        assert kv == 2 * t * kv_bytes_per_token(cfg)
        assert cache.nbytes == cache_bytes(cfg, t, 2)
    assert sizes[0] == sizes[1] == 2 * state_bytes(cfg)


def test_real_shape_cache_bytes():
    """Qwen3.5 0.8B in bfloat16: 18 linear layers each keep 16 float32 states of 128 x 128 and the convolution's
    last 3 inputs of 6,144 channels; 6 full layers keep 2 groups of 256 for keys and values per token."""
    cfg = real_config()
    assert state_bytes(cfg, 2) == 18 * (16 * 128 * 128 * 4 + 6144 * 3 * 2) == 19_537_920
    assert kv_bytes_per_token(cfg, 2) == 6 * 2 * 2 * 256 * 2 == 12_288
    assert cache_bytes(cfg, 1000, 1, 2) == 19_537_920 + 1000 * 12_288


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_reads_the_state_and_the_convolution_buffer_from_the_description(dtype):
    """glassgpt.memory counts Qwen3.5's cache from its description (anatomy.RecurrentState), not from the glass
    file's functions: the figure equals cache_bytes and the bytes a filled HybridCache holds."""
    from glassgpt.memory import memory_needs, parameter_table
    book = {"vocab_size": V, "context_length": 160, "emb_dim": 32, "n_heads": 4, "n_layers": len(LAYERS),
            "hidden_dim": 64, "head_dim": 8, "qk_norm": True, "n_kv_groups": 2, "rope_base": 1e6,
            "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 3, "linear_key_head_dim": 8,
            "linear_value_head_dim": 6, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "layer_types": LAYERS}
    cfg = Qwen3_5Config.from_book_dict("qwen3_5", book, tie_embeddings=False)
    model = build_model(cfg).to(dtype)
    with torch.no_grad():
        cache = HybridCache(cfg, 2, 20, dtype=dtype)
        model(ids(2, 20), cache)
    size = torch.empty((), dtype=dtype).element_size()
    assert memory_needs(cfg, dtype, 2, 20)["kv_cache"] == cache_bytes(cfg, 20, 2, size) == cache.nbytes
    assert parameter_table(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert memory_needs(real_config(), torch.bfloat16, 1, 1000)["kv_cache"] == 19_537_920 + 1000 * 12_288


# --- the notebook's files: its state dict and config JSON ---------------------------------------

NOTEBOOK_KEYS_LINEAR = ["token_mixer.A_log", "token_mixer.conv1d.weight", "token_mixer.dt_bias",
                        "token_mixer.in_proj_a.weight", "token_mixer.in_proj_b.weight",
                        "token_mixer.in_proj_qkv.weight", "token_mixer.in_proj_z.weight", "token_mixer.norm.weight",
                        "token_mixer.out_proj.weight"]
NOTEBOOK_KEYS_FULL = ["token_mixer.W_key.weight", "token_mixer.W_query.weight", "token_mixer.W_value.weight",
                      "token_mixer.k_norm.weight", "token_mixer.out_proj.weight", "token_mixer.q_norm.weight"]
NOTEBOOK_KEYS_BLOCK = ["ff.fc1.weight", "ff.fc2.weight", "ff.fc3.weight", "norm1.weight", "norm2.weight"]


def notebook_config(layer_types=("linear_attention", "full_attention")) -> dict:
    """The notebook's QWEN3_5_CONFIG keys at a tiny size (its dtype as the string a JSON file holds)."""
    return {"vocab_size": V, "context_length": 64, "emb_dim": 32, "n_heads": 4, "n_layers": len(layer_types),
            "hidden_dim": 64, "head_dim": 8, "qk_norm": True, "n_kv_groups": 2, "rope_base": 10_000_000.0,
            "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 2, "dtype": "bfloat16", "layer_types": list(layer_types)}


def test_state_dict_names_are_the_notebooks():
    """The names the notebook's Qwen3_5Model has (and load_weights_into_qwen3_5 assigns), written out."""
    cfg = Qwen3_5Config.from_book_dict("qwen3_5", notebook_config())
    expected = ["final_norm.weight", "out_head.weight", "tok_emb.weight"]
    expected += [f"trf_blocks.0.{k}" for k in NOTEBOOK_KEYS_LINEAR + NOTEBOOK_KEYS_BLOCK]
    expected += [f"trf_blocks.1.{k}" for k in NOTEBOOK_KEYS_FULL + NOTEBOOK_KEYS_BLOCK]
    assert sorted(build_model(cfg).state_dict()) == sorted(expected)


@torch.no_grad()
def test_notebook_pth_with_its_config_json_loads_and_runs(tmp_path, tiny):
    """A state dict saved as the notebook saves one (tied head stored twice), its config dict beside it."""
    model = load_family(tiny[0])
    book = model.cfg.to_book_dict("float32")
    torch.save(model.state_dict(), tmp_path / "qwen3.5.pth")
    (tmp_path / "qwen3.5.json").write_text(json.dumps(book))
    loaded = load_family(tmp_path / "qwen3.5.pth")
    assert loaded.cfg.layer_types == model.cfg.layer_types
    assert torch.equal(loaded(ids(1, 20)), model(ids(1, 20)))


def test_config_round_trips_through_its_json():
    """What glassgpt writes beside a model's weights (to_dict) reads back as the same Qwen3_5Config."""
    from glassgpt.formats.glassgpt import config_from_values
    cfg = Qwen3_5Config.from_book_dict("qwen3_5", notebook_config())
    assert config_from_values(json.loads(json.dumps(cfg.to_dict())), "config.json") == cfg


@torch.no_grad()
def test_exported_folders_load_back_with_the_same_logits(tmp_path, tiny):
    """export_family_hf's folder in transformers, save_model's checkpoint in glassgpt: the same logits."""
    from transformers import Qwen3_5ForCausalLM
    from glassgpt.formats import load_model
    from glassgpt.formats.families import export_family_hf
    from glassgpt.formats.glassgpt import save_model
    model = load_family(tiny[0])
    x = ids(1, 30)
    theirs = Qwen3_5ForCausalLM.from_pretrained(export_family_hf(model, tmp_path / "hf")).eval()
    assert relative_error(model(x), theirs(x).logits) < 1e-5
    again = load_model(save_model(model, tmp_path / "ckpt"))
    assert torch.equal(again(x), model(x)) and again.tied


@torch.no_grad()
def test_a_llama_glassgpt_checkpoint_loads_back(tmp_path):
    """Llama 3's RMSNorm keeps `weight`, as Qwen3.5's does: glassgpt's reader (which renames GPT-2's old
    norm1.weight to norm1.scale) gives it its names back (before, its own checkpoint lacked 3 tensors)."""
    from glassgpt.families import family_config
    from glassgpt.formats import load_model
    from glassgpt.formats.glassgpt import save_model
    torch.manual_seed(0)
    model = build_model(family_config("llama3.2-1b", n_layers=1, vocab_size=64, emb_dim=32, n_heads=4, hidden_dim=64,
                                      n_kv_groups=2)).eval()
    x = torch.randint(0, 64, (1, 9))
    assert torch.equal(load_model(save_model(model, tmp_path / "ckpt"))(x), model(x))


# --- bad input: one line each ---------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["linear_attention"] * 3}, ("layer_types has 3 entries", "n_layers is 2")),
    ({"layer_types": ["linear_attention", "sliding_attention"]}, ("sliding_attention",)),
    ({"linear_num_value_heads": 3}, ("linear_num_value_heads (3)", "multiple")),
    ({"partial_rotary_factor": 0}, ("partial_rotary_factor",)),
])
def test_a_wrong_config_is_one_line(change, words):
    with pytest.raises(ConfigError) as err:
        Qwen3_5Config.from_book_dict("qwen3_5", notebook_config() | change)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


def test_a_vision_folder_is_refused_as_vision(tmp_path, capsys):
    folder = tmp_path / "vl"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                    "model_type": "qwen3_5", "vision_config": {"depth": 2},
                                                    "text_config": {"hidden_size": 32}}))
    code, _, err = run(["generate", "hi", "--model", str(folder)], capsys)
    assert_one_line_error(code, err, "vision")


@pytest.mark.parametrize("field, value, words", [
    ("attention_bias", True, ("attention_bias",)),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, ("rope_parameters.rope_type", "yarn")),
    ("hidden_act", "gelu", ("hidden_act",)),
])
def test_an_unimplemented_config_field_is_named(tmp_path, capsys, field, value, words):
    path, _ = hf_folder(tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {field: value}))
    capsys.readouterr()  # (save_pretrained's progress bar)
    code, _, err = run(["generate", "hi", "--model", str(path)], capsys)
    assert_one_line_error(code, err, *words)


# --- described, and traced ------------------------------------------------------------------------

def test_description_agrees_with_the_module(tiny):
    model = load_family(tiny[0])
    anatomy = glassgpt.describe(model)
    assert description_mismatches(model, anatomy) == []
    assert [b.layer_type for b in anatomy.blocks] == LAYERS
    assert [b.attention.kind for b in anatomy.blocks] == ["causal" if t == "full_attention" else "linear"
                                                         for t in LAYERS]
    assert {n.kind for n in anatomy.norms()} == {"rmsnorm_plus_one"}
    linear = anatomy.blocks[0].attention
    assert (linear.state.value_heads, linear.state.value_head_dim, linear.state.conv_kernel) == (4, 6, 3)
    full = anatomy.blocks[2].attention
    assert full.rope.rotary_dim == 2 and full.output_gate.head_rows == (16, 8, 16)


def test_a_wrong_description_of_the_gated_query_is_found(tiny):
    """The query's rows taken as a plain [h*hd, d] matrix (no gate rows between them) disagree with W_query."""
    from dataclasses import replace
    model = load_family(tiny[0])
    anatomy = glassgpt.describe(model)
    block = anatomy.blocks[2]
    wrong = replace(block, attention=replace(block.attention, query=replace(block.attention.query, head_rows=None)))
    found = description_mismatches(model, replace(anatomy, blocks=anatomy.blocks[:2] + (wrong,) + anatomy.blocks[3:]))
    assert any("W_query" in line for line in found)


@torch.no_grad()
def test_trace_names_the_models_own_next_token(tiny):
    path, _ = tiny
    model, tok = load_family(path), load_family_tokenizer(path)
    tr = glassgpt.trace(model, tok, "the quick brown")
    expected = int(model(torch.tensor([tok.encode("the quick brown")]))[0, -1].argmax())
    assert tr.next_token["id"] == expected
    assert tr.family == "qwen3_5"
    linear = next(stage for stage in tr.stages if stage["name"] == "linear attention")
    assert linear["shape"] == [1, 4, 8, 6] and "layers 0, 1, 3" in linear["note"]  # [b, hv, dk, dv]
    assert (tr.attention["rope_layers"], tr.attention["rope_dims"]) == ([2, 4], 2)  # RoPE: full layers, 2 of 8


def test_info_counts_every_parameter(tiny, capsys):
    from glassgpt.memory import parameter_table
    model = load_family(tiny[0])
    table = parameter_table(model.cfg)
    assert table["total"] == sum(p.numel() for p in model.parameters())  # the tied head counted once


# --- the real shape, random weights -----------------------------------------------------------------

def real_config() -> Qwen3_5Config:
    """Qwen3.5 0.8B's text model (the notebook's QWEN3_5_CONFIG), tied as the released weights are."""
    book = {"vocab_size": 248_320, "context_length": 262_144, "emb_dim": 1_024, "n_heads": 8, "n_layers": 24,
            "hidden_dim": 3_584, "head_dim": 256, "qk_norm": True, "n_kv_groups": 2, "rope_base": 10_000_000.0,
            "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 16, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    book["layer_types"] = book["layer_types"] * 6
    return Qwen3_5Config.from_book_dict("qwen3_5", book, tie_embeddings=True)


@pytest.mark.slow
@torch.no_grad()
def test_real_shape_logits_equal_transformers(tmp_path):
    """The 0.8B shape with random weights: logits within 1e-5 of transformers', cached equal to uncached."""
    from transformers import Qwen3_5ForCausalLM
    from glassgpt.formats.families import config_from_hf
    cfg = real_config()
    hf_cfg = hf_config(vocab_size=cfg.vocab_size, max_position_embeddings=cfg.context_length, hidden_size=1024,
                       num_attention_heads=8, num_hidden_layers=24, intermediate_size=3584, head_dim=256,
                       num_key_value_heads=2, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16, value_heads=16,
                       layer_types=list(cfg.layer_types),
                       rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    assert config_from_hf(json.loads((tmp_path / "config.json").read_text())) == cfg
    model = load_family(tmp_path)
    x = ids(1, 70)
    assert relative_error(model(x), hf(x).logits) < 1e-5
    cache = cache_for(cfg, 1, 70)
    steps = torch.cat([model(x[:, :60], cache)] + [model(x[:, i:i + 1], cache) for i in range(60, 70)], dim=1)
    assert relative_error(steps, model(x)) < 1e-5
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters())
