"""GPTConfig: GPT-2's published sizes, and every bad value refused with a message that says the fix."""

from __future__ import annotations

import dataclasses
import json

import pytest

from glassgpt import PRESETS, GPTConfig, get_config
from glassgpt.formats.glassgpt import read_config_file as load_config
from glassgpt.errors import ConfigError, GlassError

# (emb_dim, n_layers, n_heads) from OpenAI's released hparams.json files.
GPT2_SIZES = {
    "gpt2": (768, 12, 12),
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
    "gpt2-xl": (1600, 48, 25),
}


@pytest.mark.parametrize("name", sorted(GPT2_SIZES))
def test_presets_have_gpt2_published_sizes(name):
    cfg = PRESETS[name]
    assert (cfg.emb_dim, cfg.n_layers, cfg.n_heads) == GPT2_SIZES[name]
    assert cfg.vocab_size == 50257
    assert cfg.context_length == 1024
    assert cfg.qkv_bias is True
    assert cfg.tie_embeddings is True
    assert cfg.num_classes is None
    assert cfg.head_dim == 64


def test_presets_are_the_four_gpt2_sizes_and_the_books_variant_of_each():
    assert set(PRESETS) == set(GPT2_SIZES) | {f"{name}-book" for name in GPT2_SIZES}


@pytest.mark.parametrize("name", sorted(GPT2_SIZES))
def test_book_presets_are_gpt2_sizes_without_qkv_bias_untied_with_dropout(name):
    """The book's GPT_CONFIG_124M and its siblings (tests/test_book.py checks them against its code)."""
    book = PRESETS[f"{name}-book"]
    assert dataclasses.replace(book, drop_rate=0.0, qkv_bias=True, tie_embeddings=True) == PRESETS[name]
    assert (book.drop_rate, book.qkv_bias, book.tie_embeddings) == (0.1, False, False)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["gpt2"].emb_dim = 10  # type: ignore[misc]


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError) as err:
        get_config("gpt3")
    message = str(err.value)
    assert "'gpt3'" in message
    for name in PRESETS:
        assert name in message
    assert "\n" not in message


def test_a_bad_config_file_is_one_line_and_exit_code_2_on_the_command_line(tmp_path, capsys):
    from glassgpt.cli import main
    (tmp_path / "bad.json").write_text('{"emb_dim": 10, "n_heads": 3}')
    assert main(["info", "--model", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.json: emb_dim (10) must be divisible by n_heads (3)" in err
    assert err.count("\n") == 1
    with pytest.raises(GlassError, match="n_heads"):  # and library callers catch it as a GlassError
        GPTConfig(emb_dim=10, n_heads=3)


def test_emb_dim_not_divisible_by_n_heads_names_both_and_the_choices():
    with pytest.raises(ConfigError) as err:
        GPTConfig(emb_dim=768, n_heads=7)
    message = str(err.value)
    assert "768" in message and "7" in message
    assert "12" in message  # a valid choice of n_heads is offered


@pytest.mark.parametrize("field", ["vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "8"])
def test_non_positive_or_non_integer_sizes_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        GPTConfig(**{field: value})


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_drop_rate_outside_unit_interval_is_refused(rate):
    with pytest.raises(ConfigError, match="drop_rate"):
        GPTConfig(drop_rate=rate)


def test_classifier_head_needs_untied_embeddings():
    with pytest.raises(ConfigError, match="tie_embeddings"):
        GPTConfig(num_classes=2, tie_embeddings=True)
    cfg = GPTConfig(num_classes=2, tie_embeddings=False)
    assert cfg.out_dim == 2
    with pytest.raises(ConfigError, match="num_classes"):
        GPTConfig(num_classes=1, tie_embeddings=False)


def test_overrides_replace_fields_and_keep_the_rest():
    cfg = get_config("gpt2", context_length=256, drop_rate=0.1, n_layers=None)
    assert cfg.context_length == 256
    assert cfg.drop_rate == 0.1
    assert cfg.n_layers == 12  # None means "not given"
    assert cfg.emb_dim == 768
    assert PRESETS["gpt2"].context_length == 1024  # the preset itself is untouched


def test_override_with_unknown_field_lists_valid_fields():
    with pytest.raises(ConfigError) as err:
        get_config("gpt2", n_embd=10)
    assert "n_embd" in str(err.value) and "emb_dim" in str(err.value)


def test_overrides_are_validated():
    with pytest.raises(ConfigError, match="divisible"):
        get_config("gpt2", n_heads=5)


def test_json_config_file_round_trips(tmp_path):
    cfg = GPTConfig(vocab_size=65, context_length=64, emb_dim=48, n_heads=3, n_layers=2,
                    drop_rate=0.2, qkv_bias=False, tie_embeddings=False)
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"glassgpt_version": "0.0", **cfg.to_dict()}))
    assert load_config(path) == cfg
    assert get_config(str(path)) == cfg
    assert get_config(str(path), n_layers=4) == dataclasses.replace(cfg, n_layers=4)


def test_json_config_with_only_some_fields_takes_defaults_for_the_rest(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"n_layers": 2}))
    assert get_config(str(path)) == GPTConfig(n_layers=2)


def test_json_config_with_unknown_field_is_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"n_layer": 2}))
    with pytest.raises(ConfigError, match="n_layer"):
        get_config(str(path))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_malformed_json_config_is_a_config_error(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="bad.json"):
        get_config(str(path))


def test_missing_json_config_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.json"):
        get_config(str(tmp_path / "nope.json"))


def test_to_dict_from_dict_round_trip():
    for cfg in PRESETS.values():
        assert GPTConfig.from_dict(cfg.to_dict()) == cfg
