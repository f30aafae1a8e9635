"""glassgpt.check on a reader's Qwen3 or Llama 3 port: each mistake planted in a copy of the book's classes.

Each port is the book's own Qwen3Model or Llama3Model (llms_from_scratch) with one mistake put in: its
attention's forward replaced by a copy of the book's with one line changed, its feed-forward's
likewise, its RoPE tables computed wrongly, or its RMSNorms' eps or precision changed. The check must
name the first stage that differs and the mistake that reproduces it; the book's classes as they are
pass at every stage.
"""

from __future__ import annotations

from types import MethodType

import pytest
import torch

import glassgpt
import llms_from_scratch.llama3 as book_llama
import llms_from_scratch.qwen3 as book_qwen
from glassgpt.families import FamilyConfig, RopeFreq

QWEN = FamilyConfig(family="qwen3", vocab_size=97, context_length=24, emb_dim=32, n_heads=4, n_layers=2,
                    hidden_dim=48, head_dim=16, n_kv_groups=2, rope_base=1_000_000.0, qk_norm=True, norm_eps=1e-6)
LLAMA = FamilyConfig(family="llama3", vocab_size=97, context_length=24, emb_dim=32, n_heads=4, n_layers=2,
                     hidden_dim=48, n_kv_groups=2, rope_base=500_000.0, norm_eps=1e-5,
                     rope_freq=RopeFreq(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                        original_context_length=4))
BOOK = {"qwen3": book_qwen, "llama3": book_llama}


def book_port(cfg: FamilyConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The book's own class for `cfg` in `dtype` (its config's), every parameter random (norm scales around 1)."""
    module = BOOK[cfg.family]
    model = (module.Qwen3Model if cfg.family == "qwen3" else module.Llama3Model)(cfg.to_book_dict(dtype))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(1.0 + noise if "norm" in name else noise * 2)
    return model.eval()


def rope_interleaved(x, cos, sin):
    """A reader's RoPE on neighbouring pairs (Meta's original layout), with the book's tables."""
    t, hd = x.shape[2], x.shape[-1]
    c = cos[:t, : hd // 2].repeat_interleave(2, dim=-1)
    s = sin[:t, : hd // 2].repeat_interleave(2, dim=-1)
    pairs = x.view(*x.shape[:-1], hd // 2, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x * c + rotated * s).to(x.dtype)


def attention_forward(self, x, mask, cos, sin, mistake=None):
    """The book's GroupedQueryAttention.forward (qwen3.py's; llama3.py's is the same without QK-norm),
    with one of a reader's mistakes."""
    b, num_tokens, _ = x.shape
    rope = rope_interleaved if mistake == "rope_interleaved" else book_qwen.apply_rope
    queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
    keys = self.W_key(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
    values = self.W_value(x).view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
    q_norm = getattr(self, "q_norm", None)
    if q_norm is not None and mistake not in ("no_qk_norm", "qk_norm_after_rope"):
        queries, keys = self.q_norm(queries), self.k_norm(keys)
    queries, keys = rope(queries, cos, sin), rope(keys, cos, sin)
    if mistake == "rope_on_values":
        values = rope(values, cos, sin)
    if mistake == "qk_norm_after_rope":
        queries, keys = self.q_norm(queries), self.k_norm(keys)
    if mistake == "repeat":
        keys, values = keys.repeat(1, self.group_size, 1, 1), values.repeat(1, self.group_size, 1, 1)
    else:
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
    attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask[:num_tokens, :num_tokens], -torch.inf)
    attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
    context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
    return self.out_proj(context)


def swapped_feed_forward(self, x):
    return self.fc3(torch.nn.functional.silu(self.fc2(x)) * self.fc1(x))


def plant_attention(model, mistake):
    for blk in model.trf_blocks:
        blk.att.forward = MethodType(lambda self, *a, m=mistake: attention_forward(self, *a, mistake=m), blk.att)
    return model


def plant_tables(model, cfg, base=None, scaled=True):
    module = BOOK[cfg.family]
    kwargs = dict(head_dim=cfg.head_dim_value, theta_base=base or cfg.rope_base, context_length=cfg.context_length)
    if cfg.family == "llama3":
        kwargs["freq_config"] = model.cfg["rope_freq"] if scaled else None
    model.cos, model.sin = module.compute_rope_params(**kwargs)
    return model


def norms(model):
    return [m for m in model.modules() if isinstance(m, (book_qwen.RMSNorm, torch.nn.RMSNorm))]


def plant_eps(model, eps):
    for norm in norms(model):
        norm.eps = eps
    return model


def plant_bf16_norm(model):
    for norm in norms(model):
        norm.qwen3_compatible = False
    return model


def plant_swap(model):
    for blk in model.trf_blocks:
        blk.ff.forward = MethodType(swapped_feed_forward, blk.ff)
    return model


PLANTED = [
    ("rope_interleaved", QWEN, lambda m: plant_attention(m, "rope_interleaved"), "trf_blocks.0.att",
     "RoPE rotates neighbouring pairs"),
    ("rope_interleaved", LLAMA, lambda m: plant_attention(m, "rope_interleaved"), "trf_blocks.0.att",
     "RoPE rotates neighbouring pairs"),
    ("rope_on_values", LLAMA, lambda m: plant_attention(m, "rope_on_values"), "trf_blocks.0.att",
     "RoPE is applied to the values too"),
    ("no_qk_norm", QWEN, lambda m: plant_attention(m, "no_qk_norm"), "trf_blocks.0.att", "QK-norm is missing"),
    ("qk_norm_after_rope", QWEN, lambda m: plant_attention(m, "qk_norm_after_rope"), "trf_blocks.0.att",
     "QK-norm runs after RoPE"),
    ("repeat", QWEN, lambda m: plant_attention(m, "repeat"), "trf_blocks.0.att", "use repeat_interleave"),
    ("repeat", LLAMA, lambda m: plant_attention(m, "repeat"), "trf_blocks.0.att", "use repeat_interleave"),
    ("no_freq_scaling", LLAMA, lambda m: plant_tables(m, LLAMA, scaled=False), "trf_blocks.0.att",
     "Llama 3's RoPE frequency scaling is missing"),
    ("rope_base", QWEN, lambda m: plant_tables(m, QWEN, base=10_000.0), "trf_blocks.0.att",
     "RoPE runs with theta base 10,000, not the config's rope_base 1,000,000"),
    ("norm_eps", QWEN, lambda m: plant_eps(m, 1e-5), "trf_blocks.0.norm1", "RMSNorm's eps is 1e-05, not 1e-06"),
    ("norm_eps", LLAMA, lambda m: plant_eps(m, 1e-6), "trf_blocks.0.norm1", "RMSNorm's eps is 1e-06, not 1e-05"),
    ("norm_low_precision", QWEN, lambda m: plant_bf16_norm(book_port(QWEN, dtype=torch.bfloat16)), "trf_blocks.0.norm1", "RMSNorm is computed in bfloat16"),
    ("gate_up_swapped", QWEN, plant_swap, "trf_blocks.0.ff", "SwiGLU's gate and up are swapped"),
    ("gate_up_swapped", LLAMA, plant_swap, "trf_blocks.0.ff", "SwiGLU's gate and up are swapped"),
]


@pytest.mark.parametrize("mistake, cfg, plant, stage, words", PLANTED,
                         ids=[f"{p[0]}-{p[1].family}" for p in PLANTED])
def test_check_names_the_first_wrong_stage_and_the_planted_mistake(mistake, cfg, plant, stage, words):
    result = glassgpt.check(plant(book_port(cfg)))
    assert not result.ok
    assert result.first.name == stage
    assert result.mistake == mistake
    assert words in result.finding
    assert all(s.ok for s in result.stages[:result.stages.index(result.first)])


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen3", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_books_own_classes_pass_at_every_stage(cfg, dtype):
    result = glassgpt.check(book_port(cfg, dtype=dtype))
    assert result.ok, result.to_text()
    assert result.notes == []


def test_a_tie_that_copies_is_named_by_storage():
    # the book's load_weights_into_qwen, given a tied checkpoint, copies the embedding into the head
    cfg = QWEN
    source = book_port(cfg, seed=2)
    params = {"model.embed_tokens.weight": source.tok_emb.weight.detach()}
    from glassgpt.formats.families import hf_names
    state = source.state_dict()
    params.update({hf: state[b] for b, hf in hf_names(FamilyConfig(**{**cfg.to_dict(), "tie_embeddings": True}))})
    port = book_port(cfg)
    book_qwen.load_weights_into_qwen(port, cfg.to_book_dict(torch.float32), params)
    result = glassgpt.check(port)
    assert result.ok
    assert result.notes and "is a copy, not the same tensor (its data_ptr differs)" in result.notes[0]
    port.out_head.weight = port.tok_emb.weight  # a real tie: no note
    assert glassgpt.check(port).notes == []


def test_glassgpt_check_runs_a_readers_qwen3_file(tmp_path, capsys):
    import json
    from glassgpt.cli import main
    (tmp_path / "my_qwen3.py").write_text(
        "import llms_from_scratch.qwen3 as book\n\n\n"
        "class Qwen3Model(book.Qwen3Model):\n"
        "    def __init__(self, cfg):\n"
        "        super().__init__(cfg)\n"
        "        cos, sin = book.compute_rope_params(cfg['head_dim'], theta_base=10_000, context_length=cfg['context_length'])\n"
        "        self.register_buffer('cos', cos, persistent=False)  # the wrong base: 10,000 instead of cfg's\n"
        "        self.register_buffer('sin', sin, persistent=False)\n")
    (tmp_path / "qwen.json").write_text(json.dumps(QWEN.to_book_dict("float32")))
    assert main(["check", f"{tmp_path / 'my_qwen3.py'}:Qwen3Model", "--config", str(tmp_path / "qwen.json")]) == 1
    out = capsys.readouterr().out
    assert "trf_blocks.0.att is the first stage that differs" in out
    assert "RoPE runs with theta base 10,000, not the config's rope_base 1,000,000" in out
