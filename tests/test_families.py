"""Qwen3 and Llama 3.2 (families/): the book's classes' logits bit for bit, transformers' within 1e-5.

Every model here is tiny and random, built offline: the book's `llms_from_scratch.qwen3.Qwen3Model`
and `llama3.Llama3Model` from their config dicts, transformers' Qwen3ForCausalLM and
LlamaForCausalLM saved with save_pretrained (sharded, so the index is read too). Sizes differ from
each other (d 32, hd 16 or 8, f 48, V 97), so a swapped or transposed matrix changes a shape.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt.errors import CheckpointError, ConfigError
from glassgpt import KVCache
from glassgpt.families import (FAMILY_PRESETS, FamilyConfig, Llama3Model, Qwen3Model, build_model, family_config)
from glassgpt.formats.families import (export_family_book, export_family_hf, hf_names,
                                       load_book_family, load_hf_family)
from glassgpt.generate import generate
from helpers import TINY, ids, randomize_, transformers_config

BOOK = {"qwen3": (book_qwen.Qwen3Model, book_qwen.load_weights_into_qwen),
        "llama3": (book_llama.Llama3Model, book_llama.load_weights_into_llama)}
FAMILIES = list(TINY)


def book_model(family: str, cfg: FamilyConfig | None = None, seed: int = 0) -> torch.nn.Module:
    cfg = cfg or TINY[family]
    torch.manual_seed(seed)
    return randomize_(BOOK[family][0](cfg.to_book_dict(torch.float32)), seed)


def hf_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The Hugging Face-named parameter dict that the book's load_weights_into_* read."""
    own = model.state_dict()
    return {hf: own[book].clone() for book, hf in hf_names(model.cfg)}


# --- the book's classes ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_the_books_state_dict_loads_as_it_is_and_gives_its_logits_bit_for_bit(family):
    book = book_model(family)
    ours = build_model(TINY[family])
    ours.load_state_dict(book.state_dict())  # strict: every name and shape is the book's
    with torch.no_grad():
        assert torch.equal(ours(ids()), book(ids()))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True])
def test_the_books_own_loader_and_ours_read_one_hf_param_dict_to_the_same_logits(family, tie):
    cfg = dataclasses.replace(TINY[family], tie_embeddings=tie)
    source = randomize_(build_model(cfg), seed=3)
    params = hf_params(source)
    assert ("lm_head.weight" in params) == (not tie)
    book = BOOK[family][0](cfg.to_book_dict(torch.float32)).eval()
    BOOK[family][1](book, cfg.to_book_dict(torch.float32), params)  # prints "Model uses weight tying." when tied
    from glassgpt.formats.families import model_from_book_state
    ours = model_from_book_state(cfg, {b: params[h] for b, h in hf_names(cfg)}, "params")
    with torch.no_grad():
        assert torch.equal(ours(ids()), book(ids()))
    # The book's loader copies the embedding into a second Parameter; ours shares one storage.
    assert book.out_head.weight.data_ptr() != book.tok_emb.weight.data_ptr()
    assert ours.tied == tie and (ours.out_head.weight.data_ptr() == ours.tok_emb.weight.data_ptr()) == tie


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_matches_full_forward(family):
    model = randomize_(build_model(TINY[family]))
    x = ids(12)
    cache = KVCache(model.cfg, batch_size=2, max_len=12)
    with torch.no_grad():
        full = model(x)
        steps = [model(x[:, :5], cache)] + [model(x[:, i:i + 1], cache) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    # GQA's cache holds the g key/value heads, not h copies of them
    assert cache.k[0].shape == (2, model.cfg.n_kv_groups, 12, model.cfg.head_dim_value)


def book_greedy(book: torch.nn.Module, prompt: torch.Tensor, n: int, ctx: int) -> torch.Tensor:
    """The book's generate_text_simple loop: the last ctx tokens through the model, argmax, append."""
    seq = prompt
    for _ in range(n):
        with torch.no_grad():
            logits = book(seq[:, -ctx:])[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_the_books_and_transformers_past_the_cache_window(family, tmp_path):
    cfg = TINY[family]
    book = book_model(family, seed=5)
    ours = build_model(cfg)
    ours.load_state_dict(book.state_dict())
    ours.eval()
    prompt = ids(10, seed=7)[:1]
    n = 30  # 10 + 30 > context_length 24: the cache fills and the window slides
    got = generate(ours, prompt, n)
    assert torch.equal(got, book_greedy(book, prompt, n, cfg.context_length))
    hf = transformers_model(family, ours, tmp_path)
    with torch.no_grad():
        assert torch.equal(got, book_greedy(lambda x: hf(x).logits, prompt, n, cfg.context_length))


# --- transformers' folders ------------------------------------------------------------------------


def transformers_model(family: str, source: torch.nn.Module, tmp_path):
    """transformers' model holding `source`'s weights, read from the folder export_family_hf writes."""
    from transformers import AutoModelForCausalLM
    export_family_hf(source, tmp_path / "export")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tie", [False, True])
def test_a_transformers_folder_loads_and_its_logits_agree(family, tie, tmp_path):
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM
    cfg = dataclasses.replace(TINY[family], tie_embeddings=tie)
    torch.manual_seed(0)
    hf = randomize_((Qwen3ForCausalLM if family == "qwen3" else LlamaForCausalLM)(transformers_config(family, cfg)))
    hf.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards and model.safetensors.index.json
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_hf_family(tmp_path)
    assert isinstance(ours, Qwen3Model if family == "qwen3" else Llama3Model)
    assert ours.cfg == cfg and ours.tied == tie
    with torch.no_grad():
        torch.testing.assert_close(ours(ids()), hf(ids()).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_to_hf_and_to_the_books_pth_round_trips(family, tmp_path):
    ours = randomize_(build_model(dataclasses.replace(TINY[family], tie_embeddings=True)), seed=4)
    hf = transformers_model(family, ours, tmp_path)
    with torch.no_grad():
        expected = ours(ids())
        torch.testing.assert_close(hf(ids()).logits, expected, rtol=0, atol=1e-5)
        assert torch.equal(load_hf_family(tmp_path / "export")(ids()), expected)
        export_family_book(ours, tmp_path / "model.pth")
        again = load_book_family(tmp_path / "model.pth")
        assert torch.equal(again(ids()), expected) and again.tied
        book = BOOK[family][0](again.cfg.to_book_dict(torch.float32)).eval()  # the book's class reads it as it is
        book.load_state_dict(torch.load(tmp_path / "model.pth", weights_only=True))
        assert torch.equal(book(ids()), expected)


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    (dict(family="llama3", emb_dim=30, n_heads=4, head_dim=None), "emb_dim (30) must be divisible by n_heads (4)"),
    (dict(head_dim=15), "head_dim is 15 but RoPE rotates pairs"),
    (dict(n_heads=6, n_kv_groups=4, head_dim=16), "n_heads (6) must be divisible by n_kv_groups (4)"),
])
def test_a_config_that_cannot_be_built_is_refused_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
        dataclasses.replace(TINY["qwen3"], **change)
    assert "\n" not in str(e.value)


def test_an_hf_folder_of_another_architecture_is_refused_naming_it_and_the_families_covered(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}')
    with pytest.raises(CheckpointError, match="Gemma2ForCausalLM") as e:
        load_hf_family(tmp_path)
    assert "Qwen3ForCausalLM (qwen3)" in str(e.value) and "LlamaForCausalLM (llama3)" in str(e.value)


def test_a_folder_whose_tensors_do_not_fit_its_config_is_refused_before_anything_runs(tmp_path):
    ours = randomize_(build_model(TINY["llama3"]))
    export_family_hf(ours, tmp_path)
    raw = (tmp_path / "config.json").read_text().replace('"intermediate_size": 48', '"intermediate_size": 64')
    (tmp_path / "config.json").write_text(raw)
    with pytest.raises(CheckpointError, match=r"fc1.weight is \[48, 32\] but the config makes it \[64, 32\]"):
        load_hf_family(tmp_path)


# --- the presets, at their full shapes ------------------------------------------------------------

def test_the_presets_have_the_published_shapes():
    q, l1 = FAMILY_PRESETS["qwen3-0.6b"], FAMILY_PRESETS["llama3.2-1b"]
    assert (q.vocab_size, q.emb_dim, q.n_heads, q.n_kv_groups, q.head_dim_value) == (151_936, 1024, 16, 8, 128)
    assert (l1.vocab_size, l1.emb_dim, l1.n_heads, l1.n_kv_groups, l1.head_dim_value) == (128_256, 2048, 32, 8, 64)
    # the book's own dicts, field for field (its dtype aside)
    for name, book in [("qwen3-0.6b", book_qwen.QWEN_CONFIG_06_B), ("qwen3-1.7b", book_qwen.QWEN3_CONFIG_1_7B),
                       ("llama3.2-1b", book_llama.LLAMA32_CONFIG_1B), ("llama3.2-3b", book_llama.LLAMA32_CONFIG_3B)]:
        assert FAMILY_PRESETS[name].to_book_dict(book["dtype"]) == book


def test_the_books_moe_config_reads_as_a_qwen3_config_with_its_experts():
    cfg = FamilyConfig.from_book_dict("qwen3", book_qwen.QWEN3_CONFIG_30B_A3B)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_hidden_dim, cfg.n_layers) == (128, 8, 768, 48)


@pytest.mark.slow
def test_qwen3_06b_at_full_shape_gives_the_books_logits_bit_for_bit():
    cfg = family_config("qwen3-0.6b", context_length=64)  # RoPE tables for 64 positions, not 40,960
    book = BOOK["qwen3"][0](cfg.to_book_dict(torch.float32))
    book.out_head.weight = book.tok_emb.weight  # the published model's tie
    randomize_(book)
    ours = build_model(cfg)
    ours.load_state_dict(book.state_dict())
    assert ours.tied and sum(p.numel() for p in ours.parameters()) == 596_049_920
    x = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x), book(x))


# --- memory (info) --------------------------------------------------------------------------------

def stored(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in `dtype`, each tensor once (a tied head is one tensor)."""
    unique = {id(p): p for p in model.parameters()}
    return sum(p.numel() for p in unique.values()) * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("name", list(FAMILY_PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_info_counts_the_parameters_and_bytes_the_live_model_holds(name, dtype):
    from glassgpt.memory import memory_needs, parameter_table
    cfg = FAMILY_PRESETS[name]
    with torch.device("meta"):
        model = build_model(cfg)
    table = parameter_table(cfg)
    assert table["total"] == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert table["tied"] and table["total_untied"] == table["total"] + cfg.vocab_size * cfg.emb_dim
    assert memory_needs(cfg, dtype, seq_len=16)["weights"] == stored(model, dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_info_kv_cache_is_what_the_grouped_cache_allocates(family):
    from glassgpt.memory import memory_needs
    cfg = TINY[family]
    for dtype in (torch.float32, torch.bfloat16):
        assert memory_needs(cfg, dtype, batch_size=3, seq_len=20)["kv_cache"] == \
            KVCache(cfg, 3, 20, dtype=dtype).nbytes


def test_glassgpt_info_prints_the_published_sizes(capsys):
    import json
    from glassgpt.cli import main
    out = {}
    for name in ("qwen3-0.6b", "qwen3-1.7b", "llama3.2-1b", "llama3.2-3b"):
        assert main(["info", "--model", name, "--dtype", "bfloat16", "--seq-len", "1024", "--json"]) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert {n: o["parameters"]["total"] for n, o in out.items()} == {
        "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "llama3.2-1b": 1_235_814_400,
        "llama3.2-3b": 3_212_749_824}
    assert out["qwen3-0.6b"]["memory"]["weights"] == 596_049_920 * 2
    assert any("16 query heads of 128 share 8 key/value groups" in n for n in out["qwen3-0.6b"]["notes"])


def test_a_qwen3_moe_folder_asking_for_unrenormalised_routing_is_refused_in_one_line(tmp_path):
    import json
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 128,
           "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False, "vocab_size": 97,
           "max_position_embeddings": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
           "intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    import glassgpt
    with pytest.raises(ConfigError, match=r"norm_topk_prob is false"):
        glassgpt.load_model(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_glassgpt_export_writes_the_books_pth_and_an_hf_folder_of_a_family_model(family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    from glassgpt.cli import main
    ours = randomize_(build_model(TINY[family]), seed=6)
    export_family_hf(ours, tmp_path / "src")
    assert main(["export", str(tmp_path / "src"), "--format", "pth", "--out", str(tmp_path / "model.pth")]) == 0
    assert main(["export", str(tmp_path / "model.pth"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert main(["export", str(tmp_path / "model.pth"), "--format", "gguf", "--out", str(tmp_path / "m.gguf")]) == 2
    assert "--format gguf writes GPT-2's llama.cpp layout" in capsys.readouterr().err
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(load_book_family(tmp_path / "model.pth")(ids()), ours(ids()))
        torch.testing.assert_close(hf(ids()).logits, ours(ids()), rtol=0, atol=1e-5)
