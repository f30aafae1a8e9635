"""What changed from GPT-2 (explain/compare.py's what_changed), read from two descriptions: each line on the
model that has the change (at its real shape, the gallery's: explain/gallery.py) and absent from one that has not.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from glassgpt.explain.compare import what_changed
from glassgpt.explain.gallery import real_config
from glassgpt.kinds import describe_config


GPT2 = describe_config(real_config("gpt2"))
CHANGES = [  # (what, a model that has it, words its row holds, a model that has it not)
    ("embedding_scale", "gemma3", "sqrt(640) = 25.30", "qwen3"),
    ("positions", "qwen3", "RoPE", "gpt2"),
    ("no_positions", "tiny-aya", "9 full layers have no position signal", "gemma3"),
    ("norm", "qwen3", "RMSNorm", "gpt2"),
    ("norm", "tiny-aya", "LayerNorm without a shift", "gpt2"),
    ("placement", "olmo3", "post-norm", "qwen3"),
    ("placement", "gemma3", "sandwich", "llama3"),
    ("placement", "tiny-aya", "parallel", "qwen3.5"),
    ("groups", "qwen3", "16 query heads share 8 key/value heads", "olmo3"),
    ("sliding", "gemma3", "15 sliding layers (window 512; RoPE base 10,000) and 3 full layers (RoPE base 1,000,000)",
     "qwen3"),
    ("sliding", "tiny-aya", "9 full layers (no RoPE)", "llama3"),
    ("linear_attention", "qwen3.5", "a state of [16, 128, 128]", "qwen3"),
    ("qk_norm", "qwen3", "each query and key head normed on its own (over hd = 128)", "llama3"),
    ("qk_norm", "olmo3", "over the whole projection (4,096 and 4,096 wide", "gpt2"),
    ("geglu", "gemma3", "gelu_tanh", "qwen3"),
    ("swiglu", "llama3", "silu", "gemma3"),
    ("experts", "qwen3-moe", "8 of 128 experts", "qwen3"),
    ("tie", "olmo3", "own weights", "qwen3"),
    ("value_norm", "gemma4", "x / rms(x) per head (no weight)", "gemma3"),
    ("kv_shared", "gemma4", "the last 20 of 35 layers compute no keys or values", "gemma3"),
    ("per_layer_inputs", "gemma4", "a second table [262,144, 35 x 256]", "gemma3"),
    ("output_scale", "gemma4", "(x + att + ff + per-layer input) * layer_scalar", "gemma3"),
]


def rows(key: str, **overrides) -> dict[str, dict[str, str]]:
    return {r["what"]: r for r in what_changed(describe_config(real_config(key, **overrides)), GPT2)}


@pytest.mark.parametrize("what, has, words, has_not", CHANGES)
def test_each_change_is_on_the_model_that_has_it_and_not_on_one_that_has_not(what, has, words, has_not):
    found = rows(has)
    assert what in found and words in found[what]["model"], found.get(what)
    assert what not in rows(has_not)


def test_gpt2_has_nothing_changed_from_itself():
    assert what_changed(GPT2, GPT2) == []


def test_the_logit_scale_and_the_softcap_are_changes_where_the_head_has_them():
    assert "logit_scale" not in rows("tiny-aya")  # the notebook's 1.0: no scale
    assert "(h @ W.T) * 0.125" in rows("tiny-aya", logit_scale=0.125)["logit_scale"]["model"]
    gemma = describe_config(real_config("gemma3"))
    capped = replace(gemma, head=replace(gemma.head, softcap=30.0))  # Gemma 2's and 4's final softcap
    assert "30 * tanh" in {r["what"]: r for r in what_changed(capped, GPT2)}["softcap"]["model"]
    assert "softcap" not in rows("gemma3")


@pytest.mark.parametrize("key", ["gemma3", "olmo3", "tiny-aya", "qwen3-moe"])
def test_explain_compare_gpt2_says_what_changed_for_the_notebooks_pth(key, tmp_path, capsys):
    """The notebook's .pth with its config JSON beside it, as a reader saves it; the rows are the live module's."""
    import json
    import torch
    from glassgpt.explain.compare import changes_of
    from glassgpt.families import build_model
    from glassgpt.model import GPTModel
    from helpers import run
    small = {"vocab_size": 50257, "context_length": 32, "emb_dim": 32, "n_heads": 4, "n_layers": 4, "head_dim": 8}
    small |= {"gemma3": {"hidden_dim": 48, "n_kv_groups": 1, "sliding_window": 4, "query_pre_attn_scalar": 8,
                         "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
              "olmo3": {"hidden_dim": 48, "n_kv_heads": 4, "sliding_window": 4,
                        "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
              "tiny-aya": {"hidden_dim": 48, "n_kv_heads": 2, "sliding_window": 4,
                           "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
              "qwen3-moe": {"n_kv_groups": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_hidden_dim": 16}}[key]
    cfg = real_config(key, **small)
    model = build_model(cfg)
    torch.save(model.state_dict(), tmp_path / "model.pth")
    book = cfg.to_book_dict("float32") if hasattr(cfg, "to_book_dict") else cfg.to_dict()
    (tmp_path / "model.json").write_text(json.dumps(book))
    code, out, err = run(["explain", "Every effort moves you", "--model", str(tmp_path / "model.pth"), "--compare",
                          "gpt2", "--tokenizer", "gpt2", "--format", "json"], capsys)
    assert code == 0, err
    expected = changes_of(model, GPTModel(real_config("gpt2", n_layers=1)))
    assert json.loads(out)["rows"] == expected.rows and expected.rows == what_changed(describe_config(cfg), GPT2)
