"""The architecture gallery (explain/gallery.py): every figure on a card is held to the module it describes.

Each model is built at a small config of its own real shape's kind (the same layer types, the same attention,
feed-forward and norms, small widths), through the same path as its real card (gallery.real_config with the
notebook's keys overridden). Its card's parameter count must equal the sum of the module's tensors' numel, and
its cache bytes the bytes a cached forward allocates, before and after a sliding window fills; at the real
shapes the cache equals memory.py's estimate. What each card says changed from GPT-2 is
tests/test_compare_changes.py's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

from glassgpt.engine.hybrid_cache import cache_for
from glassgpt.explain.gallery import SHAPES, card, cache_bytes, gallery, real_config
from glassgpt.explain.views import draw
from glassgpt.families import build_model
from glassgpt.memory import memory_needs
from glassgpt.model import GPTModel

from helpers import assert_one_line_error, run

TINY = {"vocab_size": 64, "context_length": 32, "emb_dim": 32, "n_heads": 4}
SSSF = ["sliding_attention"] * 3 + ["full_attention"]
SMALL = {  # each real shape's keys, made small; the structure kept
    "gpt2": TINY | {"n_layers": 2},
    "qwen3": TINY | {"n_layers": 2, "hidden_dim": 48, "head_dim": 8, "n_kv_groups": 2},
    "llama3": TINY | {"n_layers": 2, "hidden_dim": 48, "n_kv_groups": 2},
    "gemma3": TINY | {"n_layers": 4, "hidden_dim": 48, "head_dim": 8, "n_kv_groups": 1, "sliding_window": 4,
                      "layer_types": SSSF, "query_pre_attn_scalar": 8},
    "olmo3": TINY | {"n_layers": 4, "hidden_dim": 48, "head_dim": 8, "n_kv_heads": 4, "sliding_window": 4,
                     "layer_types": SSSF},
    "tiny-aya": TINY | {"n_layers": 4, "hidden_dim": 48, "head_dim": 8, "n_kv_heads": 2, "sliding_window": 4,
                        "layer_types": SSSF},
    "qwen3.5": TINY | {"n_layers": 4, "hidden_dim": 48, "head_dim": 16, "n_kv_groups": 2, "linear_key_head_dim": 8,
                       "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                       "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
    "qwen3-moe": TINY | {"n_layers": 2, "head_dim": 8, "n_kv_groups": 2, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_hidden_dim": 16},
    "gemma4": TINY | {"n_layers": 4, "hidden_dim": 48, "head_dim": 8, "n_kv_heads": 2, "global_head_dim": 16,
                      "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                      "vocab_size_per_layer_input": 64, "hidden_size_per_layer_input": 4, "num_kv_shared_layers": 2},
}


def small(key: str, dtype: torch.dtype = torch.float32):
    cfg = real_config(key, **SMALL[key])
    torch.manual_seed(0)
    model = GPTModel(cfg) if key == "gpt2" else build_model(cfg)
    return cfg, model.to(dtype).eval()


def test_gemma4s_card_counts_the_per_layer_embeddings_and_no_cache_in_its_shared_layers():
    """Its per-layer table stored whole and read a row a token; its kv-shared layers keep no cache; a sliding one
    keeps its window, a full one every position."""
    cfg = real_config("gemma4", **SMALL["gemma4"])
    c = card(cfg, "gemma4", dtype=torch.float32)
    assert [layer["per_token"] for layer in c.cache] == [2 * 2 * 8 * 4, 2 * 2 * 16 * 4, 0, 0]
    assert [layer["window"] for layer in c.cache[:2]] == [4, None]
    assert "per-layer embeddings [64, 4 x 4], a row read per token" in c.embedding
    assert "1 of them reuse an earlier layer's keys and values, keeping no cache" in c.attention


def test_every_model_of_the_gallery_has_a_small_shape_here():
    assert set(SMALL) == set(SHAPES)


@pytest.mark.parametrize("key", list(SHAPES))
def test_the_parameter_count_is_the_sum_of_the_modules_numel(key):
    cfg, model = small(key)
    c = card(cfg, key)
    assert c.params == sum(p.numel() for p in model.parameters())  # a tied head once (parameters() dedups)
    if "experts" in c.feed_forward:  # a token reads its k routed experts of E: the others' weights are not read
        ff = model.trf_blocks[0].ff
        unread = sum(p.numel() for block in model.trf_blocks for fc in (block.ff.fc1, block.ff.fc2, block.ff.fc3)
                     for e in range(ff.num_experts_per_tok, ff.num_experts) for p in fc[e].parameters())
        assert unread > 0 and c.active_params == c.params - unread
    elif key == "gemma4":  # what one token reads, told by the module: the numbers its logits have a gradient for
        assert c.active_params == read_by_one_token(model) < c.params
    else:
        assert c.active_params == c.params


def read_by_one_token(model: torch.nn.Module) -> int:
    """The parameters a token's forward reads: those the last token's logits have a non-zero gradient for (random
    weights: no read number's gradient is zero by chance), on a prompt of two tokens (one alone attends with weight
    1, which gives q and k no gradient). Of the per-layer table, the last token's own row (the first token's row
    reaches it only through later layers' keys and values, so in part). None of the kv-shared layers' own k_proj,
    v_proj and k_norm is read: they have no gradient at all."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # small weights: no gelu gate saturates to an exact 0 (as it can at the default init)
        for p in model.parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1 else
                    0.1 * torch.randn(p.shape, generator=gen))
    model.zero_grad()
    model(torch.tensor([[5, 7]]))[0, -1].sum().backward()  # ids 5 and 7: not the padding row 0
    table = model.embed_tokens_per_layer.weight
    own_row = int((table.grad[7] != 0).sum())
    assert own_row == table.shape[1]  # every layer's slice of it
    return sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None and p is not table) + own_row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key", list(SHAPES))
def test_the_cache_bytes_are_what_a_cached_forward_allocates(key, dtype):
    """A prompt of t tokens, then one token more, in a cache made for t + 1 (what generate makes): before the
    sliding window fills (t = 3, window 4) and after (t = 9). A full layer keeps every position, a sliding one its
    window, a linear one its state; the card counts each."""
    cfg, model = small(key, dtype)
    c = card(cfg, key, dtype=dtype)
    make = getattr(model, "kv_cache", None) or (lambda b, max_len, dtype: cache_for(cfg, b, max_len, dtype=dtype))
    for t in (3, 9):
        cache = make(1, max_len=t + 1, dtype=dtype)
        with torch.no_grad():
            model(torch.randint(0, 64, (1, t)), cache)
            model(torch.randint(0, 64, (1, 1)), cache)
        assert cache.nbytes == cache_bytes(c, t + 1), (key, t)
    if any(layer["window"] for layer in c.cache):  # the window bounds it: 10 tokens cost less than 10 in every layer
        assert cache_bytes(c, 10) < 10 * sum(layer["per_token"] for layer in c.cache)


@pytest.mark.parametrize("key", list(SHAPES))
def test_the_cards_cache_at_the_real_shape_equals_the_memory_estimate(key):
    """Before every window fills and after (Gemma 3's 512, OLMo 3's and Tiny Aya's 4,096), in bfloat16."""
    cfg = real_config(key)
    c = card(cfg, key, dtype=torch.bfloat16)
    for tokens in (100, 10_000):
        assert cache_bytes(c, tokens) == memory_needs(cfg, torch.bfloat16, 1, tokens)["kv_cache"], tokens


def test_the_real_figures_are_the_published_sizes():
    cards = {c.key: c for c in gallery(list(SHAPES), "bfloat16").cards}
    assert cards["gpt2"].params == 124_439_808
    assert cards["gemma3"].params == 268_098_176
    assert round(cards["qwen3-moe"].params / 1e9, 1) == 30.5 and round(cards["qwen3-moe"].active_params / 1e9, 1) == 3.4
    assert cards["gpt2"].kv_bytes_per_token == 2 * 12 * 768 * 2          # keys and values of every layer, bfloat16
    assert cards["gemma3"].kv_bytes_per_token == 3 * 2 * 1 * 256 * 2     # 3 full layers of one key/value head of 256
    assert cards["gemma3"].fixed_bytes == 15 * 512 * 2 * 256 * 2         # 15 sliding layers keep 512 positions
    assert cards["qwen3.5"].kv_bytes_per_token == 6 * 2 * 2 * 256 * 2    # its 6 full layers only
    assert cards["qwen3.5"].pattern == "LLLF x6" and cards["gemma3"].pattern == "SSSSSF x3"
    # Gemma 4 E2B: the notebook's module (its kv-shared layers' unread k_proj, v_proj, k_norm among them, as the
    # released checkpoints store them); a token reads one row of the [262,144, 35 x 256] per-layer table
    e2b = cards["gemma4"]
    table, unread = 262_144 * 35 * 256, 16 * (2 * 1536 * 256 + 256) + 4 * (2 * 1536 * 512 + 512)
    assert e2b.params == 4_647_449_856 and e2b.active_params == e2b.params - table + 35 * 256 - unread
    assert e2b.kv_bytes_per_token == 3 * 2 * 1 * 512 * 2   # the 3 full layers before the shared ones, bfloat16
    assert e2b.fixed_bytes == 12 * 512 * 2 * 256 * 2       # 12 sliding ones keep 512 positions; 20 keep nothing
    assert e2b.pattern == "SSSSF x7"


def test_the_gallery_reads_no_model_file():
    """Its figures come from the descriptions; only the tests build the modules."""
    tree = ast.parse((Path(__file__).parents[1] / "src/glassgpt/explain/gallery.py").read_text())
    imported = {"." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"..model", "..families", "..families.qwen3", "..families.gemma3", "..families.olmo3",
                           "..families.tiny_aya", "..families.qwen3_5", "..families.llama3"}
    assert {"..kinds", "..formats.families"} <= imported


# --- the views and the command ---------------------------------------------------------------------

def test_the_picture_draws_a_card_per_model_and_a_square_per_layer():
    g = gallery(["gpt2", "gemma3", "qwen3.5"])
    keys = [item.key for item in g.picture().items if item.key]
    assert [k for k in keys if k.startswith("card:")] == ["card:gpt2", "card:gemma3", "card:qwen3.5"]
    assert sum(k.startswith("layer:gemma3:") for k in keys) == 18
    assert "<svg" in draw.to_svg(g.picture()) and "<svg" in g._repr_html_()


def test_the_command_prints_the_cards_and_their_figures(capsys):
    code, out, err = run(["compare", "--models", "gpt2", "gemma3", "qwen3-moe", "--tokens", "1024"], capsys)
    assert code == 0, err
    assert "Gemma 3 270M" in out and "SSSSSF x3" in out and "3,353,032,704 read per token" in out
    assert "norm placement: pre -> sandwich" in out
    code, out, _ = run(["compare", "--models", "gemma3", "--format", "json", "--tokens", "1024"], capsys)
    data = json.loads(out)
    assert data["cards"][0]["cache_bytes"] == 3 * 1024 * 1024 + 15 * 512 * 1024


def test_an_unknown_model_is_one_line_naming_the_ones_there_are(capsys):
    code, _, err = run(["compare", "--models", "gpt2", "gpt5"], capsys)
    assert_one_line_error(code, err, "'gpt5'", "qwen3-moe")


def test_the_page_serves_the_gallery_and_its_json():
    from fastapi.testclient import TestClient
    import glassgpt
    from glassgpt.explain import About
    from glassgpt.web.app import create_app
    model = GPTModel(glassgpt.GPTConfig(context_length=16, emb_dim=8, n_heads=2, n_layers=1)).eval()
    app = create_app(model, glassgpt.get_tokenizer("gpt2"), About("tiny", random_weights=True))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        page = client.get("/gallery", params={"models": "gpt2,olmo3"})
        assert page.status_code == 200 and "<svg" in page.text and "OLMo 3 7B" in page.text
        data = client.get("/api/gallery", params={"models": "qwen3.5", "tokens": 100}).json()
        assert data["cards"][0]["cache_bytes"] == cache_bytes(card(real_config("qwen3.5"), "q"), 100)
        wrong = client.get("/api/gallery", params={"models": "gpt5"})
        assert wrong.status_code == 400 and "qwen3-moe" in wrong.json()["error"]
        assert 'href="/gallery"' in client.get("/").text
