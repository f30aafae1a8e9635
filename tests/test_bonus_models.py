"""The book's bonus models (issue 48): Qwen3 MoE (ch05/11_qwen3's MoE notebook) and Gemma 3 (ch05/12_gemma3).

Every model here is tiny and random and built offline: transformers' Qwen3MoeForCausalLM and
Gemma3ForCausalLM saved with save_pretrained, a tokenizer.json trained here, the notebooks' .pth written
with the notebooks' names and config keys. Logits are compared relative to each row's largest logit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import glassgpt
import llms_from_scratch.qwen3 as book_qwen
from glassgpt import KVCache
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt.families import FamilyConfig, Gemma3Config, Gemma3Model, Qwen3Model, build_model
from glassgpt.families.gemma3 import GEMMA3_270M
from glassgpt.formats.families import config_from_hf, config_to_hf, export_family_book, export_family_hf
from glassgpt.formats.family_tokenizers import GEMMA_SPECIALS, QWEN_SPECIALS, GemmaTokenizer
from glassgpt.generate import generate
from helpers import check_description

TEXT = ("The quick brown fox jumps over the lazy dog. Sliding layers see a window; full layers see it all. "
        "Experts are chosen by a router, eight of them a token.\n") * 20

MOE = FamilyConfig(family="qwen3", vocab_size=300, context_length=64, emb_dim=32, n_heads=4, n_layers=2,
                   hidden_dim=48, n_kv_groups=2, rope_base=1_000_000.0, head_dim=8, qk_norm=True,
                   num_experts=8, num_experts_per_tok=3, moe_hidden_dim=24)
SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA = Gemma3Config(vocab_size=300, context_length=64, emb_dim=32, n_heads=4, n_layers=4, hidden_dim=48, head_dim=8,
                     n_kv_groups=2, rope_local_base=10_000.0, rope_base=1_000_000.0, sliding_window=4,
                     layer_types=(SLIDING, FULL, SLIDING, FULL), query_pre_attn_scalar=24)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random, large enough that routing and the window change the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference of a row, over that row's largest logit."""
    return float(((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).max())


def ids(n: int = 20, seed: int = 1, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(seed))


def transformers_model(cfg, tie: bool | None = None):
    """transformers' model of `cfg` (through config_to_hf, as export writes it), random, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM
    raw = config_to_hf(cfg)
    raw.pop("architectures"), raw.pop("torch_dtype")
    if tie is not None:
        raw["tie_word_embeddings"] = tie
    hf_cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return randomize_(AutoModelForCausalLM.from_config(hf_cfg))


def cached_logits(model: torch.nn.Module, batch: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """The logits of `batch` fed through one KVCache in chunks of these sizes."""
    cache = KVCache(model.cfg, batch.shape[0], batch.shape[1])
    out, start = [], 0
    for n in chunks:
        out.append(model(batch[:, start:start + n], cache))
        start += n
    return torch.cat(out, dim=1)


# --- tokenizer.json files made here -----------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_tokenizer_json(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(QWEN_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path_factory.mktemp("qwen") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def gemma_tokenizer_json(tmp_path_factory) -> Path:
    """SentencePiece-style pieces as Gemma's tokenizer.json has them: U+2581 for a space, <0xHH> byte fallback,
    and a post-processor that puts <bos> first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=290, special_tokens=list(GEMMA_SPECIALS) + bytes_)
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[
        ("<bos>", tok.token_to_id("<bos>"))])
    path = tmp_path_factory.mktemp("gemma") / "tokenizer.json"
    tok.save(str(path))
    return path


def hf_folder(path: Path, cfg, tokenizer_json: Path, tie: bool | None = None) -> Path:
    transformers_model(cfg, tie).save_pretrained(path)
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    return path


# --- Qwen3 MoE --------------------------------------------------------------------------------------

def test_qwen3_moe_logits_equal_transformers_within_1e5(tmp_path):
    theirs = transformers_model(MOE)
    theirs.save_pretrained(tmp_path)
    ours = glassgpt.load_model(tmp_path)
    assert isinstance(ours, Qwen3Model) and ours.cfg == MOE
    batch = ids()
    with torch.no_grad():
        assert relative_error(ours(batch), theirs(batch).logits) < 1e-5


def test_qwen3_moe_greedy_tokens_equal_transformers_generate(tmp_path):
    theirs = transformers_model(MOE)
    theirs.save_pretrained(tmp_path)
    prompt = ids(6)[:1]
    expected = theirs.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(glassgpt.load_model(tmp_path), prompt, 12).tolist() == expected.tolist()


def test_qwen3_moe_gives_llms_from_scratch_moe_logits():
    """The book's package has the notebook's MoEFeedForward (its key: moe_intermediate_size); same names, same sums
    up to the order of adding the experts."""
    book = FamilyConfig.to_book_dict(MOE, torch.float32)
    book["moe_intermediate_size"] = book.pop("moe_hidden_dim")
    reference = book_qwen.Qwen3Model(book)
    ours = randomize_(build_model(MOE))
    reference.load_state_dict(ours.state_dict(), assign=True)  # its experts start on the meta device
    batch = ids()
    with torch.no_grad():
        assert relative_error(ours(batch), reference.eval()(batch)) < 1e-6


def test_qwen3_moe_cached_logits_equal_uncached_at_every_step():
    model = randomize_(build_model(MOE))
    batch = ids(16)
    with torch.no_grad():
        whole = model(batch)
        for chunks in ([16], [5] + [1] * 11, [1] * 16, [7, 4, 1, 4]):
            assert relative_error(cached_logits(model, batch, chunks), whole) < 1e-5


def test_decoding_a_token_reads_only_the_experts_its_router_chose():
    model = randomize_(build_model(MOE))
    batch = ids(9)[:1]
    cache = KVCache(MOE, 1, 10)
    ran: dict[int, set[int]] = {}
    with torch.no_grad():
        model(batch[:, :8], cache)
        hooks = [expert.register_forward_hook(lambda m, i, o, layer=n, e=e: ran.setdefault(layer, set()).add(e))
                 for n, block in enumerate(model.trf_blocks) for lst in (block.ff.fc1, block.ff.fc2, block.ff.fc3)
                 for e, expert in enumerate(lst)]
        chosen = {}
        routes = [block.ff.register_forward_pre_hook(
            lambda m, args, layer=n: chosen.__setitem__(layer, set(m.route(args[0])[0].flatten().tolist())))
            for n, block in enumerate(model.trf_blocks)]
        model(batch[:, 8:9], cache)
    for h in hooks + routes:
        h.remove()
    assert ran == chosen and all(len(e) == MOE.num_experts_per_tok for e in ran.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_twins_one_token_experts_decode_the_glass_models_logits_bit_for_bit(dtype, monkeypatch):
    from glassgpt.engine import decode
    from glassgpt.engine.decode import twin_steps
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: False)  # the twin, not the step
    from glassgpt.engine.experts import OneTokenExperts
    model = randomize_(build_model(MOE)).to(dtype)
    steps = twin_steps(model)
    assert all(isinstance(block.ff, OneTokenExperts) for block in steps.twin.trf_blocks)
    assert not any(isinstance(block.ff, OneTokenExperts) for block in model.trf_blocks)  # the glass model keeps its own
    batch = ids(14)[:1]
    glass_cache, twin_cache = KVCache(MOE, 1, 14, dtype=dtype), KVCache(MOE, 1, 14, dtype=dtype)
    with torch.no_grad():
        glass = [model(batch[:, :8], glass_cache, last_only=True)[:, -1]] + [
            model(batch[:, i:i + 1], glass_cache)[:, -1] for i in range(8, 14)]
        twin = [steps.prefill(batch[:, :8], twin_cache)] + [steps.decode_one(batch[:, i], twin_cache)
                                                             for i in range(8, 14)]
    for ours, theirs in zip(twin, glass):
        assert torch.equal(ours, theirs)  # the same experts, the same order of sums: no tolerance


def test_decoding_through_generate_reads_only_the_routed_experts(monkeypatch):
    from glassgpt.engine import decode
    from glassgpt.engine.decode import twin_steps
    # the twin's modules (the described step, tests/test_described_step.py, reads the routed experts' alone too)
    monkeypatch.setattr(decode.autotune, "native_step_chosen", lambda engine, cache: False)
    model = randomize_(build_model(MOE))
    steps = twin_steps(model)
    batch = ids(9)[:1]
    cache = KVCache(MOE, 1, 10)
    ran: dict[int, list[int]] = {}
    chosen: dict[int, list[int]] = {}
    with torch.no_grad():
        steps.prefill(batch[:, :8], cache)
        # on the twin's modules, which generate decodes through (they share the glass model's Parameters)
        hooks = [expert.register_forward_hook(lambda m, i, o, layer=n, e=e: ran.setdefault(layer, []).append(e))
                 for n, block in enumerate(steps.twin.trf_blocks) for lst in (block.ff.fc1, block.ff.fc2, block.ff.fc3)
                 for e, expert in enumerate(lst)]
        routes = [block.ff.register_forward_pre_hook(
            lambda m, args, layer=n: chosen.__setitem__(layer, m.route(args[0])[0].flatten().tolist()))
            for n, block in enumerate(steps.twin.trf_blocks)]
        steps.decode_one(batch[:, 8], cache)
    for h in hooks + routes:
        h.remove()
    assert set(ran) == set(chosen) == {0, 1}
    for layer, experts in ran.items():  # each chosen expert's three matrices once, no other expert's
        assert sorted(experts) == sorted(chosen[layer] * 3)
        assert len(set(experts)) == MOE.num_experts_per_tok


def test_routing_weights_are_the_softmax_of_the_top_k_scores_and_sum_to_one():
    ff = randomize_(build_model(MOE)).trf_blocks[0].ff
    x = torch.randn(1, 5, MOE.emb_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        chosen, weights = ff.route(x)
        scores = ff.gate(x)
    all_probs = torch.softmax(scores, dim=-1)  # transformers' order: softmax over all, top-k, renormalise
    expected = all_probs.gather(-1, chosen) / all_probs.gather(-1, chosen).sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected)
    assert chosen.tolist() == scores.topk(MOE.num_experts_per_tok).indices.tolist()


def test_the_notebooks_moe_pth_with_its_config_json_loads(tmp_path):
    model = randomize_(build_model(MOE))
    path = export_family_book(model, tmp_path / "moe.pth")
    written = json.loads((tmp_path / "moe.json").read_text())
    assert (written["num_experts"], written["num_experts_per_tok"], written["moe_hidden_dim"]) == (8, 3, 24)
    assert "hidden_dim" not in written  # the notebook's QWEN3_CONFIG has none
    state = torch.load(path, weights_only=True)
    assert {"trf_blocks.0.ff.gate.weight", "trf_blocks.1.ff.fc3.7.weight"} <= set(state)  # the notebook's names
    batch = ids()
    with torch.no_grad():
        assert torch.equal(glassgpt.load_model(path)(batch), model(batch))


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"),
    ({"moe_hidden_dim": 0}, "moe_hidden_dim must be a positive integer"),
])
def test_a_moe_config_that_cannot_route_is_refused_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words) as err:
        FamilyConfig(**(MOE.to_dict() | change))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, field", [({"mlp_only_layers": [1]}, "mlp_only_layers"),
                                           ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
                                           ({"norm_topk_prob": False}, "norm_topk_prob"),
                                           ({"num_experts_per_tok": 12}, "num_experts_per_tok")])
def test_a_transformers_moe_config_the_notebook_does_not_implement_names_its_field(change, field):
    raw = config_to_hf(MOE) | change
    with pytest.raises(ConfigError, match=field) as err:
        config_from_hf(raw)
    assert "\n" not in str(err.value)


def test_qwen3_moe_description_agrees_with_its_module_and_names_the_router_and_experts():
    model = build_model(MOE)
    anatomy = check_description(model)
    ff = anatomy.blocks[1].ff
    assert (ff.kind, ff.experts.n_experts, ff.experts.per_token, ff.hidden_dim) == ("moe", 8, 3, 24)
    assert ff.experts.router.path == "trf_blocks.1.ff.gate" and ff.gate.path == "trf_blocks.1.ff.fc1.0"
    assert anatomy.name == "Qwen3 MoE"


def test_qwen3_moe_folder_runs_through_trace_and_the_cli(tmp_path, qwen_tokenizer_json, capsys):
    from glassgpt.cli import main
    folder = hf_folder(tmp_path / "moe", MOE, qwen_tokenizer_json)
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    tr = glassgpt.trace(model, tok, "The quick brown fox")
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("The quick brown fox")]))[0, -1]
    assert tr.next_token["id"] == int(logits.argmax())
    assert tr.params["total"] == sum(p.numel() for p in model.parameters())
    assert main(["generate", "The quick", "--model", str(folder), "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == tok.encode("The quick")
    assert out["new_ids"] == generate(model, out["prompt_ids"], 5)[0, -5:].tolist()


def test_qwen3_moe_folder_why_through_the_cli_shows_each_tokens_experts_as_parts(tmp_path, qwen_tokenizer_json, capsys):
    """`glassgpt explain --why` on a Qwen3 MoE folder: the routed experts of the last token are parts, their sum the
    block's feed-forward part, and every token's experts and weights are in the JSON and the text."""
    from glassgpt.cli import main
    folder = hf_folder(tmp_path / "moe", MOE, qwen_tokenizer_json)
    assert main(["explain", "--why", "--model", str(folder), "The quick brown fox", "--format", "json"]) == 0, \
        capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)["why"]
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("The quick brown fox")]))[0, -1]
    assert abs(sum(p["value"] for p in data["parts"]) - float(logits.max())) <= 1e-4 * max(1.0, float(logits.abs().max()))
    t = len(tok.encode("The quick brown fox"))
    for i, routes in enumerate(data["experts"]):
        assert len(routes) == t and all(len(r) == MOE.num_experts_per_tok for r in routes)
        experts = [p["value"] for p in data["parts"] if p["name"].startswith(f"trf_blocks.{i}.ff.expert.")]
        assert len(experts) == MOE.num_experts_per_tok and abs(sum(experts) - data["ff"][i]) <= 1e-5
    assert main(["explain", "--why", "--model", str(folder), "The quick brown fox"]) == 0
    assert "experts (per block" in capsys.readouterr().out


@pytest.mark.slow
def test_qwen3_moe_at_the_real_block_shape_equals_transformers(tmp_path):
    """Qwen3 30B-A3B's block (d 2,048, 32 query heads of 128 on 4 groups, 128 experts of 768, 8 a token) and
    vocabulary, with random weights; one block, not 48 (the whole model is 30B parameters)."""
    real = FamilyConfig.from_book_dict("qwen3", book_qwen.QWEN3_CONFIG_30B_A3B)
    cfg = FamilyConfig(**(real.to_dict() | {"n_layers": 1, "context_length": 64}))
    theirs = transformers_model(cfg)
    theirs.save_pretrained(tmp_path)
    ours = glassgpt.load_model(tmp_path)
    batch = ids(12, vocab=cfg.vocab_size)
    with torch.no_grad():
        assert relative_error(ours(batch), theirs(batch).logits) < 1e-5


# --- Gemma 3 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
def test_gemma3_logits_equal_transformers_within_1e5(tmp_path, tie):
    theirs = transformers_model(GEMMA, tie)
    theirs.save_pretrained(tmp_path)
    ours = glassgpt.load_model(tmp_path)
    assert isinstance(ours, Gemma3Model) and ours.cfg.tie_embeddings == tie and ours.tied == tie
    batch = ids(20)  # past the window of 4: the sliding layers' mask decides
    with torch.no_grad():
        assert relative_error(ours(batch), theirs(batch).logits) < 1e-5


def test_gemma3_greedy_tokens_equal_transformers_generate(tmp_path):
    theirs = transformers_model(GEMMA)
    theirs.save_pretrained(tmp_path)
    prompt = ids(6)[:1]
    expected = theirs.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate(glassgpt.load_model(tmp_path), prompt, 16).tolist() == expected.tolist()


def test_gemma3_cached_logits_equal_uncached_at_every_step():
    model = randomize_(build_model(GEMMA))
    batch = ids(16)
    with torch.no_grad():
        whole = model(batch)
        for chunks in ([16], [6] + [1] * 10, [1] * 16, [3, 7, 1, 5]):  # prompts shorter and longer than the window
            assert relative_error(cached_logits(model, batch, chunks), whole) < 1e-5


def test_the_sliding_layers_cache_keeps_the_window_and_the_full_layers_every_position():
    cache = KVCache(GEMMA, 1, 40)
    assert [k.shape[2] for k in cache.k] == [4, 40, 4, 40]
    assert cache.nbytes == 2 * (4 + 40 + 4 + 40) * GEMMA.n_kv_groups * GEMMA.head_dim * 4


@pytest.mark.parametrize("cfg", [GEMMA, MOE], ids=["gemma3", "qwen3-moe"])
def test_the_memory_figures_are_the_live_caches_and_parameters(cfg):
    from glassgpt.memory import memory_needs, parameter_table
    needs = memory_needs(cfg, torch.float32, 2, 40)
    assert needs["kv_cache"] == KVCache(cfg, 2, 40).nbytes  # a sliding layer's keeps 4 positions, not 40
    assert parameter_table(cfg)["total"] == sum(p.numel() for p in build_model(cfg).parameters())


def test_gemma3_without_its_window_gives_other_logits():
    """The window is not a no-op: the same weights with a window past the prompt see more."""
    model = randomize_(build_model(GEMMA))
    wide = build_model(Gemma3Config.from_dict(GEMMA.to_dict() | {"sliding_window": 64}))
    wide.load_state_dict(model.state_dict())
    batch = ids(12)
    with torch.no_grad():
        assert relative_error(wide.eval()(batch), model(batch)) > 1e-2
        assert torch.equal(wide(batch[:, :4]), model(batch[:, :4]))  # within the window, the same


@pytest.mark.parametrize("change, words", [
    ({"layer_types": [SLIDING, FULL, SLIDING]}, "layer_types has 3 entries but n_layers is 4"),
    ({"sliding_window": 0}, "sliding_window is 0"),
    ({"layer_types": [SLIDING, FULL, SLIDING, "chunked_attention"]}, "layer_types holds 'chunked_attention'"),
])
def test_a_gemma3_config_that_cannot_run_is_refused_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words) as err:
        Gemma3Config.from_dict(GEMMA.to_dict() | change)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, field", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope_type 'linear'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope_type 'linear'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"sliding_window": 0}, "sliding_window is 0"),
])
def test_a_gemma3_field_the_notebook_does_not_implement_is_named_in_one_line(change, field):
    with pytest.raises(ConfigError, match=field) as err:
        config_from_hf(config_to_hf(GEMMA) | change)
    assert "\n" not in str(err.value)


def test_a_gemma3_vision_folder_is_refused_as_vision(tmp_path, capsys):
    from glassgpt.cli import main
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": config_to_hf(GEMMA), "vision_config": {"model_type": "siglip_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="Gemma 3's vision model"):
        glassgpt.load_model(tmp_path)
    assert main(["generate", "hi", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vision tower" in err[0]


def test_transformers_layer_types_and_rope_bases_are_read(tmp_path):
    theirs = transformers_model(GEMMA)
    theirs.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0  # transformers 5's form
    assert config_from_hf(raw) == GEMMA
    old = {k: v for k, v in config_to_hf(GEMMA).items() if k != "layer_types"} | {"sliding_window_pattern": 2}
    assert config_from_hf(old).layer_types == GEMMA.layer_types  # an older config: every second layer full


def test_the_notebooks_gemma3_pth_with_its_config_json_loads(tmp_path):
    model = randomize_(build_model(GEMMA))
    path = export_family_book(model, tmp_path / "gemma.pth")
    written = json.loads((tmp_path / "gemma.json").read_text())
    assert set(GEMMA3_NOTEBOOK_KEYS) <= set(written)
    state = torch.load(path, weights_only=True)
    assert {"blocks.3.post_feedforward_layernorm.scale", "blocks.0.att.q_norm.scale"} <= set(state)
    loaded = glassgpt.load_model(path)
    assert loaded.tied and loaded.cfg == GEMMA
    # As the notebook saves it: torch.save(model.state_dict()) keeps the tied head one tensor, and its config
    # dict has no tie_embeddings; the tie is told by the storage.
    torch.save(model.state_dict(), path)
    (tmp_path / "gemma.json").write_text(json.dumps({k: v for k, v in written.items() if k != "tie_embeddings"}))
    assert glassgpt.load_model(path).tied
    untied = randomize_(build_model(Gemma3Config.from_dict(GEMMA.to_dict() | {"tie_embeddings": False})))
    torch.save(untied.state_dict(), path)
    assert not glassgpt.load_model(path).tied
    batch = ids()
    with torch.no_grad():
        assert torch.equal(loaded(batch), model(batch))


GEMMA3_NOTEBOOK_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "hidden_dim", "head_dim",
                        "qk_norm", "n_kv_groups", "rope_local_base", "rope_base", "sliding_window", "layer_types",
                        "dtype", "query_pre_attn_scalar")


def test_the_270m_preset_is_the_notebooks_config():
    assert set(GEMMA3_270M.to_book_dict()) == set(GEMMA3_NOTEBOOK_KEYS)
    assert GEMMA3_270M.windows.count(None) == 3 and GEMMA3_270M.layer_types[5::6] == (FULL,) * 3
    assert GEMMA3_270M.scaling == 1 / 16


def test_gemma3_description_agrees_with_its_module_and_says_what_is_new():
    model = randomize_(build_model(GEMMA))
    anatomy = check_description(model)
    assert anatomy.embedding.scale == pytest.approx(32 ** 0.5) and anatomy.blocks_path == "blocks"
    sliding, full = anatomy.blocks[0], anatomy.blocks[1]
    assert (sliding.placement, len(sliding.norms), sliding.norms[0].kind) == ("sandwich", 4, "rmsnorm_plus_one")
    assert (sliding.layer_type, sliding.attention.window, sliding.attention.rope.base) == (SLIDING, 4, 10_000.0)
    assert (full.layer_type, full.attention.window, full.attention.rope.base) == (FULL, None, 1_000_000.0)
    assert sliding.ff.kind == "geglu" and sliding.attention.scale == pytest.approx(24 ** -0.5)


def test_gemma_tokenizer_gives_the_files_ids_and_streams_its_text_back(gemma_tokenizer_json):
    from tokenizers import Tokenizer
    ours, theirs = GemmaTokenizer(gemma_tokenizer_json), Tokenizer.from_file(str(gemma_tokenizer_json))
    text = "The quick brown fox, Ünïcödé 🙂 and\nnew lines."
    assert ours.encode(text) == theirs.encode(text).ids and ours.encode(text)[0] == ours.specials["<bos>"]
    assert ours.decode_bytes(ours.encode(text)[1:]).decode() == text
    chat = ours.chat("Hi!")
    assert theirs.decode(chat, skip_special_tokens=False).endswith("<start_of_turn>model\n")


def test_gemma3_folder_runs_through_trace_and_the_cli(tmp_path, gemma_tokenizer_json, capsys):
    from glassgpt.cli import main
    folder = hf_folder(tmp_path / "gemma", GEMMA, gemma_tokenizer_json)
    model, tok = glassgpt.load_model(folder), glassgpt.load_tokenizer(folder)
    assert isinstance(tok, GemmaTokenizer)
    prompt = "The quick brown fox jumps"
    tr = glassgpt.trace(model, tok, prompt)
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(prompt)]))[0, -1]
    assert tr.next_token["id"] == int(logits.argmax())
    assert tr.params["total"] == sum(p.numel() for p in model.parameters())
    assert main(["generate", "The quick", "--model", str(folder), "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == tok.encode("The quick")
    assert out["new_ids"] == generate(model, out["prompt_ids"], 5)[0, -5:].tolist()


def test_gemma3_trace_attention_weights_are_the_models_own():
    """With attention, each layer's weights by its own RoPE, scale and window: a sliding layer's row sees 4."""
    from glassgpt.explain.options import TraceOptions
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    model = randomize_(build_model(GEMMA))
    tr = glassgpt.trace(model, tok, "hello world", options=TraceOptions(attention=True))
    weights = torch.tensor(tr.attention_weights["layers"])  # [n_layers, h, t, t]
    assert (weights[0, :, -1] > 0).sum(-1).tolist() == [4] * 4  # sliding: the last 4 positions
    assert (weights[1, :, -1] > 0).sum(-1).tolist() == [11] * 4  # full: all 11
    captured = {}
    hook = model.blocks[0].att.register_forward_hook(lambda m, i, o: captured.update(out=o))
    with torch.no_grad():
        model(torch.tensor([tok.encode("hello world")]))
    hook.remove()
    assert captured["out"].shape == (1, 11, GEMMA.emb_dim)


@pytest.mark.slow
def test_gemma3_270m_shape_with_random_weights_equals_transformers(tmp_path):
    cfg = Gemma3Config.from_dict(GEMMA3_270M.to_dict() | {"context_length": 1024})
    theirs = transformers_model(cfg)
    theirs.save_pretrained(tmp_path)
    ours = glassgpt.load_model(tmp_path)
    batch = ids(600, vocab=cfg.vocab_size)[:1]  # past the 512 window
    with torch.no_grad():
        assert relative_error(ours(batch), theirs(batch).logits) < 1e-5
        assert relative_error(cached_logits(ours, batch, [590] + [1] * 10), ours(batch)) < 1e-5


# --- the notebooks' objects, taken as they are --------------------------------------------------------

def test_the_books_qwen3_moe_module_is_described_and_traced_in_place():
    """llms_from_scratch.qwen3.Qwen3Model with the MoE notebook's experts: read through its own tensors."""
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    book = FamilyConfig.to_book_dict(MOE, torch.float32)
    book["moe_intermediate_size"] = book.pop("moe_hidden_dim")
    module = book_qwen.Qwen3Model(book)
    module.load_state_dict(randomize_(build_model(MOE)).state_dict(), assign=True)
    anatomy = check_description(module.eval())
    assert anatomy.source == "the book's Qwen3Model" and anatomy.blocks[0].ff.experts.n_experts == 8
    tr = glassgpt.trace(module, tok, "hello world")
    with torch.no_grad():
        assert tr.next_token["id"] == int(module(torch.tensor([tok.encode("hello world")]))[0, -1].argmax())


class NotebookGemma3(torch.nn.Module):
    """What the Gemma 3 notebook's Gemma3Model holds: its children by the notebook's names and its cfg dict."""

    def __init__(self, glass: Gemma3Model):
        super().__init__()
        self.tok_emb, self.blocks, self.final_norm, self.out_head = (glass.tok_emb, glass.blocks, glass.final_norm,
                                                                     glass.out_head)
        self.cfg = glass.cfg.to_book_dict(torch.float32)
        self._forward = glass.forward

    def forward(self, input_ids, cache=None):
        return self._forward(input_ids)


def test_a_module_with_the_gemma3_notebooks_names_is_described_and_traced_in_place():
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    module = NotebookGemma3(randomize_(build_model(GEMMA)))
    anatomy = check_description(module)
    assert anatomy.source.endswith("with the Gemma 3 notebook's names (a reader's copy)")
    assert [b.attention.window for b in anatomy.blocks] == [4, None, 4, None]
    tr = glassgpt.trace(module, tok, "hello world")
    with torch.no_grad():
        assert tr.next_token["id"] == int(module(torch.tensor([tok.encode("hello world")]))[0, -1].argmax())


def test_gemma3_trace_says_which_layers_slide_their_window_and_base():
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    tr = glassgpt.trace(randomize_(build_model(GEMMA)), tok, "hello world")
    assert (tr.attention["sliding_layers"], tr.attention["window"], tr.attention["rope_local_base"]) == ([0, 2], 4, 1e4)
    assert "Sliding layers [0, 2]: each query sees only the last 4 positions" in tr.to_text()


def test_a_random_gemma3_model_starts_its_norms_at_one_as_the_notebook_does():
    from glassgpt.families import random_family_model
    model = random_family_model(GEMMA)
    x = torch.randn(3, GEMMA.emb_dim, generator=torch.Generator().manual_seed(0))
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + GEMMA.norm_eps)  # (1 + 0) times x / rms(x)
    for norm in (model.final_norm, model.blocks[0].post_feedforward_layernorm):
        torch.testing.assert_close(norm(x), expected)


def test_transformers_gemma3_module_is_described_and_traced_in_place():
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    module = transformers_model(GEMMA)
    anatomy = check_description(module)
    assert anatomy.source == "transformers' Gemma3ForCausalLM" and anatomy.blocks_path == "model.layers"
    assert anatomy.blocks[3].norm("ff_out").path == "model.layers.3.post_feedforward_layernorm"
    tr = glassgpt.trace(module, tok, "hello world")
    with torch.no_grad():
        assert tr.next_token["id"] == int(module(torch.tensor([tok.encode("hello world")])).logits[0, -1].argmax())


def test_why_on_gemma3_splits_the_logit_over_its_sandwich_norms():
    """Each part's write is its post-norm's output; the parts (the sqrt(d)-scaled embedding, each query head read
    through post_attention_layernorm, each GeGLU through post_feedforward_layernorm) sum to the model's logit."""
    from glassgpt.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ")
    model = randomize_(build_model(GEMMA))
    w = glassgpt.why(model, tok, "hello world")
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("hello world")]))[0, -1]
    a = int(logits.argmax())
    assert w.target["id"] == a and abs(w.total - float(logits[a])) <= 1e-4 * max(1.0, abs(float(logits[a])))
    assert len(w.parts) == 1 + GEMMA.n_layers * (GEMMA.n_heads + 1)