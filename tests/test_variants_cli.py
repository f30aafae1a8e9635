"""Chapter 4's variants through the commands: a config JSON that names a variant (or holds its fields, as the
repository's GPT_CONFIG_124M does) opens as that variant's glass model with random weights, in every command
that reads --model, as a GPT-2 config JSON does; a bad variant field is one line."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from glassgpt import formats
from glassgpt.config import GPTConfig
from glassgpt.memory import memory_needs
from glassgpt.training.tasks.data import evaluate_text
from glassgpt.variants import (GQAConfig, MLAConfig, MoEConfig, SWAConfig, config_from_dict, generate_text_simple_cached,
                               kv_bytes_per_token, kv_cache_bytes)
from glassgpt.variants import gqa, mla, moe, swa

from helpers import assert_one_line_error, run

SHAPE = {"vocab_size": 50257, "context_length": 32, "emb_dim": 32, "n_heads": 4, "n_layers": 3, "drop_rate": 0.0,
         "qkv_bias": False}
# The repository's GPT_CONFIG_124M of each script, as JSON (its keys: no "variant", told by its fields), tiny.
REPOSITORY_CONFIGS = {
    "gqa": SHAPE | {"n_kv_groups": 2},
    "mla": SHAPE | {"latent_dim": None},  # the repository's default: max(16, emb_dim // 8)
    "swa": SHAPE | {"sliding_window_size": 4, "sliding_window_stride": 2},
    "moe": SHAPE | {"hidden_dim": 48, "num_experts": 4, "num_experts_per_tok": 2},
}
FILES = {"gqa": gqa, "mla": mla, "swa": swa, "moe": moe}
PROMPT = "Every effort moves you"
IDS = [6109, 3626, 6100, 345]  # PROMPT in GPT-2's tokenizer


def config_file(tmp_path, values: dict, name: str = "variant.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(values), encoding="utf-8")
    return str(path)


def drawn(cfg, seed: int = 0):
    """The repository's draw: torch.manual_seed(seed), then GPTModel(cfg)."""
    torch.manual_seed(seed)
    return FILES[cfg.variant].GPTModel(cfg).eval()


@pytest.mark.parametrize("key", list(REPOSITORY_CONFIGS))
def test_a_variant_config_opens_as_its_glass_model_with_the_repositorys_draw(tmp_path, key):
    model = formats.open(config_file(tmp_path, REPOSITORY_CONFIGS[key])).load("cpu", "float32", seed=7)
    assert type(model) is FILES[key].GPTModel
    assert model.cfg == config_from_dict(REPOSITORY_CONFIGS[key]) and model.cfg.variant == key
    expected = drawn(model.cfg, seed=7).state_dict()
    assert set(model.state_dict()) == set(expected)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("cfg", [GQAConfig(n_kv_groups=3, n_heads=6, emb_dim=48), MLAConfig(latent_dim=40),
                                 SWAConfig(sliding_window_size=7, sliding_window_stride=-1),
                                 MoEConfig(num_experts=3, num_experts_per_tok=1, hidden_dim=10)],
                         ids=lambda c: c.variant)
def test_a_variant_config_written_by_to_dict_reads_back_equal(cfg):
    values = json.loads(json.dumps(cfg.to_dict()))  # through JSON, as a file holds it
    assert values["variant"] == cfg.variant
    assert config_from_dict(values) == cfg
    assert config_from_dict({k: v for k, v in values.items() if k != "variant"}) == cfg  # told by its fields


def test_a_config_of_gpt2s_fields_is_no_variant():
    assert config_from_dict(dict(SHAPE)) is None


@pytest.mark.parametrize("key", list(REPOSITORY_CONFIGS))
def test_generate_runs_a_variant_config_and_prints_its_greedy_tokens(tmp_path, capsys, key):
    spec = config_file(tmp_path, REPOSITORY_CONFIGS[key])
    code, out, err = run(["generate", PROMPT, "--model", spec, "--max-new-tokens", "6", "--json"], capsys)
    assert code == 0, err
    printed = json.loads(out)
    assert printed["prompt_ids"] == IDS
    # the tokens of the repository's own loop over the same draw (seed 0), through its cache
    model = drawn(formats.open(spec).config)
    ids = generate_text_simple_cached(model, torch.tensor([IDS]), 6)
    assert printed["new_ids"] == ids[0, len(IDS):].tolist()
    code, out, err = run(["generate", PROMPT, "--model", spec, "--max-new-tokens", "3"], capsys)
    assert code == 0 and out.startswith(PROMPT) and len(out.strip()) > len(PROMPT), err


def test_generate_compile_on_a_variant_says_it_is_skipped_and_generates(tmp_path, capsys):
    spec = config_file(tmp_path, REPOSITORY_CONFIGS["gqa"])
    code, out, err = run(["generate", PROMPT, "--model", spec, "--max-new-tokens", "2", "--compile"], capsys)
    assert code == 0 and out.startswith(PROMPT), err
    assert "--compile skipped: GPT-2 with grouped-query attention keeps its own KV cache" in err


@pytest.mark.parametrize("key", list(REPOSITORY_CONFIGS))
def test_explain_traces_a_variant_config_to_its_own_next_token(tmp_path, capsys, key):
    spec = config_file(tmp_path, REPOSITORY_CONFIGS[key])
    code, out, err = run(["explain", PROMPT, "--model", spec], capsys)
    assert code == 0, err
    with torch.no_grad():
        expected = int(drawn(formats.open(spec).config)(torch.tensor([IDS]))[0, -1].argmax())
    assert re.search(r"next token: id (\d+)", out).group(1) == str(expected)


@pytest.mark.parametrize("key", list(REPOSITORY_CONFIGS))
def test_info_shows_the_kv_bytes_per_token_beside_gpt2s(tmp_path, capsys, key):
    spec = config_file(tmp_path, REPOSITORY_CONFIGS[key])
    code, out, err = run(["info", "--model", spec, "--json"], capsys)
    assert code == 0, err
    info = json.loads(out)
    assert info["config"]["variant"] == key
    cfg = formats.open(spec).config
    ours, gpt2 = kv_bytes_per_token(cfg, torch.float32), kv_bytes_per_token(GPTConfig(**SHAPE), torch.float32)
    line = next(n for n in info["notes"] if n.startswith("KV cache:"))
    assert line.startswith(f"KV cache: {ours:,.0f} bytes per token (float32") and f"keeps {gpt2:,.0f} (" in line
    assert info["kernels"] is None  # the variant runs its glass code: no kernels timed for it
    code, out, err = run(["info", "--model", spec], capsys)
    assert code == 0 and line in out, err


@pytest.mark.parametrize("key", list(REPOSITORY_CONFIGS))
@pytest.mark.parametrize("tokens", [5, 32])
def test_the_memory_estimate_of_a_variants_cache_is_the_variants_own_figure(key, tokens):
    # (memory.py counts from the description; variants/ holds the repository's estimator formulas)
    cfg = config_from_dict(REPOSITORY_CONFIGS[key])
    for dtype in (torch.float32, torch.bfloat16):
        assert memory_needs(cfg, dtype, 2, tokens)["kv_cache"] == kv_cache_bytes(cfg, dtype, tokens, 2)


@pytest.mark.parametrize("values, words", [
    (SHAPE | {"variant": "gqx", "n_kv_groups": 2}, ["variant 'gqx' is not one of chapter 4's: gqa, mla, swa, moe"]),
    (SHAPE | {"sliding_window_size": 0, "sliding_window_stride": 2}, ["sliding_window_size", "got 0"]),
    (SHAPE | {"n_kv_groups": 3}, ["n_kv_groups must divide n_heads (4), got 3"]),
    (SHAPE | {"n_kv_groups": 2, "latent_dim": 8}, ["gqa (n_kv_groups)", "mla (latent_dim)"]),
    (SHAPE | {"variant": "mla", "n_kv_groups": 2}, ["unknown config field(s) ['n_kv_groups']"]),
], ids=["unknown-variant", "window-0", "groups-not-dividing", "two-variants", "another-variants-field"])
@pytest.mark.parametrize("command", [["info"], ["generate", PROMPT], ["explain", PROMPT]], ids=lambda c: c[0])
def test_a_bad_variant_field_is_one_line_naming_it(tmp_path, capsys, values, words, command):
    spec = config_file(tmp_path, values, "bad.json")
    code, out, err = run(command + ["--model", spec], capsys)
    assert_one_line_error(code, err, "bad.json: ", *words)


def test_export_of_a_variant_is_one_line(tmp_path, capsys):
    spec = config_file(tmp_path, REPOSITORY_CONFIGS["gqa"])
    code, out, err = run(["export", spec, "--format", "pth", "--out", str(tmp_path / "out.pth")], capsys)
    lines = [line for line in err.strip().splitlines() if not line.startswith("note:")]
    assert code == 2 and lines == [
        "error: glassgpt does not export this model (GPT-2 with grouped-query attention) yet: --format pth writes "
        "the book's class's state dict, and that layout has no place for what it changes"]
    assert not (tmp_path / "out.pth").exists()


def test_check_builds_a_readers_port_from_the_same_config_json(tmp_path, capsys):
    # the repository's GPTModel(cfg) takes the config dict: `check --config` hands it the file --model opens
    port = tmp_path / "my_gqa.py"
    port.write_text("from glassgpt.variants import config_from_dict, gqa\n\n\n"
                    "class GPTModel(gqa.GPTModel):\n"
                    "    def __init__(self, cfg: dict):\n"
                    "        super().__init__(config_from_dict(cfg))\n", encoding="utf-8")
    spec = config_file(tmp_path, REPOSITORY_CONFIGS["gqa"])
    code, out, err = run(["check", f"{port}:GPTModel", "--config", spec], capsys)
    assert code == 0, out + err
    assert out.startswith("glassgpt check: KV cache") and "your cache changes nothing" in out


def own_next_token(model) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([IDS]))[0, -1].argmax())


@pytest.mark.parametrize("key", list(REPOSITORY_CONFIGS))
def test_explain_compare_sets_a_variants_next_tokens_beside_gpt2s(tmp_path, capsys, key):
    # compare reads each model through its description: the variant's own forward, GPT-2's beside it
    spec, gpt2 = config_file(tmp_path, REPOSITORY_CONFIGS[key]), config_file(tmp_path, SHAPE, "gpt2.json")
    code, out, err = run(["explain", PROMPT, "--model", spec, "--compare", gpt2, "--format", "json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["a"]["next_token"]["id"] == own_next_token(drawn(formats.open(spec).config))
    assert result["b"]["next_token"]["id"] == own_next_token(formats.open(gpt2).load("cpu", "float32", seed=0))
    assert len(result["a"]["lens_last"]) == SHAPE["n_layers"] and result["kl_ab"] > 0.0


@pytest.mark.parametrize("key", ["swa", "moe"])
def test_diff_of_a_variant_with_itself_moves_nothing_and_gives_its_own_next_token(tmp_path, capsys, key):
    spec = config_file(tmp_path, REPOSITORY_CONFIGS[key])
    code, out, err = run(["diff", spec, spec, "--prompt", PROMPT, "--format", "json"], capsys)
    assert code == 0, err
    result = json.loads(out)["next_token"]
    expected = own_next_token(drawn(formats.open(spec).config))
    assert result["a"]["next_token"]["id"] == result["b"]["next_token"]["id"] == expected
    assert result["kl_ab"] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("key", ["mla", "swa"])
def test_a_passage_under_a_variant_scores_each_token_by_the_variants_own_probabilities(tmp_path, capsys, key):
    spec, text = config_file(tmp_path, REPOSITORY_CONFIGS[key]), tmp_path / "passage.txt"
    text.write_text(PROMPT, encoding="utf-8")
    code, out, err = run(["explain", "--passage", str(text), "--model", spec, "--format", "json"], capsys)
    assert code == 0, err
    tokens = json.loads(out)["tokens"]
    with torch.no_grad():
        probs = drawn(formats.open(spec).config)(torch.tensor([IDS]))[0].softmax(-1)
    assert [t["id"] for t in tokens] == IDS
    for i in range(1, len(IDS)):  # token i scored on those before it: the logits at position i - 1
        assert tokens[i]["prob"] == pytest.approx(float(probs[i - 1, IDS[i]]), rel=1e-4)
        assert tokens[i]["expected"]["id"] == int(probs[i - 1].argmax())


def test_eval_of_a_variant_is_its_own_next_token_cross_entropy():
    # evaluate_text is what `glassgpt eval` runs: one window of 16 tokens scored by the variant's own forward
    cfg = config_from_dict(REPOSITORY_CONFIGS["mla"])
    model = drawn(cfg)
    ids = torch.arange(100, 117)
    loss, windows = evaluate_text(model, ids.numpy(), 16)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(ids[None, :-1])[0], ids[1:]).item()
    assert windows == 1 and loss == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("recipe", ["glassgpt", "book"])
def test_eval_of_a_variant_config_gives_its_loss(tmp_path, capsys, recipe):
    spec = config_file(tmp_path, REPOSITORY_CONFIGS["swa"])
    text = tmp_path / "text.txt"
    text.write_text("Every effort moves you toward the end of the day. " * 20, encoding="utf-8")
    code, out, err = run(["eval", "--model", spec, "--data", str(text), "--context-length", "16", "--recipe", recipe,
                          "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["context_length"] == 16 and result["windows"] >= 1
    assert 0.0 < result["loss"] < 2 * math.log(SHAPE["vocab_size"])  # random weights: near ln V, never nan