"""OLMo 3 and Tiny Aya (issue 48): the glass files against transformers' Olmo3ForCausalLM and Cohere2ForCausalLM.

Tiny random transformers models, saved with save_pretrained beside a tokenizer.json trained here (nothing
downloads), read through glassgpt's own doors (load_model, load_tokenizer, the CLI): float32 logits within
1e-5 of transformers' relative to the row's largest logit, greedy tokens equal to its generate, cached logits
equal to uncached ones at every step (the prompt longer than the window, so that the trimmed sliding cache
is what is read), the notebook's .pth with its config JSON, describe and trace, and the one-line refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt.errors import ConfigError, GlassError
from glassgpt.families import BONUS_MODELS, Olmo3Config, Olmo3Model, TinyAyaConfig, TinyAyaModel
from glassgpt.families.sliding import WindowKVCache
from glassgpt.formats.family_tokenizers import TokenizerJson
from glassgpt.kinds import description_mismatches

TEXT = ("The quick brown fox jumps over the lazy dog. Sliding layers see a window; full layers see it all. "
        "Ünïcödé and emoji 🙂 too.\n") * 20
SPECIALS = {"olmo3": ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
            "tiny_aya": ["<PAD>", "<UNK>", "<BOS_TOKEN>", "<EOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>",
                         "<|END_OF_TURN_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"]}
VOCAB = 320  # rows of tok_emb, and ids of the tokenizers below: every id the model picks decodes
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "attention_factor": 1.2079441541679836,
        "beta_fast": 32.0, "beta_slow": 1.0}


def hf_olmo3(rope: dict | None = None, tie: bool = False, **changes):
    from transformers import Olmo3Config as HFConfig, Olmo3ForCausalLM
    full = dict(rope or {"rope_type": "default"}, rope_theta=10_000.0)
    config = HFConfig(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                                sliding_window=4, layer_types=LAYERS, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                                rope_parameters={"full_attention": full, "sliding_attention":
                                                 {"rope_type": "default", "rope_theta": 10_000.0}},
                                pad_token_id=1, eos_token_id=0, bos_token_id=None), **changes})
    return Olmo3ForCausalLM(config)


def hf_aya(logit_scale: float = 0.0625, tie: bool = True, **changes):
    from transformers import Cohere2Config, Cohere2ForCausalLM
    config = Cohere2Config(**{**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     max_position_embeddings=64, sliding_window=4, layer_types=LAYERS,
                                     layer_norm_eps=1e-5, logit_scale=logit_scale, tie_word_embeddings=tie,
                                     rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
                                     pad_token_id=0, bos_token_id=2, eos_token_id=3), **changes})
    return Cohere2ForCausalLM(config)


def randomised(hf):
    """Norm weights away from 1, so a norm read in the wrong place shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return hf.eval()


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def make(family: str) -> Path:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS[family],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([TEXT], trainer)
        path = tmp_path_factory.mktemp(family) / "tokenizer.json"
        tok.save(str(path))
        return path
    return {family: make(family) for family in SPECIALS}


def saved(hf, folder: Path, tokenizer_json: Path) -> Path:
    torch.manual_seed(0)
    randomised(hf).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return folder


FOLDERS = {"olmo3": lambda: hf_olmo3(), "olmo3-yarn": lambda: hf_olmo3(YARN), "olmo3-tied": lambda: hf_olmo3(tie=True),
           "tiny_aya": lambda: hf_aya(), "tiny_aya-untied": lambda: hf_aya(1.0, tie=False)}


def family_of(kind: str) -> str:
    return kind.split("-")[0]


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| over each row, relative to that row's largest |logit|."""
    return float(((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max())


# --- exact against transformers ------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(FOLDERS))
def test_float32_logits_equal_transformers_within_1e_5_of_the_rows_largest(tmp_path, tokenizer_json, kind):
    hf = FOLDERS[kind]()
    folder = saved(hf, tmp_path / kind, tokenizer_json[family_of(kind)])
    model = glassgpt.load_model(folder)
    assert isinstance(model, BONUS_MODELS[family_of(kind)][0])
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > sliding_window and > 16
    with torch.no_grad():
        assert relative_error(model(ids), hf(ids).logits) < 1e-5


@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya"])
def test_greedy_tokens_equal_transformers_generate(tmp_path, tokenizer_json, kind):
    hf = FOLDERS[kind]()
    folder = saved(hf, tmp_path / kind, tokenizer_json[family_of(kind)])
    model = glassgpt.load_model(folder)
    prompt = torch.randint(4, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert glassgpt.generate(model, prompt, 20).tolist() == theirs.tolist()


@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya"])
def test_the_notebooks_pth_with_its_config_json_loads_to_the_same_logits(tmp_path, tokenizer_json, kind):
    """The notebook's state dict (its names: blocks/trf_blocks, post_*_layernorm, input_layernorm) saved with
    torch.save, its config dict beside it as JSON (dtype as a string): what a reader of the notebook has."""
    model = glassgpt.load_model(saved(FOLDERS[kind](), tmp_path / "hf", tokenizer_json[family_of(kind)]))
    pth = tmp_path / "nb" / "model.pth"
    pth.parent.mkdir()
    torch.save(model.state_dict(), pth)
    pth.with_suffix(".json").write_text(json.dumps(model.cfg.to_dict() | {"dtype": "bfloat16"}))
    again = glassgpt.load_model(pth)
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
    assert again.cfg == model.cfg


# --- the KV cache ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya"])
def test_cached_logits_equal_uncached_at_every_step(tmp_path, tokenizer_json, kind):
    model = glassgpt.load_model(saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json[family_of(kind)]))
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    cache = model.kv_cache(2, 30)
    with torch.no_grad():
        whole = model(ids)  # [2, 30, V]
        steps = [model(ids[:, :7], cache)[:, -1]] + [model(ids[:, j:j + 1], cache)[:, -1] for j in range(7, 30)]
    for j, logits in zip(range(6, 30), steps):
        torch.testing.assert_close(logits, whole[:, j], rtol=0, atol=1e-5)


def test_a_sliding_layers_cache_keeps_only_its_window_and_a_full_layers_every_position():
    cfg = Olmo3Config(vocab_size=50, context_length=64, emb_dim=16, n_heads=2, n_layers=4, hidden_dim=32, head_dim=8,
                      n_kv_heads=1, sliding_window=4, layer_types=LAYERS, rope_base=10_000.0)
    model = Olmo3Model(cfg).eval()
    cache = model.kv_cache(1, 40)
    with torch.no_grad():
        model(torch.arange(10)[None], cache)
        model(torch.tensor([[11]]), cache)
    assert cache.pos == 11 and [k.shape[2] for k in cache.k] == [4, 4, 40, 4]  # the full layer: allocated once


def test_a_window_cache_that_kept_every_position_would_give_other_logits():
    """The window is applied by the mask as well as the trim: the same keys kept whole give the same logits,
    and a window one wider gives others (so the cached-equals-uncached test reads the window)."""
    cfg = TinyAyaConfig(vocab_size=50, context_length=64, emb_dim=16, n_heads=2, n_layers=4, hidden_dim=32, head_dim=8,
                        n_kv_heads=1, sliding_window=4, layer_types=LAYERS, rope_base=10_000.0)
    torch.manual_seed(0)
    model = TinyAyaModel(cfg).eval()
    ids = torch.randint(0, 50, (1, 12))
    wider = TinyAyaModel(TinyAyaConfig(**{**cfg.to_dict(), "sliding_window": 5})).eval()
    wider.load_state_dict(model.state_dict())
    whole = WindowKVCache([None] * 4, cfg.kv_heads, 1, 12)  # every layer keeps every key
    with torch.no_grad():
        assert torch.allclose(model(ids, whole), model(ids), atol=1e-6)
        assert not torch.allclose(wider(ids), model(ids), atol=1e-3)


def test_a_sliding_layer_keeps_no_storage_past_its_window_after_a_long_prompt():
    """A 40-token prompt on a window of 4: a sliding layer's keys hold 4 positions, and so does their storage (a
    view of the prompt's 40 kept all 40 alive until the next step)."""
    cache = WindowKVCache([4, None], (1, 8), 1, 64, dtype=torch.float32)
    k = torch.randn(1, 1, 40, 8)
    cache.update(0, k, k.clone())
    assert cache.k[0].shape[2] == 4 and torch.equal(cache.k[0], k[:, :, -4:])
    assert cache.k[0].untyped_storage().nbytes() == cache.k[0].nbytes == 4 * 8 * 4
    assert cache.v[0].untyped_storage().nbytes() == cache.v[0].nbytes


# --- generate, the CLI, the tokenizer -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["olmo3", "tiny_aya"])
def test_glassgpt_generate_runs_the_folder_through_the_cli(tmp_path, tokenizer_json, kind, capsys):
    from glassgpt.cli import main
    folder = saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json[kind])
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["generate", "The quick", "--model", str(folder), "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    assert isinstance(tok, TokenizerJson) and out["prompt_ids"] == tok.encode("The quick")
    assert out["new_ids"] == glassgpt.generate(model, out["prompt_ids"], 5, use_cache=False)[0, -5:].tolist()


@pytest.mark.parametrize("family", ["olmo3", "tiny_aya"])
def test_the_tokenizer_gives_the_libraries_ids_the_notebooks_chat_wrap_and_decodes_back(tokenizer_json, family):
    from tokenizers import Tokenizer
    ours, theirs = TokenizerJson(tokenizer_json[family], family), Tokenizer.from_file(str(tokenizer_json[family]))
    text = "The quick brown fox 🙂"
    assert ours.encode(text) == theirs.encode(text).ids and ours.decode(ours.encode(text)) == text
    wrapped = ours.chat("Hi")
    first = {"olmo3": "<|im_start|>", "tiny_aya": "<BOS_TOKEN>"}[family]
    assert wrapped[0] == ours.specials[first] and ours.eot_id == ours.specials[SPECIALS[family][0 if family == "olmo3"
                                                                                                 else 3]]


# --- describe and trace ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya"])
def test_the_description_agrees_with_the_module_and_names_what_each_model_adds(tmp_path, tokenizer_json, kind):
    model = glassgpt.load_model(saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json[family_of(kind)]))
    anatomy = glassgpt.describe(model)
    assert description_mismatches(model, anatomy) == []
    assert [b.layer_type for b in anatomy.blocks] == LAYERS
    assert [b.attention.window for b in anatomy.blocks] == [4, 4, None, 4]
    if kind == "olmo3-yarn":
        assert {b.placement for b in anatomy.blocks} == {"post"}
        assert anatomy.blocks[0].attention.q_norm.dim == 32  # the whole projection, h * hd, not one head's hd
        assert [b.attention.rope.scaling for b in anatomy.blocks] == [None, None, "yarn", None]
    else:
        assert {b.placement for b in anatomy.blocks} == {"parallel"} and anatomy.final_norm.kind == "layernorm"
        assert [b.attention.rope is not None for b in anatomy.blocks] == [True, True, False, True]
        assert anatomy.blocks[0].attention.rope.pairs == "neighbours" and anatomy.head.logit_scale == 0.0625


def test_the_description_of_a_wrong_placement_or_norm_is_found():
    """description_mismatches reads the modules, so a description that says pre-RMSNorm for a LayerNorm is caught."""
    from dataclasses import replace
    cfg = TinyAyaConfig(vocab_size=50, context_length=64, emb_dim=16, n_heads=2, n_layers=4, hidden_dim=32, head_dim=8,
                        n_kv_heads=1, sliding_window=4, layer_types=LAYERS, rope_base=10_000.0)
    model = TinyAyaModel(cfg)
    anatomy = glassgpt.describe(model)
    wrong = replace(anatomy, final_norm=replace(anatomy.final_norm, kind="rmsnorm"))
    assert description_mismatches(model, wrong) != []


@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya"])
def test_trace_gives_the_models_own_next_token(tmp_path, tokenizer_json, kind):
    folder = saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json[family_of(kind)])
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    tr = glassgpt.trace(model, tok, "The quick brown fox jumps")
    with torch.no_grad():
        expected = int(model(torch.tensor([tok.encode("The quick brown fox jumps")]))[0, -1].argmax())
    assert tr.next_token["id"] == expected
    assert tr.head["max_abs_diff"] < 1e-5  # the logits are the head's dot products (times Tiny Aya's logit_scale)
    # RoPE turns every OLMo 3 layer; Tiny Aya's full layer (2) has no positions
    assert tr.attention["rope_layers"] == {"olmo3-yarn": [0, 1, 2, 3], "tiny_aya": [0, 1, 3]}[kind]
    name = {"olmo3-yarn": "OLMo 3", "tiny_aya": "Tiny Aya"}[kind]
    assert tr.to_text().startswith(f"{name}: 4 blocks, d 32, V {VOCAB}, 4 query heads, 2 key/value groups")


@pytest.mark.parametrize("kind", ["olmo3", "tiny_aya"])
def test_glassgpt_explain_prints_the_trace_of_the_folder(tmp_path, tokenizer_json, kind, capsys):
    from glassgpt.cli import main
    folder = saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json[kind])
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["explain", "The quick brown fox", "--model", str(folder), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    assert out["family"] == kind and out["next_tokens"][0]["id"] == glassgpt.trace(model, tok, "The quick brown fox").next_token["id"]


@pytest.mark.parametrize("fmt", ["pth", "hf", "gguf"])
def test_glassgpt_export_of_a_folder_it_writes_no_layout_for_is_one_line(tmp_path, tokenizer_json, fmt, capsys):
    # the description names no export layout (Anatomy.exports): GPT-2's writers never meet OLMo 3's parts
    from glassgpt.cli import main
    folder = saved(FOLDERS["olmo3"](), tmp_path / "olmo3", tokenizer_json["olmo3"])
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["export", str(folder), "--format", fmt, "--out", str(tmp_path / f"out.{fmt}")]) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("note:")]
    assert lines == [f"error: glassgpt does not export this model (OLMo 3) yet: --format {fmt} writes " + {
        "pth": "the book's class's state dict", "hf": "transformers' folder", "gguf": "GPT-2's llama.cpp layout"}[fmt]
                     + ", and that layout has no place for what it changes"]
    assert not (tmp_path / f"out.{fmt}").exists()


@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya"])
def test_glassgpt_info_counts_the_folders_parameters_as_the_model_holds_them(tmp_path, tokenizer_json, kind, capsys):
    from glassgpt.cli import main
    folder = saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json[family_of(kind)])
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["info", "--model", str(folder), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = glassgpt.load_model(folder)
    assert out["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    assert out["notes"][1].startswith("3 sliding layers (window 4), 1 full")
    assert out["memory"]["kv_cache"] == 2 * (3 * 4 + 64) * 2 * 8 * 4  # k and v, 3 windows of 4 + 64, 2 groups x 8


@pytest.mark.parametrize("kind, placement", [("olmo3", "post"), ("tiny_aya", "parallel")])
def test_why_splits_the_logit_of_a_post_norm_or_parallel_block_and_the_cli_prints_it(tokenizer_json, kind, placement,
                                                                                   tmp_path, capsys):
    """why on transformers' own module and, through the CLI, on its folder: the parts (each part's write after its
    own post-norm; Tiny Aya's logit scale in every term) sum to transformers' logit within 1e-4."""
    from glassgpt.cli import main
    hf = randomised(FOLDERS[kind]())
    tok = TokenizerJson(tokenizer_json[kind], kind)
    assert {b.placement for b in glassgpt.describe(hf).blocks} == {placement}
    w = glassgpt.why(hf, tok, "The quick brown fox")
    with torch.no_grad():
        logits = hf(torch.tensor([tok.encode("The quick brown fox")])).logits[0, -1]
    a = int(logits.argmax())
    assert w.target["id"] == a and abs(w.total - float(logits[a])) <= 1e-4 * max(1.0, abs(float(logits[a])))
    folder = saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json[kind])
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["explain", "--why", "--model", str(folder), "The quick brown fox", "--format", "json"]) == 0, \
        capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)["why"]
    assert abs(sum(p["value"] for p in data["parts"]) - data["target"]["logit"]) <= 1e-4 * max(1.0, abs(data["metric"]))
    assert main(["explain", "--why", "--model", str(folder), "The quick brown fox"]) == 0
    assert f"= sum of {len(data['parts'])} parts" in capsys.readouterr().out


# --- bad input: one line each ---------------------------------------------------------------------

@pytest.mark.parametrize("config", [Olmo3Config, TinyAyaConfig])
def test_a_layer_types_list_of_the_wrong_length_or_a_window_of_0_is_one_line(config):
    base = dict(vocab_size=50, context_length=64, emb_dim=16, n_heads=2, n_layers=4, hidden_dim=32, head_dim=8,
                n_kv_heads=1, sliding_window=4, layer_types=LAYERS, rope_base=10_000.0)
    with pytest.raises(ConfigError, match=r"layer_types must list one entry per layer \(4\), got 3"):
        config(**{**base, "layer_types": LAYERS[:3]})
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer.*got 0"):
        config(**{**base, "sliding_window": 0})
    with pytest.raises(ConfigError, match="layer_types holds 'linear_attention'"):
        config(**{**base, "layer_types": LAYERS[:3] + ["linear_attention"]})


@pytest.mark.parametrize("change, field", [
    ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "rope_parameters.full_attention.rope_type = 'dynamic'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}},
     "rope_parameters.sliding_attention.rope_theta"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
])
def test_a_folder_whose_config_uses_what_the_glass_file_lacks_is_one_line_naming_the_field(tmp_path, tokenizer_json,
                                                                                           change, field, capsys):
    from glassgpt.cli import main
    folder = saved(hf_olmo3(), tmp_path / "olmo", tokenizer_json["olmo3"])
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | change))
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(GlassError, match=field.replace(".", r"\.").replace("(", r"\(")):
        glassgpt.load_model(folder)
    assert main(["generate", "Hi", "--model", str(folder), "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert field.split(" = ")[0] in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_cohere2_config_with_a_rope_scaling_is_one_line_naming_it(tmp_path, tokenizer_json):
    folder = saved(hf_aya(), tmp_path / "aya", tokenizer_json["tiny_aya"])
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="rope_parameters.rope_type = 'linear' is not implemented"):
        glassgpt.load_model(folder)


def test_olmo3_7b_in_float32_on_24_gb_is_refused_with_the_figure_and_the_dtype_that_fits():
    from glassgpt.memory import Free, inference_fit
    layers = (["sliding_attention"] * 3 + ["full_attention"]) * 8
    cfg = Olmo3Config(vocab_size=100_278, context_length=65_536, emb_dim=4096, n_heads=32, n_layers=32,
                      hidden_dim=11_008, head_dim=128, n_kv_heads=32, sliding_window=4096, layer_types=layers,
                      rope_base=500_000.0, rope_type="yarn", rope_attention_factor=1.2079441541679836, rope_factor=8.0)
    refused = r"needs 2[789]\.\d GiB, \d+\.\d GiB with the margin .*, and this machine has 24\.0 GiB.*--dtype bfloat16 fits"
    with pytest.raises(ConfigError, match=refused):
        inference_fit(cfg, torch.float32, 100, Free(24 * 2**30, 0, "a test"))
    assert inference_fit(cfg, torch.bfloat16, 100, Free(24 * 2**30, 0, "a test")) is None


# --- the real shapes, random weights ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmo3", "tiny_aya"])
def test_the_real_shape_with_random_weights_equals_transformers_on_a_few_layers(family):
    """OLMo 3 7B's and Tiny Aya's real widths and vocabularies (one sliding and one full layer, to fit a test
    machine: about 10 GB for OLMo 3, 6 GB for Tiny Aya), random weights."""
    from transformers import Cohere2Config, Cohere2ForCausalLM, Olmo3Config as HFConfig, Olmo3ForCausalLM
    from glassgpt.families.bonus_hf import bonus_config_from_hf, bonus_hf_names
    TWO = ["sliding_attention", "full_attention"]
    if family == "olmo3":
        hf = Olmo3ForCausalLM(HFConfig(vocab_size=100_278, hidden_size=4096, intermediate_size=11_008,
                                       num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=32,
                                       max_position_embeddings=65_536, sliding_window=4096, layer_types=TWO,
                                       rms_norm_eps=1e-6, rope_parameters={
                                           "full_attention": dict(YARN, original_max_position_embeddings=8192,
                                                                  rope_theta=500_000.0),
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}}))
    else:
        hf = Cohere2ForCausalLM(Cohere2Config(vocab_size=262_144, hidden_size=2048, intermediate_size=11_008,
                                              num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                                              head_dim=128, max_position_embeddings=500_000, sliding_window=4096,
                                              layer_types=TWO, logit_scale=1.0,
                                              rope_parameters={"rope_type": "default", "rope_theta": 50_000.0}))
    hf = randomised(hf)
    cfg = bonus_config_from_hf(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
    own = hf.state_dict()
    state = {ours: own[theirs] for ours, theirs in bonus_hf_names(cfg)}
    with torch.device("meta"):
        model = BONUS_MODELS[family][0](cfg)
    model.load_state_dict(state, strict=False, assign=True)  # transformers' tensors themselves: no second copy
    model.tie_weights()
    ids = torch.randint(0, 1000, (1, 40))
    with torch.no_grad():
        assert relative_error(model.eval()(ids), hf(ids).logits) < 1e-5


@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya-untied"])
def test_transformers_module_is_described_in_its_own_names_and_agrees_with_itself(kind):
    hf = randomised(FOLDERS[kind]())
    anatomy = glassgpt.describe(hf)
    assert description_mismatches(hf, anatomy) == []
    assert anatomy.blocks[2].path == "model.layers.2" and anatomy.blocks[2].attention.query.path.endswith("q_proj")
    assert [b.layer_type for b in anatomy.blocks] == LAYERS and anatomy.head.tied is (kind == "olmo3-tied")


@pytest.mark.parametrize("kind", ["olmo3-yarn", "tiny_aya"])
def test_transformers_module_itself_is_traced_and_generated_from_in_place(tokenizer_json, kind):
    """glassgpt.trace and generate take transformers' module as it is: the glass model over its own tensors."""
    hf = randomised(FOLDERS[kind]())
    tok = TokenizerJson(tokenizer_json[family_of(kind)], family_of(kind))
    ids = tok.encode("The quick brown fox jumps")
    with torch.no_grad():
        theirs_next = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
    assert glassgpt.trace(hf, tok, "The quick brown fox jumps").next_token["id"] == theirs_next
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert glassgpt.generate(hf, ids, 8).tolist() == theirs.tolist()
    assert glassgpt.adopt(hf).tok_emb.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # nothing copied


@pytest.mark.parametrize("kind", ["olmo3", "tiny_aya"])
def test_transformers_module_whose_forward_is_not_the_described_one_is_refused_in_one_line(kind):
    """adopt checks the module's own logits against the glass model over its tensors: a forward that adds 1 to
    every logit (planted by a hook) is refused, naming the module and the largest difference."""
    hf = randomised(FOLDERS[kind]())

    def shifted(module, args, output):
        output.logits = output.logits + 1.0
        return output

    hf.register_forward_hook(shifted)
    with pytest.raises(GlassError, match=rf"transformers' {type(hf).__name__}'s weights does not give its logits "
                                         r"\(largest difference 1"):
        glassgpt.adopt(hf, [1, 2, 3, 4])
