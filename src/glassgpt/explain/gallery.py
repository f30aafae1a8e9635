"""The architecture gallery: one card per model, drawn from its description at its real shape.

    gallery(["gpt2", "qwen3", "gemma3"]) -> Gallery      the cards, side by side (views/gallery.py)
    card(cfg, "a name") -> Card                          any config glassgpt describes (a small one in the tests)
    cache_bytes(card, tokens) -> int                     the KV cache, or state, of one sequence of `tokens`

The book's author keeps a gallery of hand-drawn cards, one per model; glassgpt draws the same cards from the
models' own descriptions (anatomy.py: each glass file's describe(cfg)), so a card says what the code builds.
Each card holds the block (where its norms sit, its attention kind, its feed-forward, its position signal),
its layers by type (sliding, full, linear), the parameter count, and the bytes the cache keeps per token and
per sequence. Nothing is built: the real shapes (Qwen3 30B-A3B's 128 experts in 48 blocks) are counted from
the description alone, and tests/test_gallery.py holds every figure to the module it describes, built at a
small config (the parameters to the sum of its tensors' numel, the cache to the bytes a cached forward
allocates) and to memory.py's estimate of the KV cache.

The real shapes are the book's: GPT-2 124M (chapter 4), the presets of Qwen3 0.6B and Llama 3.2 1B, and the
config dicts of the bonus notebooks (ch05/11 to 17), read as glassgpt reads a notebook's config JSON.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .. import anatomy as an
from ..config import family_config, get_config
from ..errors import ConfigError
from ..formats.families import config_from_book
from ..kinds import describe_config
from .compare import what_changed
from .result import Result

# Each model's real shape: a preset, or the notebook's config dict (its `dtype` is the card's: --dtype).
_LAYERS_GEMMA3 = (["sliding_attention"] * 5 + ["full_attention"]) * 3
_LAYERS_OLMO3 = (["sliding_attention"] * 3 + ["full_attention"]) * 8
_LAYERS_AYA = (["sliding_attention"] * 3 + ["full_attention"]) * 9
_LAYERS_QWEN35 = (["linear_attention"] * 3 + ["full_attention"]) * 6
_LAYERS_GEMMA4_E2B = (["sliding_attention"] * 4 + ["full_attention"]) * 7
SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": {"name": "GPT-2 124M", "from": "chapter 4's GPT-2 (glassgpt's preset gpt2: OpenAI's, tied)",
             "preset": "gpt2"},
    "qwen3": {"name": "Qwen3 0.6B", "from": "ch05/11_qwen3 (glassgpt's preset qwen3-0.6b)", "family": "qwen3-0.6b"},
    "llama3": {"name": "Llama 3.2 1B", "from": "ch05/07_gpt_to_llama (glassgpt's preset llama3.2-1b)",
               "family": "llama3.2-1b"},
    "gemma3": {"name": "Gemma 3 270M", "from": "ch05/12_gemma3 GEMMA3_CONFIG_270M", "book": {
        "vocab_size": 262_144, "context_length": 32_768, "emb_dim": 640, "n_heads": 4, "n_layers": 18,
        "hidden_dim": 2048, "head_dim": 256, "qk_norm": True, "n_kv_groups": 1, "rope_local_base": 10_000.0,
        "rope_base": 1_000_000.0, "sliding_window": 512, "layer_types": _LAYERS_GEMMA3, "query_pre_attn_scalar": 256}},
    "olmo3": {"name": "OLMo 3 7B", "from": "ch05/13_olmo3 OLMO3_CONFIG_7B", "book": {
        "vocab_size": 100_278, "context_length": 65_536, "emb_dim": 4_096, "n_heads": 32, "n_layers": 32,
        "hidden_dim": 11_008, "head_dim": 128, "n_kv_heads": 32, "attention_bias": False, "sliding_window": 4_096,
        "layer_types": _LAYERS_OLMO3, "rope_base": 500_000.0, "rope_attention_factor": 1.2079441541679836,
        "rope_type": "yarn", "rope_factor": 8.0, "rope_orig_max": 8_192, "beta_fast": 32.0, "beta_slow": 1.0,
        "rms_norm_eps": 1e-6}},
    "tiny-aya": {"name": "Tiny Aya 3.35B", "from": "ch05/15_tiny-aya TINY_AYA_CONFIG", "book": {
        "vocab_size": 262_144, "context_length": 500_000, "emb_dim": 2048, "n_heads": 16, "n_layers": 36,
        "hidden_dim": 11_008, "head_dim": 128, "n_kv_heads": 4, "attention_bias": False, "sliding_window": 4096,
        "layer_types": _LAYERS_AYA, "rope_base": 50_000.0, "layer_norm_eps": 1e-5, "logit_scale": 1.0,
        "tie_word_embeddings": True}},
    "qwen3.5": {"name": "Qwen3.5 0.8B", "from": "ch05/16_qwen3.5 QWEN3_5_CONFIG (tied, as the released weights)",
                "book": {"vocab_size": 248_320, "context_length": 262_144, "emb_dim": 1_024, "n_heads": 8,
                         "n_layers": 24, "hidden_dim": 3_584, "head_dim": 256, "qk_norm": True, "n_kv_groups": 2,
                         "rope_base": 10_000_000.0, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
                         "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                         "linear_num_key_heads": 16, "linear_num_value_heads": 16, "layer_types": _LAYERS_QWEN35,
                         "tie_embeddings": True}},
    "qwen3-moe": {"name": "Qwen3 30B-A3B", "from": "ch05/11_qwen3 standalone-qwen3-moe QWEN3_CONFIG", "book": {
        "vocab_size": 151_936, "context_length": 262_144, "emb_dim": 2048, "n_heads": 32, "n_layers": 48,
        "head_dim": 128, "qk_norm": True, "n_kv_groups": 4, "rope_base": 10_000_000.0, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_hidden_dim": 768, "tie_embeddings": False}},
    "gemma4": {"name": "Gemma 4 E2B", "from": "ch05/17_gemma4 get_gemma4_dense_config(\"E2B\")", "book": {
        "vocab_size": 262_144, "vocab_size_per_layer_input": 262_144, "emb_dim": 1536, "hidden_dim": 4 * 1536,
        "n_layers": 35, "n_heads": 8, "head_dim": 256, "n_kv_heads": 1, "num_global_kv_heads": None,
        "global_head_dim": 512, "context_length": 131_072, "sliding_window": 512, "layer_types": _LAYERS_GEMMA4_E2B,
        "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
        "attention_k_eq_v": False, "rope_local_base": 10_000.0, "rope_local_type": "default",
        "rope_global_base": 1_000_000.0, "rope_global_type": "proportional", "rope_global_partial_rotary_factor": 0.25,
        "layer_norm_eps": 1e-6, "final_logit_softcap": 30.0, "tie_word_embeddings": True, "pad_token_id": 0}},
}
LETTERS = {"full_attention": "F", "sliding_attention": "S", "linear_attention": "L"}  # a layer's letter on a card


def real_config(key: str, **overrides: Any):
    """The config of SHAPES[key], with `overrides` (the notebook's keys; the tests shrink a model this way)."""
    if key not in SHAPES:
        raise ConfigError(f"no gallery card for {key!r}: choose from {', '.join(SHAPES)}")
    shape = SHAPES[key]
    if "preset" in shape:
        return get_config(shape["preset"], **overrides)
    if "family" in shape:
        return family_config(shape["family"], **overrides)
    return config_from_book(shape["book"] | overrides)


@dataclass
class Card(Result):
    """One model: its block, its layers by type, and its figures (parameters; cache bytes at `dtype`)."""

    key: str
    name: str
    source: str                     # where its shape came from
    shape: dict[str, int]           # vocab_size, emb_dim, n_layers, context_length
    embedding: str
    positions: str
    norm: str
    placement: str                  # anatomy.PLACEMENTS
    attention: str                  # the attention kind(s), in words
    feed_forward: str
    head: str
    layers: list[dict[str, Any]]    # one per layer type: type, count, attention, window, rope_base, bytes
    pattern: str                    # the layer types in order, a letter each (LETTERS), its period once
    params: int                     # stored (a tied head once)
    active_params: int              # what one token reads (a mixture: its routed experts only)
    dtype: str
    cache: list[dict[str, int | None]]  # per layer: per_token bytes, window (None: all), fixed bytes (a state)
    changes: list[dict[str, str]] = field(default_factory=list)  # what changed from GPT-2 (compare.what_changed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def kv_bytes_per_token(self) -> int:
        """What the cache grows by per token once every window is full: the layers that keep every position."""
        return sum(c["per_token"] for c in self.cache if c["window"] is None)

    @property
    def fixed_bytes(self) -> int:
        """What the cache holds whatever the length, once the windows are full: the sliding layers' windows and
        the linear layers' states."""
        return sum(c["fixed"] + (c["per_token"] * c["window"] if c["window"] else 0) for c in self.cache)


def cache_bytes(card: Card, tokens: int, batch_size: int = 1) -> int:
    """Bytes of the cache of `batch_size` sequences of `tokens`: a full layer keeps every position, a sliding
    layer its last `window`, a linear layer its state, whatever the length."""
    return batch_size * sum(c["per_token"] * (tokens if c["window"] is None else min(tokens, c["window"])) + c["fixed"]
                            for c in card.cache)


@dataclass
class Gallery(Result):
    """Cards side by side, at one dtype; `tokens`: the sequence length the cache is shown at."""

    cards: list[Card]
    dtype: str
    tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "tokens": self.tokens,
                "cards": [c.to_dict() | {"kv_bytes_per_token": c.kv_bytes_per_token, "fixed_bytes": c.fixed_bytes,
                                         "cache_bytes": cache_bytes(c, self.tokens)} for c in self.cards]}


def gallery(keys: list[str], dtype: torch.dtype | str = torch.bfloat16, tokens: int = 8192) -> Gallery:
    """The cards of the models named (SHAPES' keys), at their real shapes, with the cache at `tokens`."""
    if not keys:
        raise ConfigError(f"name at least one model: {', '.join(SHAPES)}")
    if not isinstance(tokens, int) or tokens <= 0:
        raise ConfigError(f"tokens must be a positive integer, got {tokens!r}")
    gpt2 = describe_config(real_config("gpt2"))
    cards = [card(real_config(k), SHAPES[k]["name"], key=k, source=SHAPES[k]["from"], dtype=dtype, gpt2=gpt2)
             for k in dict.fromkeys(keys)]
    return Gallery(cards, _dtype_name(dtype), tokens)


def card(cfg, name: str, key: str = "", source: str = "", dtype: torch.dtype | str = torch.bfloat16,
         gpt2: an.Anatomy | None = None) -> Card:
    """The card of a model of `cfg`, from its description alone (nothing is built)."""
    a = describe_config(cfg)
    size = torch.empty((), dtype=_dtype(dtype)).element_size()
    total, active = parameter_count(a)
    groups = layer_groups(a, size)
    first = a.blocks[0]
    return Card(key or name, name, source or a.source,
                {"vocab_size": a.embedding.vocab_size, "emb_dim": a.embedding.emb_dim, "n_layers": a.n_layers,
                 "context_length": a.positions.context_length},
                embedding_words(a.embedding), positions_words(a), norm_words(a), first.placement,
                "; ".join(g["attention"] for g in groups), feed_forward_words(first.ff) + _wider(a), head_words(a.head),
                groups,
                layer_pattern([b.layer_type for b in a.blocks]), total, active, _dtype_name(dtype),
                [layer_cache(b.attention, size) for b in a.blocks],
                what_changed(a, gpt2 or describe_config(get_config("gpt2"))))


# --- the figures, from the description --------------------------------------------------------------

def _linear(lin: an.Linear | None) -> int:
    return 0 if lin is None else lin.in_features * lin.out_features + (lin.out_features if lin.bias else 0)


def _norm(n: an.Norm | None) -> int:
    return 0 if n is None else n.dim * (2 if n.bias else 1)


def parameter_count(a: an.Anatomy) -> tuple[int, int]:
    """(stored, read per token): every matrix, norm, table and state parameter the description names, a tied
    head once; a mixture's experts all stored, `per_token` of them read. Gemma 4's per-layer embeddings are all
    stored, and a token reads its one row of them (n_layers * p numbers); a kv-shared layer reads its source
    layer's keys and values, and its own k_proj, v_proj and k_norm (the notebook builds them, the released
    checkpoints store them, no forward reads them) are stored and never read."""
    emb = a.embedding.vocab_size * a.embedding.emb_dim
    pos = a.positions.context_length * a.embedding.emb_dim if a.positions.kind == "learned" else 0
    head = 0 if a.head.tied else a.head.out_features * a.embedding.emb_dim + (a.head.out_features if a.head.bias else 0)
    total = active = emb + pos + head + _norm(a.final_norm)
    pl = a.embedding.per_layer_inputs
    if pl is not None:  # the second table, and the projection of the embedding mixed into it
        mixed = _linear(pl.projection) + _norm(pl.norm)
        total += pl.vocab_size * pl.n_layers * pl.dim + mixed
        active += pl.n_layers * pl.dim + mixed
    for block in a.blocks:
        att, ff = block.attention, block.ff
        st = att.state
        matrices = {(lin.path, lin.rows, lin.head_rows): lin for lin in  # a fused matrix's slices, each once
                    (att.query, att.key, att.value, att.out, att.output_gate, att.latent,
                     *((st.gate, st.beta, st.decay) if st else ())) if lin is not None}
        own = sum(map(_linear, matrices.values())) + sum(map(_norm, (*block.norms, att.q_norm, att.k_norm)))
        if st is not None:  # the depthwise convolution's [c, 1, kernel], the decay's A_log and dt_bias, the norm
            own += st.conv_channels * st.conv_kernel + 2 * st.value_heads + _norm(st.norm)
        if block.per_layer_input is not None:  # Gemma 4: its gate, projection and norm on the per-layer input
            pli = block.per_layer_input
            own += _linear(pli.gate) + _linear(pli.projection) + _norm(pli.norm)
        # a kv-shared layer's keys and values are its source's (counted there): its own copies are stored, unread
        unread = _linear(att.key) + _linear(att.value) + _norm(att.k_norm) if att.kv_shared_from is not None else 0
        expert = _linear(ff.up) + _linear(ff.down) + _linear(ff.gate)
        if ff.experts is None:
            total, active = total + own + expert, active + own - unread + expert
        else:
            router = _linear(ff.experts.router)
            total += own + router + ff.experts.n_experts * expert
            active += own - unread + router + ff.experts.per_token * expert
    return total, active


def layer_cache(att: an.Attention, size: int) -> dict[str, int | None]:
    """What one layer's cache keeps: keys and values of its g groups of hd (a latent's width, for MLA) per
    position, up to its window; or a linear layer's state: the float32 [value heads, key hd, value hd] and the
    convolution's last kernel - 1 inputs of its channels, whatever the length. A layer that reuses another's
    keys and values keeps none."""
    if att.kind == "linear":
        st = att.state
        fixed = st.value_heads * att.head_dim * st.value_head_dim * 4 + st.conv_channels * (st.conv_kernel - 1) * size
        return {"per_token": 0, "window": None, "fixed": fixed}
    if att.kv_shared_from is not None:
        return {"per_token": 0, "window": None, "fixed": 0}
    width = att.latent.out_features if att.latent is not None else 2 * att.n_kv_groups * att.head_dim
    return {"per_token": width * size, "window": att.window, "fixed": 0}


# --- the words, from the description ----------------------------------------------------------------

def embedding_words(e: an.Embedding) -> str:
    scale = f", times sqrt({e.emb_dim}) = {e.scale:.2f}" if e.scale else ""
    pl = e.per_layer_inputs
    per_layer = (f" + per-layer embeddings [{pl.vocab_size:,}, {pl.n_layers} x {pl.dim}], a row read per token"
                 if pl is not None else " + per-layer embeddings" if e.per_layer else "")
    return f"tok_emb [{e.vocab_size:,}, {e.emb_dim:,}]{scale}{per_layer}"


def rope_words(r: an.Rope | None) -> str:
    if r is None:
        return "no position signal"
    part = f" on {r.rotary_dim} of {r.head_dim} dims" if r.rotary_dim and r.rotary_dim < r.head_dim else ""
    scaling = f", {r.scaling} scaling" if r.scaling else ""
    return f"RoPE base {r.base:,.0f}{part}{scaling}"


def positions_words(a: an.Anatomy) -> str:
    if a.positions.kind == "learned":
        return f"learned pos_emb [{a.positions.context_length:,}, {a.embedding.emb_dim:,}], added once"
    by_type: dict[str, set[str]] = {}
    for b in a.blocks:
        if b.attention.kind != "linear":
            by_type.setdefault(b.layer_type, set()).add(rope_words(b.attention.rope))
    if len({w for ws in by_type.values() for w in ws}) == 1:
        only = len(by_type) == 1 and all(b.attention.kind != "linear" for b in a.blocks)
        return next(iter(by_type.values())).pop() + (" in every layer" if only else
                                                      f" in the {' and '.join(map(_type_name, by_type))} layers")
    return "; ".join(f"{_type_name(t)}: {', '.join(sorted(ws))}" for t, ws in by_type.items())


NORM_NAMES = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm", "rmsnorm_plus_one": "RMSNorm (1 + weight)"}


def norm_words(a: an.Anatomy) -> str:
    n = a.final_norm
    return NORM_NAMES[n.kind] + (" without a shift" if n.kind == "layernorm" and n.bias is None else "")


def attention_words(att: an.Attention) -> str:
    if att.kind == "linear":
        st = att.state
        return (f"linear attention ({st.rule.replace('_', ' ')}): {att.n_heads} key heads of {att.head_dim}, "
                f"{st.value_heads} states [{att.head_dim}, {st.value_head_dim}]")
    h, g, hd = att.n_heads, att.n_kv_groups, att.head_dim
    heads = f"MHA, {h} heads of {hd}" if g == h else f"GQA, {h} query heads share {g} key/value head{'s' * (g > 1)} of {hd}"
    extra = [f"window {att.window:,}" if att.window else "", "QK-norm" if att.q_norm else "",
             "gated output" if att.output_gate else "",
             f"reuses layer {att.kv_shared_from}'s keys and values" if att.kv_shared_from is not None else "",
             f"MLA latent {att.latent.out_features}" if att.latent else "",
             f"softcap {att.softcap:g}" if att.softcap else ""]
    return ", ".join([heads, *filter(None, extra)])


def feed_forward_words(ff: an.FeedForward) -> str:
    names = {"gelu_mlp": "GELU MLP", "swiglu": "SwiGLU", "geglu": "GeGLU", "moe": "SwiGLU"}
    width = f"{ff.up.in_features:,} -> {ff.hidden_dim:,} -> {ff.down.out_features:,}"
    if ff.experts is None:
        return f"{names[ff.kind]} {width}"
    return f"{ff.experts.n_experts} {names[ff.kind]} experts ({width}), {ff.experts.per_token} routed a token"


def _wider(a: an.Anatomy) -> str:
    """Where some layers' feed-forward is another width (Gemma 4 E2B's double-wide kv-shared layers)."""
    other = [b for b in a.blocks if b.ff.hidden_dim != a.blocks[0].ff.hidden_dim]
    return f"; {other[0].ff.hidden_dim:,} wide in {len(other)} layers ({other[0].index} on)" if other else ""


def head_words(h: an.Head) -> str:
    words = ["tied to tok_emb" if h.tied else "its own weights"]
    words += [f"logits times {h.logit_scale:g}"] if h.logit_scale else []
    words += [f"softcap {h.softcap:g}"] if h.softcap else []
    return f"out_head [{h.out_features:,}]: " + ", ".join(words)


def layer_groups(a: an.Anatomy, size: int) -> list[dict[str, Any]]:
    """The layers by type, in the order each type first appears: how many, their attention, window, RoPE and cache."""
    counts = Counter(b.layer_type for b in a.blocks)
    first = {b.layer_type: b for b in reversed(a.blocks)}
    groups = []
    for t in dict.fromkeys(b.layer_type for b in a.blocks):
        att = first[t].attention
        shared = sum(b.layer_type == t and b.attention.kv_shared_from is not None for b in a.blocks)
        reuse = f"; {shared} of them reuse an earlier layer's keys and values, keeping no cache" if shared else ""
        groups.append({"layer_type": t, "count": counts[t], "attention": f"{counts[t]} {_type_name(t)}: "
                       + attention_words(att) + reuse, "window": att.window,
                       "rope": rope_words(att.rope) if att.kind != "linear" else "none (a recurrent state)",
                       "cache": layer_cache(att, size)})
    return groups


def layer_pattern(types: list[str]) -> str:
    """The layer types as letters, the shortest repeating unit once: "SSSSSF x3" for Gemma 3 270M."""
    letters = "".join(LETTERS.get(t, "?") for t in types)
    n = len(letters)
    period = next(p for p in range(1, n + 1) if n % p == 0 and letters[:p] * (n // p) == letters)
    return letters[:period] + (f" x{n // period}" if period < n else "")


def _type_name(layer_type: str) -> str:
    return {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}.get(
        layer_type, layer_type)


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ConfigError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return found


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(_dtype(dtype)).removeprefix("torch.")
