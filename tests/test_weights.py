"""Loading and saving weights: HF layout in both directions, glassgpt checkpoints, and every bad file.

The tolerance for logits against transformers is an absolute 1e-4 in fp32 (TOL);
glassgpt's own save -> load round trip must be bit-exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import glassgpt
from glassgpt import GPTConfig, export_hf, load_meta, load_model, load_tokenizer, save_model
from glassgpt.errors import CheckpointError
from glassgpt.formats.files import atomic_write
from glassgpt.formats.hf import hf_state_dict

from conftest import make_hf_model, randomize_, save_hf_model
from helpers import Trap, assert_one_line_error, run

TOL = dict(atol=1e-4, rtol=0.0)  # fp32 logits vs transformers: max |diff| <= 1e-4
IDS = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(0))


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return getattr(out, "logits", out)


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name


@pytest.fixture
def glass_tiny(hf_tiny):
    return load_model(hf_tiny[1])


@pytest.fixture
def ckpt(tmp_path, glass_tiny):
    """A glassgpt checkpoint of the tiny model, and the model."""
    return save_model(glass_tiny, tmp_path / "ckpt"), glass_tiny


# --- Hugging Face layout -> glassgpt ------------------------------------------------------

def test_pytorch_model_bin_loads_like_safetensors(hf_tiny, tmp_path):
    hf, st_dir = hf_tiny
    bin_dir = save_hf_model(hf, tmp_path / "bin", safetensors=False)
    assert not (bin_dir / "model.safetensors").exists()
    from_bin = load_model(bin_dir)
    assert_same_weights(from_bin, load_model(st_dir))
    torch.testing.assert_close(logits(from_bin), logits(hf), **TOL)


def test_old_openai_style_names_and_mask_buffers_are_understood(hf_tiny, tmp_path):
    """openai-community/gpt2's pytorch_model.bin has no 'transformer.' prefix and stores
    each block's causal mask as h.N.attn.bias; both must load."""
    hf, _ = hf_tiny
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(hf.config.n_layer):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 96, 96))
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    path = tmp_path / "old"
    path.mkdir()
    hf.config.save_pretrained(path)
    torch.save(state, path / "pytorch_model.bin")
    torch.testing.assert_close(logits(load_model(path)), logits(hf), **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_load_model_converts_to_the_asked_dtype(hf_tiny, dtype):
    model = load_model(hf_tiny[1], dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.tied
    assert logits(model).dtype == dtype


def test_non_gpt2_hf_config_is_refused(hf_tiny, tmp_path):
    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "n_embd": 8}))
    save_file({"x": torch.zeros(1)}, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="llama"):
        load_model(path)


# --- glassgpt -> Hugging Face layout -> transformers --------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_export_hf_is_loaded_by_transformers_with_the_same_logits(tmp_path, tied):
    cfg = GPTConfig(vocab_size=101, context_length=40, emb_dim=48, n_heads=4, n_layers=2, tie_embeddings=tied)
    model = randomize_(load_model("gpt2", config=cfg), seed=5, std=0.1)
    export_hf(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.tie_word_embeddings is tied
    assert (hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()) is tied
    torch.testing.assert_close(logits(hf), logits(model), **TOL)
    # ... and glassgpt reads its own export back bit for bit.
    assert_same_weights(load_model(tmp_path / "hf"), model)


@pytest.mark.slow
def test_gpt2_124m_export_hf_is_loaded_by_transformers_with_the_same_logits(tmp_path):
    model = load_model("gpt2", seed=0)
    export_hf(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.num_parameters() == 124_439_808
    ids = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(hf, ids), logits(model, ids), **TOL)


def test_export_hf_of_qkv_bias_false_writes_zero_biases(tmp_path):
    cfg = GPTConfig(vocab_size=101, context_length=40, emb_dim=48, n_heads=4, n_layers=2, qkv_bias=False)
    model = randomize_(load_model("gpt2", config=cfg), seed=6, std=0.1)
    export_hf(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits(hf), logits(model), **TOL)


def test_hf_round_trip_of_a_transformers_model_is_bit_exact(hf_tiny, tmp_path):
    hf, path = hf_tiny
    export_hf(load_model(path), tmp_path / "again")
    theirs = {k: v for k, v in hf.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    ours = load_file(tmp_path / "again" / "model.safetensors")
    theirs.pop("lm_head.weight")  # tied: the hub files do not store it either
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_classifier_model_cannot_be_exported_to_hf(tmp_path):
    cfg = GPTConfig(vocab_size=11, context_length=8, emb_dim=8, n_heads=2, n_layers=1,
                    num_classes=2, tie_embeddings=False)
    with pytest.raises(CheckpointError, match="save_model"):
        export_hf(load_model("gpt2", config=cfg), tmp_path / "x")


# --- glassgpt checkpoints ---------------------------------------------------------------------

def test_save_then_load_is_bit_exact_and_tied_stays_tied(ckpt):
    path, model = ckpt
    loaded = load_model(path)
    assert loaded.cfg == model.cfg
    assert loaded.tied
    assert_same_weights(loaded, model)
    assert "out_head.weight" not in load_file(path / "model.safetensors")  # stored once
    assert not loaded.training


def test_untied_model_saves_and_loads_its_own_out_head(tmp_path, hf_tiny_untied):
    model = load_model(hf_tiny_untied[1])
    loaded = load_model(save_model(model, tmp_path / "u"))
    assert not loaded.tied
    assert_same_weights(loaded, model)


def test_bf16_checkpoint_loads_bit_exact(tmp_path, glass_tiny):
    model = glass_tiny.to(torch.bfloat16)
    loaded = load_model(save_model(model, tmp_path / "bf16"), dtype=torch.bfloat16)
    assert_same_weights(loaded, model)


def test_config_json_holds_the_books_field_names(ckpt):
    raw = json.loads((ckpt[0] / "config.json").read_text())
    assert raw["emb_dim"] == 48 and raw["n_layers"] == 3 and raw["tie_embeddings"] is True
    assert raw["glassgpt_version"] == glassgpt.__version__


def test_tokenizer_and_meta_travel_with_the_checkpoint(tmp_path, glass_tiny):
    tok = glassgpt.get_tokenizer("char", text="abcdefghij")
    path = save_model(glass_tiny, tmp_path / "c", tokenizer=tok, meta={"step": 7, "labels": ["a", "b"]})
    loaded_tok = load_tokenizer(path)
    assert loaded_tok.to_dict() == tok.to_dict()
    assert load_meta(path) == {"step": 7, "labels": ["a", "b"]}
    assert load_tokenizer(tmp_path / "c").encode("jab") == tok.encode("jab")


def test_checkpoint_without_tokenizer_gets_gpt2s(ckpt):
    assert load_tokenizer(ckpt[0]).n_vocab == 50257
    assert load_meta(ckpt[0]) == {}
    assert load_tokenizer("gpt2").n_vocab == 50257


def test_run_directory_with_latest_loads_it(tmp_path, glass_tiny):
    run = tmp_path / "run"
    save_model(glass_tiny, run / "latest", meta={"step": 100})
    assert_same_weights(load_model(run), glass_tiny)
    assert load_meta(run) == {"step": 100}


def test_run_directory_prefers_best_over_latest(tmp_path, glass_tiny, tiny_model):
    run = tmp_path / "run"
    save_model(tiny_model, run / "latest")
    save_model(glass_tiny, run / "best")
    assert load_model(run).cfg == glass_tiny.cfg


def test_save_overwrites_an_existing_checkpoint_and_leaves_no_temp_files(ckpt, tiny_model):
    path, _ = ckpt
    save_model(tiny_model, path)
    assert load_model(path).cfg == tiny_model.cfg
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    dest = tmp_path / "f.txt"
    dest.write_text("old")

    def fail(tmp):
        Path(tmp).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(dest, fail)
    assert dest.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_preset_spec_is_random_and_seeded():
    cfg = GPTConfig(vocab_size=101, context_length=16, emb_dim=32, n_heads=2, n_layers=2)
    a, b = load_model("gpt2", config=cfg, seed=1), load_model("gpt2", config=cfg, seed=1)
    assert_same_weights(a, b)  # seeded: the same seed, the same weights
    c = load_model("gpt2", config=cfg, seed=2)
    for (name, x), y in zip(a.state_dict().items(), c.state_dict().values()):
        if name.endswith(("W_query.weight", "tok_emb.weight", "ff.layers.0.weight")):
            assert not torch.equal(x, y), f"{name}: another seed drew the same weights"
            # random: GPT-2's N(0, 0.02), not zeros or a constant (4,096+ draws: the std is within 10%)
            assert 0.018 < float(x.std()) < 0.022, f"{name} has std {float(x.std()):.4f}"


def test_json_config_file_spec_builds_a_random_model(tmp_path):
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"vocab_size": 11, "context_length": 8, "emb_dim": 8, "n_heads": 2, "n_layers": 1}))
    assert load_model(str(path)).cfg.emb_dim == 8


# --- bad checkpoints: a clear CheckpointError that names the tensor -------------------------

def rewrite_tensors(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_tensor_is_named_with_its_shape(ckpt):
    path, _ = ckpt
    rewrite_tensors(path, lambda t: t.pop("trf_blocks.1.att.W_key.weight"))
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert "trf_blocks.1.att.W_key.weight" in str(err.value) and "[48, 48]" in str(err.value)
    assert "missing" in str(err.value)


def test_extra_tensor_is_named(ckpt):
    path, _ = ckpt
    rewrite_tensors(path, lambda t: t.update({"trf_blocks.9.secret": torch.zeros(2, 3)}))
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    assert "trf_blocks.9.secret" in str(err.value) and "[2, 3]" in str(err.value)


# In the file's own words: its tensor's name and the shape it has against the one expected (HF's
# Conv1D layout is [in, out]; its fused c_attn is one tensor of 3 x emb_dim).
WRONG_SHAPES = [
    ("glassgpt", "pos_emb.weight", (64, 48), r"pos_emb\.weight should be \[96, 48\], but .* it is \[64, 48\]"),
    ("hf", "transformer.h.0.mlp.c_fc.weight", (48, 100), r"h\.0\.mlp\.c_fc\.weight.*\[48, 100\].*\[48, 192\]"),
    ("hf", "transformer.h.2.attn.c_attn.weight", (48, 100), r"h\.2\.attn\.c_attn\.weight.*\[48, 100\].*\[48, 144\]"),
]


@pytest.mark.parametrize("layout, name, shape, message", WRONG_SHAPES, ids=[w[1] for w in WRONG_SHAPES])
def test_a_wrong_shaped_tensor_is_named_with_both_shapes(layout, name, shape, message, glass_tiny, hf_tiny, tmp_path):
    path = save_model(glass_tiny, tmp_path / "ckpt") if layout == "glassgpt" else save_hf_model(hf_tiny[0], tmp_path / "hf")
    rewrite_tensors(path, lambda t: t.update({name: torch.zeros(*shape)}))
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 100])
def test_truncated_safetensors_is_a_checkpoint_error(ckpt, keep):
    path, _ = ckpt
    data = (path / "model.safetensors").read_bytes()
    n = int(len(data) * keep) if keep < 1 else keep
    (path / "model.safetensors").write_bytes(data[:n])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(path)


def test_garbage_safetensors_is_a_checkpoint_error(ckpt):
    path, _ = ckpt
    (path / "model.safetensors").write_bytes(os.urandom(1000))
    with pytest.raises(CheckpointError):
        load_model(path)


@pytest.mark.parametrize("text", ["{broken", "[]", "", '{"emb_dim": 50, "n_heads": 3}', '{"colour": "red"}'])
def test_corrupt_config_json_is_a_checkpoint_error(ckpt, text):
    path, _ = ckpt
    (path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(path)


def test_config_without_weights_is_a_checkpoint_error(ckpt):
    path, _ = ckpt
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(path)


def test_bin_with_a_pickled_object_is_refused_and_never_run(hf_tiny, tmp_path):
    hf, _ = hf_tiny
    path = save_hf_model(hf, tmp_path / "evil", safetensors=False)
    marker = tmp_path / "pwned"
    state = dict(hf.state_dict())
    state["transformer.wte.weight"] = Trap(str(marker))
    torch.save(state, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        load_model(path)
    assert not marker.exists()


def test_truncated_bin_is_a_checkpoint_error(hf_tiny, tmp_path):
    path = save_hf_model(hf_tiny[0], tmp_path / "bin", safetensors=False)
    data = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load_model(path)


def test_directory_without_config_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


def test_a_file_instead_of_a_directory_is_a_checkpoint_error(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="directory"):
        load_model(f)


@pytest.mark.parametrize("spec", ["gpt5", "./no/such/dir", "/no/such/dir"])
def test_unknown_spec_lists_the_choices_without_network(spec, capsys):
    with pytest.raises(CheckpointError) as err:
        load_model(spec)
    assert "gpt2-medium" in str(err.value)
    # and on the command line, the same words in one line, exit code 2
    code, _, err_text = run(["generate", "Hi", "--model", spec], capsys)
    assert_one_line_error(code, err_text, f"no model {spec!r}", "gpt2-medium")


def test_hub_id_offline_says_where_to_put_the_files(monkeypatch, tmp_path):
    from huggingface_hub import constants
    # huggingface_hub reads HF_HUB_OFFLINE when it is imported: set the constant too.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf_home" / "hub"))
    with pytest.raises(CheckpointError) as err:
        load_model("nobody-here/no-such-gpt2")
    assert "nobody-here/no-such-gpt2" in str(err.value) and "model.safetensors" in str(err.value)


def test_hf_state_dict_uses_conv1d_layout(glass_tiny):
    sd = hf_state_dict(glass_tiny)
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (48, 144)
    assert sd["transformer.h.0.mlp.c_fc.weight"].shape == (48, 192)
    assert torch.equal(sd["transformer.h.0.mlp.c_fc.weight"], glass_tiny.trf_blocks[0].ff.layers[0].weight.t())


@pytest.mark.parametrize("field, value", [
    ("scale_attn_by_inverse_layer_idx", True), ("scale_attn_weights", False),
    ("layer_norm_epsilon", 1e-3), ("n_inner", 100), ("activation_function", "gelu"),
])
def test_an_hf_variant_that_changes_the_maths_is_refused_by_name(tmp_path, field, value):
    """GPT2Config has switches that change the maths; glassgpt must never load one silently wrong."""
    path = save_hf_model(make_hf_model(seed=2, **{field: value}), tmp_path / "variant")
    with pytest.raises(CheckpointError, match=field if field != "activation_function" else "activation 'gelu'"):
        load_model(path)


def test_the_tanh_gelu_under_its_other_hf_name_loads_and_matches_transformers(tmp_path):
    hf = make_hf_model(seed=2, activation_function="gelu_pytorch_tanh")
    torch.testing.assert_close(logits(load_model(save_hf_model(hf, tmp_path / "variant"))), logits(hf), **TOL)


def test_a_checkpoint_saved_before_the_books_layernorm_names_still_loads(tmp_path, tiny_model):
    # Older glassgpt checkpoints call the LayerNorm parameters weight/bias; the book's (and
    # today's) names are scale/shift.
    from safetensors.torch import load_file, save_file
    path = glassgpt.save_model(tiny_model, tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    old = {k.replace(".scale", ".weight").replace(".shift", ".bias"): v for k, v in state.items()}
    assert "trf_blocks.0.norm1.weight" in old and "final_norm.bias" in old
    save_file(old, path / "model.safetensors")
    loaded = glassgpt.load_model(path)
    ids = torch.randint(0, 97, (1, 8))
    torch.testing.assert_close(loaded(ids), tiny_model(ids), atol=0, rtol=0)


def test_read_config_reads_no_weights(tmp_path, tiny_model, hf_tiny, monkeypatch):
    from glassgpt.formats import files, read_config
    assert read_config("gpt2-xl") == glassgpt.PRESETS["gpt2-xl"]
    path = glassgpt.save_model(tiny_model, tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    (path / "model.safetensors").write_bytes(data[:header] + b"\xff" * (len(data) - header))  # the header alone is intact
    monkeypatch.setattr(files, "safe_open", None)  # reading a tensor would fail
    assert read_config(path) == tiny_model.cfg
    assert read_config(hf_tiny[1]).emb_dim == 48
    assert read_config("openai-community/gpt2") is None


# --- random weights say so ------------------------------------------------------------------

def test_a_preset_warns_that_its_weights_are_random():
    with pytest.warns(glassgpt.RandomWeightsWarning, match="gpt2 has random weights"):
        load_model("gpt2")


def test_the_random_weights_warning_is_shown_by_pythons_default_filters(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps({"vocab_size": 11, "context_length": 8, "emb_dim": 8,
                                                    "n_heads": 2, "n_layers": 1}))
    code = "import glassgpt; glassgpt.load_model('tiny.json')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": ""})
    assert proc.returncode == 0 and "RandomWeightsWarning: tiny.json has random weights" in proc.stderr


def test_a_config_file_warns_and_a_checkpoint_does_not(tmp_path):
    import warnings

    cfg = GPTConfig(vocab_size=101, context_length=16, emb_dim=16, n_heads=2, n_layers=1)
    config_file = tmp_path / "small.json"
    config_file.write_text(json.dumps(cfg.to_dict()))
    with pytest.warns(glassgpt.RandomWeightsWarning, match="small.json has random weights"):
        model = load_model(str(config_file))
    path = save_model(model, tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error", glassgpt.RandomWeightsWarning)
        load_model(path)
        load_model("gpt2", config=cfg)  # an explicit config: the caller built it on purpose


def test_written_files_get_the_permissions_a_plain_open_would_give(ckpt):
    path, _ = ckpt
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        assert (path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name  # not mkstemp's owner-only 0600
