"""Gemma 4 (issue 48): the glass file against transformers' Gemma4ForCausalLM, the dense text model.

Tiny random transformers models (6 layers: sliding and full alternating, the last 3 kv-shared with double-wide
MLPs, per-layer inputs, proportional RoPE on the full layers, a logit softcap), saved with save_pretrained
beside a tokenizer.json trained here (nothing downloads), read through glassgpt's own doors (load_model,
load_tokenizer, the CLI): float32 logits within 1e-5 of transformers' relative to the row's largest logit,
greedy tokens equal to its generate, cached logits equal to uncached ones at every step (past the window of 4,
so the trimmed sliding cache is what is read), the kv-shared layers reading their source layer's cache, the
notebook's .pth with its config JSON, describe and trace, and the one-line refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import glassgpt
from glassgpt.errors import ConfigError, GlassError
from glassgpt.families import Gemma4Config, Gemma4DenseModel
from glassgpt.families.gemma4 import get_gemma4_dense_config
from glassgpt.formats.family_tokenizers import TokenizerJson
from glassgpt.kinds import description_mismatches
from helpers import check_description

TEXT = ("The quick brown fox jumps over the lazy dog. Sliding layers see a window; full layers see it all. "
        "Ünïcödé and emoji 🙂 too.\n") * 20
SPECIALS = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]
VOCAB = 320  # rows of tok_emb and of the per-layer table, and ids of the tokenizer below
LAYERS = ["sliding_attention", "full_attention"] * 3
SHARED_FROM = [None, None, None, 1, 2, 1]  # the last 3 layers read the last earlier layer of their type


def hf_gemma4(**changes):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    values = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                  max_position_embeddings=64, sliding_window=4, layer_types=LAYERS, hidden_size_per_layer_input=8,
                  num_kv_shared_layers=3, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                   "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                                      "partial_rotary_factor": 0.25}})
    return Gemma4ForCausalLM(Gemma4TextConfig(**{**values, **changes}, attn_implementation="eager"))


def randomised(hf):
    """Norm weights and layer_scalars away from 1, so one read in the wrong place shows."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return hf.eval()


PLAIN = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
             final_logit_softcapping=None, rope_parameters={
                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
FOLDERS = {"e2b-like": lambda: hf_gemma4(), "untied": lambda: hf_gemma4(tie_word_embeddings=False),
           "plain": lambda: hf_gemma4(**PLAIN)}


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path_factory.mktemp("gemma4") / "tokenizer.json"
    tok.save(str(path))
    return path


def saved(hf, folder: Path, tokenizer_json: Path) -> Path:
    randomised(hf).save_pretrained(folder)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return folder


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """max |ours - theirs| over each row, relative to that row's largest |logit|."""
    return float(((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max())


def tiny_config(**changes) -> Gemma4Config:
    values = dict(vocab_size=50, emb_dim=16, hidden_dim=32, n_layers=6, n_heads=2, head_dim=8, n_kv_heads=1,
                  global_head_dim=16, context_length=64, sliding_window=4, layer_types=LAYERS,
                  vocab_size_per_layer_input=50, hidden_size_per_layer_input=4, num_kv_shared_layers=3,
                  use_double_wide_mlp=True, final_logit_softcap=30.0)
    return Gemma4Config(**{**values, **changes})


# --- exact against transformers ------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(FOLDERS))
def test_float32_logits_equal_transformers_within_1e_5_of_the_rows_largest(tmp_path, tokenizer_json, kind):
    hf = FOLDERS[kind]()
    folder = saved(hf, tmp_path / kind, tokenizer_json)
    model = glassgpt.load_model(folder)
    assert isinstance(model, Gemma4DenseModel)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > sliding_window
    with torch.no_grad():
        assert relative_error(model(ids), hf(ids).logits) < 1e-5


def test_the_kv_shared_layers_read_their_source_and_not_their_own_matrices(tmp_path, tokenizer_json):
    """transformers' file has no k_proj, v_proj, k_norm in the shared layers; the notebook's class keeps them (zeros
    here) and never reads them: other values there change nothing, the source layer's values change the logits."""
    model = glassgpt.load_model(saved(hf_gemma4(), tmp_path / "hf", tokenizer_json))
    assert [b.att.kv_shared_layer_index for b in model.blocks] == SHARED_FROM
    assert float(model.blocks[3].att.k_proj.weight.detach().abs().sum()) == 0.0
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))

    def shared_outputs() -> dict[int, torch.Tensor]:
        seen = {}
        hooks = [model.blocks[i].att.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, out))
                 for i in (3, 5)]
        model(ids)
        for h in hooks:
            h.remove()
        return seen

    with torch.no_grad():
        before, seen = model(ids), shared_outputs()
        for i in (3, 4, 5):
            model.blocks[i].att.k_proj.weight.normal_()
            model.blocks[i].att.v_proj.weight.normal_()
        assert torch.equal(model(ids), before)
        model.blocks[1].att.v_proj.weight.mul_(2.0)  # the full source layer: read by layers 3 and 5
        again = shared_outputs()
    assert not torch.allclose(again[3], seen[3]) and not torch.allclose(again[5], seen[5])


@pytest.mark.parametrize("kind", ["e2b-like", "plain"])
def test_greedy_tokens_equal_transformers_generate(tmp_path, tokenizer_json, kind):
    hf = FOLDERS[kind]()
    folder = saved(hf, tmp_path / kind, tokenizer_json)
    model = glassgpt.load_model(folder)
    prompt = torch.randint(5, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert glassgpt.generate(model, prompt, 20).tolist() == theirs.tolist()


def test_the_notebooks_pth_with_its_config_json_loads_to_the_same_logits(tmp_path, tokenizer_json):
    """The notebook's state dict (blocks.{i}.att.q_proj, mlp.gate_proj, layer_scalar, the shared layers' unread
    k_proj too) saved with torch.save, its config dict beside it as JSON with the keys its tests pass and the
    notebook never reads (dtype as a string, qk_norm, n_kv_groups, query_pre_attn_scalar)."""
    model = glassgpt.load_model(saved(hf_gemma4(tie_word_embeddings=False), tmp_path / "hf", tokenizer_json))
    pth = tmp_path / "nb" / "model.pth"
    pth.parent.mkdir()
    torch.save(model.state_dict(), pth)
    book = model.cfg.to_dict() | {"dtype": "float32", "qk_norm": True, "n_kv_groups": 2, "query_pre_attn_scalar": 1.0}
    pth.with_suffix(".json").write_text(json.dumps(book))
    again = glassgpt.load_model(pth)
    assert again.cfg == model.cfg and isinstance(again, Gemma4DenseModel)
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))
    fresh = Gemma4DenseModel(model.cfg)
    fresh.load_state_dict(torch.load(pth), strict=True)  # the notebook's names, every one, nothing more


def test_the_notebooks_two_configs_have_its_shapes():
    e2b, e4b = get_gemma4_dense_config("E2B"), get_gemma4_dense_config("E4B")
    assert (e2b.emb_dim, e2b.n_layers, e2b.n_kv_heads, e2b.num_kv_shared_layers, e2b.use_double_wide_mlp) == \
        (1536, 35, 1, 20, True)
    assert (e4b.emb_dim, e4b.n_layers, e4b.n_kv_heads, e4b.num_kv_shared_layers, e4b.use_double_wide_mlp) == \
        (2560, 42, 2, 18, False)
    assert e2b.layer_types.count("full_attention") == e4b.layer_types.count("full_attention") == 7
    # E2B's shared sliding layers read layer 13 (the last sliding one before 15), the full ones layer 14
    assert e2b.kv_shared_from[15:20] == (13, 13, 13, 13, 14)
    assert e2b.hidden_dim_of(14) == 6144 and e2b.hidden_dim_of(15) == 12_288



@pytest.mark.parametrize("size", ["E2B", "E4B"])
def test_transformers_config_of_the_real_models_reads_back_as_the_notebooks(size):
    """At 35 and 42 layers transformers keys per_layer_config (the full layers' head_dim 512) by zero-padded
    indices ("04"): read back, each is the notebook's config, field for field."""
    from transformers import Gemma4TextConfig
    from glassgpt.families.bonus_hf import gemma4_config_from_hf
    nb = get_gemma4_dense_config(size)
    theirs = Gemma4TextConfig(
        vocab_size=262_144, vocab_size_per_layer_input=262_144, hidden_size=nb.emb_dim, intermediate_size=nb.hidden_dim,
        num_hidden_layers=nb.n_layers, num_attention_heads=8, num_key_value_heads=nb.n_kv_heads, head_dim=256,
        global_head_dim=512, max_position_embeddings=131_072, sliding_window=512, layer_types=list(nb.layer_types),
        hidden_size_per_layer_input=256, num_kv_shared_layers=nb.num_kv_shared_layers,
        use_double_wide_mlp=nb.use_double_wide_mlp, final_logit_softcapping=30.0, tie_word_embeddings=True)
    raw = json.loads(json.dumps(theirs.to_dict()))  # as config.json holds it
    assert {"04", "05"} & set(raw["per_layer_config"])  # E2B's first full layer is 4, E4B's 5
    assert gemma4_config_from_hf(raw | {"architectures": ["Gemma4ForCausalLM"]}) == nb

# --- the KV cache ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["e2b-like", "plain"])
def test_cached_logits_equal_uncached_at_every_step(tmp_path, tokenizer_json, kind):
    model = glassgpt.load_model(saved(FOLDERS[kind](), tmp_path / kind, tokenizer_json))
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    cache = model.kv_cache(2, 30)
    with torch.no_grad():
        whole = model(ids)  # [2, 30, V]
        steps = [model(ids[:, :7], cache)[:, -1]] + [model(ids[:, j:j + 1], cache)[:, -1] for j in range(7, 30)]
    for j, logits in zip(range(6, 30), steps):
        torch.testing.assert_close(logits, whole[:, j], rtol=0, atol=1e-5)


def test_sliding_layers_keep_their_window_full_layers_every_position_and_shared_layers_nothing():
    torch.manual_seed(0)
    model = Gemma4DenseModel(tiny_config()).eval()
    cache = model.kv_cache(1, 40)
    with torch.no_grad():
        model(torch.arange(10)[None], cache)
        model(torch.tensor([[11]]), cache)
    assert cache.pos == 11
    assert [None if k is None else tuple(k.shape) for k in cache.k] == [
        (1, 1, 4, 8), (1, 1, 40, 16), (1, 1, 4, 8), None, None, None]  # full layers: global_head_dim, allocated once


def test_a_shared_layer_attends_over_what_its_source_layer_keeps_in_the_cache():
    """Decoding one token, each kv-shared layer is handed its source layer's cached keys and values (the sliding
    source's last window and the new token; the full source's every position), not keys of its own."""
    torch.manual_seed(0)
    model = Gemma4DenseModel(tiny_config()).eval()
    cache = model.kv_cache(1, 40)
    handed = {}

    def record(i):
        def hook(module, args, kwargs):
            handed[i] = args[4][module.kv_shared_layer_index]  # shared_kv: the forward's {source: (keys, values)}
        return hook

    hooks = [model.blocks[i].att.register_forward_pre_hook(record(i), with_kwargs=True) for i in (3, 4, 5)]
    with torch.no_grad():
        model(torch.arange(10)[None], cache)
        kept = {i: (cache.k[i].clone(), cache.v[i].clone()) for i in (1, 2)}  # before the step
        model(torch.tensor([[11]]), cache)
    for h in hooks:
        h.remove()
    keys, values = handed[4]  # the sliding source (2): its 4 kept positions, then the new one
    assert keys.shape[2] == 5 and torch.equal(keys[:, :, :4], kept[2][0]) and torch.equal(values[:, :, :4], kept[2][1])
    for i in (3, 5):  # the full source (1): every position so far, as its cache holds them
        keys, values = handed[i]
        assert torch.equal(keys, cache.k[1][:, :, :11]) and torch.equal(values[:, :, :10], kept[1][1][:, :, :10])


# --- generate, the CLI, the tokenizer -----------------------------------------------------------

def test_glassgpt_generate_runs_the_folder_through_the_cli(tmp_path, tokenizer_json, capsys):
    from glassgpt.cli import main
    folder = saved(hf_gemma4(), tmp_path / "g4", tokenizer_json)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["generate", "The quick", "--model", str(folder), "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    assert isinstance(tok, TokenizerJson) and out["prompt_ids"] == tok.encode("The quick")
    assert out["new_ids"] == glassgpt.generate(model, out["prompt_ids"], 5, use_cache=False)[0, -5:].tolist()


def test_the_tokenizer_gives_the_libraries_ids_the_chat_wrap_and_the_end_token(tokenizer_json):
    from tokenizers import Tokenizer
    ours, theirs = TokenizerJson(tokenizer_json, "gemma4"), Tokenizer.from_file(str(tokenizer_json))
    text = "The quick brown fox 🙂"
    assert ours.encode(text) == theirs.encode(text).ids and ours.decode(ours.encode(text)) == text
    wrapped = ours.chat("Hi")
    assert wrapped[:2] == [ours.specials["<bos>"], ours.specials["<|turn>"]] and ours.eot_id == ours.specials["<eos>"]


# --- describe, trace, info ------------------------------------------------------------------------

def test_the_description_agrees_with_the_module_and_names_what_gemma4_adds(tmp_path, tokenizer_json):
    model = glassgpt.load_model(saved(hf_gemma4(), tmp_path / "g4", tokenizer_json))
    anatomy = check_description(model)
    assert [b.layer_type for b in anatomy.blocks] == LAYERS
    assert [b.attention.kv_shared_from for b in anatomy.blocks] == SHARED_FROM
    assert anatomy.blocks[3].attention.key.path == "blocks.1.att.k_proj"  # a shared layer's keys: its source's
    assert [b.attention.head_dim for b in anatomy.blocks] == [8, 16] * 3
    assert [b.ff.hidden_dim for b in anatomy.blocks] == [64] * 3 + [128] * 3  # double-wide in the shared layers
    full = anatomy.blocks[1].attention.rope
    assert (full.scaling, full.rotary_dim, full.head_dim) == ("proportional", 4, 16)  # a quarter of 8 pairs turn
    assert {b.placement for b in anatomy.blocks} == {"sandwich"} and anatomy.final_norm.kind == "rmsnorm"
    assert anatomy.blocks[0].attention.scale == 1.0 and anatomy.head.softcap == 30.0 and anatomy.head.tied
    assert anatomy.embedding.scale == pytest.approx(32 ** 0.5)
    assert anatomy.embedding.per_layer == "embed_tokens_per_layer"
    # the weightless value norm, a shared layer's its source's; layer_scalar, one stored number per block
    assert [b.attention.v_norm.path for b in anatomy.blocks[2:4]] == ["blocks.2.att.v_norm", "blocks.1.att.v_norm"]
    assert anatomy.blocks[0].attention.v_norm.weight is None and anatomy.blocks[0].attention.v_norm.kind == "rmsnorm"
    assert {b.output_scale for b in anatomy.blocks} == {"layer_scalar"}
    own = anatomy.blocks[0].per_layer_input
    assert (own.gate.out_features, own.projection.in_features, anatomy.embedding.per_layer_inputs.n_layers) == (8, 8, 6)


def test_a_description_of_a_wrong_norm_or_head_size_is_found():
    model = Gemma4DenseModel(tiny_config())
    anatomy = glassgpt.describe(model)
    from dataclasses import replace
    wrong_norm = replace(anatomy, final_norm=replace(anatomy.final_norm, kind="rmsnorm_plus_one"))
    assert description_mismatches(model, wrong_norm) != []
    att = anatomy.blocks[0].attention  # a value norm described with a weight, or a block scale that is not there
    with_weight = replace(anatomy, blocks=(replace(anatomy.blocks[0], attention=replace(
        att, v_norm=replace(att.v_norm, weight="weight"))),) + anatomy.blocks[1:])
    assert description_mismatches(model, with_weight) == ["norm blocks.0.att.v_norm: its 'weight' is None, described [8]"]
    no_scalar = replace(anatomy, blocks=(replace(anatomy.blocks[0], output_scale="scalar"),) + anatomy.blocks[1:])
    assert description_mismatches(model, no_scalar) == [
        "block blocks.0: no one-number tensor 'scalar', described as the scale of its output"]
    from glassgpt.families.gemma4 import Gemma4RMSNorm
    model.blocks[0].att.v_norm = Gemma4RMSNorm(8, with_scale=True)  # a module with a scale, described without
    assert description_mismatches(model, anatomy) == [
        "norm blocks.0.att.v_norm: holds 'weight', described without a weight"]
    block = anatomy.blocks[1]
    wrong_head = replace(anatomy, blocks=(anatomy.blocks[0], replace(block, attention=replace(
        block.attention, head_dim=8, n_heads=4))) + anatomy.blocks[2:])
    assert description_mismatches(model, wrong_head) != []


def test_transformers_module_is_described_in_its_own_names_and_agrees_with_itself():
    hf = randomised(hf_gemma4(tie_word_embeddings=False))
    anatomy = check_description(hf)
    assert anatomy.blocks[3].attention.key.path == "model.layers.1.self_attn.k_proj"
    assert anatomy.embedding.per_layer == "model.embed_tokens_per_layer" and not anatomy.head.tied


def test_transformers_module_itself_is_traced_and_generated_from_in_place(tokenizer_json):
    hf = randomised(hf_gemma4())
    tok = TokenizerJson(tokenizer_json, "gemma4")
    ids = tok.encode("The quick brown fox jumps")
    with torch.no_grad():
        theirs_next = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
    assert glassgpt.trace(hf, tok, "The quick brown fox jumps").next_token["id"] == theirs_next
    theirs = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert glassgpt.generate(hf, ids, 8).tolist() == theirs.tolist()
    assert glassgpt.adopt(hf).tok_emb.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # nothing copied


def test_trace_gives_the_models_own_next_token_and_the_softcapped_head(tmp_path, tokenizer_json):
    folder = saved(hf_gemma4(final_logit_softcapping=0.5), tmp_path / "g4", tokenizer_json)  # a cap that bends
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    tr = glassgpt.trace(model, tok, "The quick brown fox jumps")
    with torch.no_grad():
        expected = int(model(torch.tensor([tok.encode("The quick brown fox jumps")]))[0, -1].argmax())
    assert tr.next_token["id"] == expected
    assert tr.head["max_abs_diff"] < 1e-5  # the logits are 0.5 tanh(h . W[id] / 0.5), not the products
    assert tr.attention["rope_layers"] == [0, 1, 2, 3, 4, 5] and tr.attention["sliding_layers"] == [0, 2, 4]
    assert tr.to_text().startswith(f"Gemma 4: 6 blocks, d 32, V {VOCAB}, 4 query heads, 2 key/value groups")


def test_glassgpt_explain_prints_the_trace_of_the_folder(tmp_path, tokenizer_json, capsys):
    from glassgpt.cli import main
    folder = saved(hf_gemma4(), tmp_path / "g4", tokenizer_json)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["explain", "The quick brown fox", "--model", str(folder), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    assert out["family"] == "gemma4"
    assert out["next_tokens"][0]["id"] == glassgpt.trace(model, tok, "The quick brown fox").next_token["id"]


def test_glassgpt_info_counts_the_parameters_and_the_cache_of_the_layers_that_keep_one(tmp_path, tokenizer_json,
                                                                                      capsys):
    from glassgpt.cli import main
    folder = saved(hf_gemma4(), tmp_path / "g4", tokenizer_json)
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["info", "--model", str(folder), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model = glassgpt.load_model(folder)
    assert out["parameters"]["total"] == sum(p.numel() for p in model.parameters())
    assert out["notes"][1].startswith("3 sliding layers (window 4), 3 full")
    # k and v of 2 groups: sliding layers 0 and 2 keep 4 positions of 8, full layer 1 all 64 of 16; 3-5 keep none
    assert out["memory"]["kv_cache"] == 2 * (2 * 4 * 8 + 64 * 16) * 2 * 4



def test_why_splits_the_logit_of_glassgpts_and_transformers_gemma4_exactly(tokenizer_json):
    """why's parts (each block's per-layer input one of them, every write of block i times layer_scalar i ... L-1)
    sum to the model's own logit within 1e-4 of it (tests/test_why_models.py's bound), on transformers' module read
    in place and on the glass class, with each head's shares of the prompt summing to its term (kv-shared layers:
    the shares of their source layer's values)."""
    tok = TokenizerJson(tokenizer_json, "gemma4")
    glass = Gemma4DenseModel(tiny_config(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in glass.parameters():
            p.copy_(torch.rand(p.shape) + 0.5 if p.dim() == 1 else torch.randn(p.shape) * 0.3)
        for b in glass.blocks:
            b.layer_scalar.uniform_(0.5, 1.5)
    ids = tok.encode("The quick brown fox")
    for model in (randomised(hf_gemma4()), glass.eval()):
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        logits = (out.logits if hasattr(out, "logits") else out)[0, -1].double()
        w = glassgpt.why(model, tok, "The quick brown fox")
        a = int(logits.argmax())
        assert w.target["id"] == a
        assert abs(sum(p["value"] for p in w.parts) - float(logits[a])) <= 1e-4 * max(1.0, abs(float(logits[a])))
        assert sum(p["name"].endswith(".per_layer") for p in w.parts) == 6
        for layer, terms in zip(w.by_source, w.heads):
            for shares, term in zip(layer, terms):
                assert abs(sum(shares) - term) <= 1e-5 * max(1.0, abs(term))


# --- bad input: one line each ---------------------------------------------------------------------

def test_a_layer_types_list_of_the_wrong_length_a_window_of_0_or_a_shared_layer_without_a_source_is_one_line():
    with pytest.raises(ConfigError, match=r"layer_types must list one entry per layer \(6\), got 5"):
        tiny_config(layer_types=LAYERS[:5])
    with pytest.raises(ConfigError, match="sliding_window must be a positive integer.*got 0"):
        tiny_config(sliding_window=0)
    with pytest.raises(ConfigError, match="kv-shared layers .3 on. include full_attention layers but no earlier"):
        tiny_config(layer_types=["sliding_attention"] * 3 + ["full_attention"] * 3)
    with pytest.raises(ConfigError, match="num_kv_shared_layers is 6 of 6 layers"):
        tiny_config(num_kv_shared_layers=6)


def test_a_multimodal_folder_is_refused_as_vision_in_one_line(tmp_path, capsys):
    from glassgpt.cli import main
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": {"model_type": "gemma4_text"}, "vision_config": {"model_type": "gemma4_vision"}}))
    with pytest.raises(GlassError, match="Gemma 4's multimodal model .* vision and audio towers"):
        glassgpt.load_model(tmp_path)
    assert main(["generate", "Hi", "--model", str(tmp_path), "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert "Gemma4ForCausalLM" in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("change, field", [
    ({"enable_moe_block": True}, "enable_moe_block"),
    ({"attention_k_eq_v": True}, "attention_k_eq_v"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
     "rope_parameters.sliding_attention.rope_type"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}},
     "rope_parameters.full_attention.rope_type"),
    ({"per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}}}, "per_layer_config.1.num_key_value_heads"),
    ({"layer_types": LAYERS[:5] + ["sliding_attention"]}, "layer_types ends with 'sliding_attention'"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
])
def test_a_folder_whose_config_uses_what_the_glass_file_lacks_is_one_line_naming_the_field(tmp_path, tokenizer_json,
                                                                                           change, field, capsys):
    from glassgpt.cli import main
    folder = saved(hf_gemma4(), tmp_path / "g4", tokenizer_json)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(raw | change))
    capsys.readouterr()  # save_pretrained's progress bar
    with pytest.raises(GlassError, match=field.replace(".", r"\.")):
        glassgpt.load_model(folder)
    assert main(["generate", "Hi", "--model", str(folder), "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip()
    assert field in err and "Traceback" not in err and len(err.splitlines()) == 1


# --- the real shape, random weights ---------------------------------------------------------------

def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


@pytest.mark.slow
@pytest.mark.parametrize("layers", [7, 35])
def test_the_real_e2b_shape_with_random_weights_equals_transformers(layers):
    """E2B's real widths, vocabularies, heads, window and RoPE, random weights. With 7 of its 35 layers (about
    5 GB: 4 sliding and 1 full computing keys, then a shared sliding and a shared full layer with their double-wide
    MLPs), or all 35 (20 shared; 4.6 billion parameters, about 19 GB in float32, shared by both models)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    from glassgpt.families.bonus_hf import bonus_unread, gemma4_config_from_hf, gemma4_hf_names
    if layers == 35 and available_bytes() < 28 * 2**30:
        pytest.skip("all 35 layers of E2B in float32 need about 19 GB, and 28 GB free with the forward's own")
    e2b = get_gemma4_dense_config("E2B")
    types = list(e2b.layer_types) if layers == 35 else ["sliding_attention"] * 4 + ["full_attention"] * 1 + [
        "sliding_attention", "full_attention"]
    hf = Gemma4ForCausalLM(Gemma4TextConfig(
        vocab_size=262_144, vocab_size_per_layer_input=262_144, hidden_size=1536, intermediate_size=6144,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        max_position_embeddings=131_072, sliding_window=512, layer_types=types, hidden_size_per_layer_input=256,
        num_kv_shared_layers=20 if layers == 35 else 2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
        tie_word_embeddings=True, attn_implementation="eager"))
    hf = randomised(hf)
    cfg = gemma4_config_from_hf(hf.config.to_dict() | {"architectures": ["Gemma4ForCausalLM"]})
    if layers == 35:
        assert cfg == e2b  # the notebook's E2B config, read back
    else:
        assert (cfg.global_head_dim, cfg.kv_shared_from[5:]) == (512, (3, 4))
    own = hf.state_dict()
    state = bonus_unread(cfg, {ours: own[theirs] for ours, theirs in gemma4_hf_names(cfg)})
    with torch.device("meta"):
        model = Gemma4DenseModel(cfg)
    model.load_state_dict(state, strict=False, assign=True)  # transformers' tensors themselves: no second copy
    model.tie_weights()
    ids = torch.randint(0, 1000, (1, 40))
    with torch.no_grad():
        assert relative_error(model.eval()(ids), hf(ids).logits) < 1e-5


def test_trace_attention_weights_read_the_shared_layers_source_and_the_proportional_rope():
    """Each layer's weights from its description: a kv-shared layer's against its source layer's keys, a full
    layer's queries turned by proportional partial RoPE, a sliding layer's last row over its window of 4; the
    trace checks each against the context the layer's own attention gave o_proj (and refuses where it differs)."""
    from glassgpt.explain.options import TraceOptions
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    torch.manual_seed(0)
    model = Gemma4DenseModel(tiny_config(vocab_size=tok.n_vocab, vocab_size_per_layer_input=tok.n_vocab)).eval()
    tr = glassgpt.trace(model, tok, "hello world", options=TraceOptions(attention=True))
    weights = torch.tensor(tr.attention_weights["layers"])  # [n_layers, h, t, t]
    assert list(weights.shape) == [6, 2, 11, 11]
    assert [int((weights[i, 0, -1] > 0).sum()) for i in range(6)] == [4, 11] * 3
    torch.testing.assert_close(weights.sum(-1), torch.ones(6, 2, 11), atol=1e-5, rtol=0)


@pytest.mark.parametrize("block", [3, 4, 5])
def test_trace_opens_a_kv_shared_block_with_its_source_layers_keys(block):
    """A kv-shared layer computes no keys and keeps no cache: its opened block shows its source layer's (a
    KeyError before)."""
    from glassgpt.explain.options import TraceOptions
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    torch.manual_seed(0)
    model = Gemma4DenseModel(tiny_config(vocab_size=tok.n_vocab, vocab_size_per_layer_input=tok.n_vocab)).eval()
    tr = glassgpt.trace(model, tok, "hello world", options=TraceOptions(block=block))
    source = SHARED_FROM[block]
    assert tr.block == block and tr.attention["kv_shape"] == [1, 1, 11, [8, 16][source % 2]]
    assert tr.stage("keys, values").shape == tr.attention["kv_shape"]
