"""explain for Qwen3 and Llama 3.2: one prompt's way through the live model, as plain data, then text.

    family_trace(model, tokenizer, "Every effort moves you") -> FamilyTrace
    tr.to_text() -> the terminal view (views/family.py)

What it records, from the real tensors of one forward pass (forward hooks, and a recording cache
that the attention hands its rotated keys and values to): ids [b, t] -> tok_emb [b, t, d] (no
pos_emb is added) -> each block's queries [b, h, t, hd] and keys/values [b, g, t, hd], shared by
h // g query heads -> final_norm -> out_head logits [b, t, V] -> the next token. Then the four
answers (model.py's questions) for this model: where V becomes d and back, the one-hot proof on
the live weights (check.py), the weight shapes, and whether the head is tied, told by storage
(`data_ptr`), never by equal values: the book's loader copies the embedding into the head, which
gives equal values in two tensors.

And what GPT-2's trace shows beside its flow, from the same forward pass: the head's logits as dot
products h . W[id] (head.py's, h being final_norm's RMSNorm output at the last position), the logit
lens (each block's output through the model's own final_norm and out_head, trace.py's), and with
`attention` every query head's causal weights over the prompt, from its queries through QK-norm and
RoPE against the rotated keys of the group it reads (`attention_of`).

Its text is views/family.py's. why_family.py answers `why` for these models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import GlassError
from ..families import is_bonus_model, is_family_model
from ..families.layers import apply_rope
from ..kinds import describe
from ..memory import parameter_table
from ..model import attention_weights
from ..prompt import encode
from ..tokenizer import Tokenizer
from .check import check_embedding_is_linear
from .head import head_products, logit_lens_of
from .result import Result

FAMILY_NAMES = {"qwen3": "Qwen3", "llama3": "Llama 3", "gemma3": "Gemma 3", "qwen3_5": "Qwen3.5", "olmo3": "OLMo 3",
                "tiny_aya": "Tiny Aya", "gemma4": "Gemma 4"}


@dataclass
class FamilyTrace(Result):
    family: str
    config: dict[str, Any]
    tokens: list[str]
    stages: list[dict[str, Any]]          # name, module, shape, note: in the order the forward pass ran them
    attention: dict[str, Any]             # the heads: q and k/v shapes, the group sharing, RoPE
    answers: dict[str, Any]               # the four questions, as facts
    params: dict[str, Any]
    next_tokens: list[dict[str, Any]] = field(default_factory=list)
    head: dict[str, Any] | None = None               # the logits as dot products h . W[id] (head.py)
    logit_lens: dict[str, Any] | None = None         # the top token at every position after every block
    attention_weights: dict[str, Any] | None = None  # shape [n_layers, h, t, t], tokens, groups, layers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def next_token(self) -> dict[str, Any]:
        """The most probable next token (as Trace.next_token names it): id, text, prob."""
        return self.next_tokens[0]


class RecordingCache:
    """What GroupedQueryAttention hands a KV cache: its rotated keys and values, kept to be read."""

    def __init__(self) -> None:
        self.pos, self.seen = 0, {}

    def layer(self, i: int) -> "RecordingCache._Layer":
        return RecordingCache._Layer(self, i)

    def advance(self, t: int) -> None:
        self.pos += t

    class _Layer:
        def __init__(self, cache: "RecordingCache", i: int):
            self.cache, self.i = cache, i

        def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.cache.seen[self.i] = (k.detach(), v.detach())
            return k, v

        def read(self) -> tuple[None, None]:
            """A linear attention's convolution inputs and state (Qwen3.5): none before the first token."""
            return None, None

        def write(self, conv: torch.Tensor, state: torch.Tensor) -> None:
            """(one forward pass from position 0: the state it ends with is not read again)"""


def family_trace(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, top_k: int = 5, *,
                 ids: list[int] | None = None, attention: bool = False, logit_lens: bool = False) -> FamilyTrace:
    """Run `text` (or its token `ids`, as the web page sends them) through a Qwen3Model or Llama3Model once
    and keep what each stage looked like; with `attention`, every query head's weights, with `logit_lens`, the
    top token after every block (as GPT-2's trace takes them: TraceOptions' attention and logit_lens)."""
    return rotary_trace(model, tokenizer, text, top_k, ids=ids, attention=attention, logit_lens=logit_lens)[0]


@torch.no_grad()
def rotary_trace(model: nn.Module, tokenizer: Tokenizer, text: str | None = None, top_k: int = 5, *,
                 ids: list[int] | None = None, attention: bool = False, logit_lens: bool = False
                 ) -> tuple[FamilyTrace, torch.Tensor]:
    """family_trace(...), and the last position's logits `[V]` of its one forward pass. The modules are found
    through the model's description (glassgpt.describe), not by its family."""
    assert is_family_model(model) or is_bonus_model(model)
    cfg, anatomy = model.cfg, describe(model)
    if attention and not is_family_model(model):  # attention_of follows Qwen3's and Llama's QK-norm and RoPE
        raise GlassError(f"{anatomy.name}'s attention weights are not traced yet: trace it without --attention")
    part = model.get_submodule
    device = part(anatomy.embedding.path).weight.device
    ids = torch.tensor([encode(tokenizer, text) if ids is None else ids], device=device)  # [1, t]
    logits, seen, kept, cache = _run_with_taps(model, anatomy, ids, attention, logit_lens)
    k, v = cache.seen[_first_causal(anatomy)]  # [1, g, t, hd], after RoPE (and QK-norm)
    b, t = ids.shape
    # the sizes as the description gives them, from the first block with keys and values (every such block has the
    # same; Qwen3.5's linear-attention blocks have sizes of their own)
    att0 = anatomy.blocks[_first_causal(anatomy)].attention
    ropes = [blk.attention.rope for blk in anatomy.blocks if blk.attention.rope is not None]
    full = [blk.attention.rope for blk in anatomy.blocks if blk.attention.rope is not None and blk.attention.window is None]
    rope = (full or ropes or [None])[0]  # a full layer's (Gemma 3's sliding layers have a base of their own)
    h, g, V, n_layers = att0.n_heads, att0.n_kv_groups, anatomy.embedding.vocab_size, anatomy.n_layers
    q_shape = (b, h, t, att0.head_dim)
    label = lambda i: _text(tokenizer, i)  # noqa: E731
    probs = torch.softmax(logits[0, -1].float(), dim=-1)
    top = probs.topk(min(top_k, V))
    next_tokens = [{"id": int(i), "text": label(int(i)), "prob": float(p)} for p, i in zip(top.values, top.indices)]
    tokens = [tokenizer.decode([int(i)]) for i in ids[0]]
    groups = [j // (h // g) for j in range(h)]
    tr = FamilyTrace(
        family=cfg.family, config={k_: v_ for k_, v_ in cfg.to_dict().items()}, tokens=tokens,
        stages=_stages(cfg, anatomy, seen, q_shape, list(k.shape), linear_stages(anatomy, b)),
        attention={"q_shape": list(q_shape), "kv_shape": list(k.shape), "group_size": h // g,
                   "groups": [list(range(j * (h // g), (j + 1) * (h // g))) for j in range(g)],
                   "qk_norm": att0.q_norm is not None, "rope_base": rope.base if rope else None,
                   "rope_scaled": any(r.scaling is not None for r in ropes), **_sliding_layers(anatomy),
                   **rope_reach(anatomy), **_kv_shared(anatomy)},
        answers=four_answers(model, ids), params=parameter_table(cfg), next_tokens=next_tokens,
        head=head_products(model, kept["final_norm"][0, -1], logits[0, -1], [n["id"] for n in next_tokens],
                           ids[0].tolist(), label))
    if logit_lens:  # each block's output through this model's final_norm (RMSNorm) and out_head
        tr.logit_lens = logit_lens_of(model, [kept[f"trf_blocks.{i}"] for i in range(n_layers)], logits, label)
    if attention:
        tr.attention_weights = {"shape": [n_layers, h, t, t], "tokens": tokens, "groups": groups,
                                "layers": _attention_layers(model, anatomy, kept, cache.seen, t)}
    return tr, logits[0, -1]


def _run_with_taps(model: nn.Module, anatomy, ids: torch.Tensor, attention: bool, logit_lens: bool):
    """One forward pass of `ids` with the taps rotary_trace reads: (logits [1, t, V], the shapes each tapped
    module saw, the outputs kept, the recording cache that holds every layer's keys and values)."""
    seen: dict[str, tuple[tuple, tuple]] = {}
    kept: dict[str, torch.Tensor] = {}
    handles = _hooks(model, anatomy, seen, kept, attention, logit_lens)
    cache = RecordingCache()
    try:
        logits = model(ids, cache)  # [1, t, V]
    finally:
        for h in handles:
            h.remove()
    return logits, seen, kept, cache


def _hooks(model: nn.Module, anatomy, seen: dict, kept: dict, attention: bool, logit_lens: bool) -> list:
    """Forward hooks on the modules the description names: the shapes they see into `seen`, the tensors the
    panels read into `kept`. Returns their handles (removed after the one forward pass)."""
    part = model.get_submodule

    def tap(name: str):
        def hook(module, inputs, output):
            seen[name] = (tuple(inputs[0].shape), tuple(output.shape))
        return hook

    def keep(name: str):
        return lambda module, inputs, output: kept.__setitem__(name, output.detach())

    first_att, first_ff = anatomy.blocks[_first_causal(anatomy)].attention, anatomy.blocks[0].ff
    taps = {"tok_emb": part(anatomy.embedding.path), "trf_blocks.0.att.W_query": part(first_att.query.path),
            "trf_blocks.0.att.W_key": part(first_att.key.path), "trf_blocks.0.att.W_value": part(first_att.value.path),
            "trf_blocks.0.ff.fc1": part(first_ff.experts.router.path if first_ff.experts else (first_ff.gate or first_ff.up).path), "final_norm": part(anatomy.final_norm.path),
            "out_head": part(anatomy.head.path)}
    handles = [m.register_forward_hook(tap(n)) for n, m in taps.items()]
    handles.append(part(anatomy.final_norm.path).register_forward_hook(keep("final_norm")))
    for i, block in enumerate(anatomy.blocks):
        if logit_lens:
            handles.append(part(block.path).register_forward_hook(keep(f"trf_blocks.{i}")))
        if attention:
            handles.append(part(block.attention.query.path).register_forward_hook(keep(f"trf_blocks.{i}.att.W_query")))
    return handles


def _sliding_layers(anatomy) -> dict[str, Any]:
    """Which layers see only a window (Gemma 3's, OLMo 3's and Tiny Aya's sliding layers), the window and their own
    RoPE base; {} if none."""
    sliding = [b for b in anatomy.blocks if b.attention.window is not None]
    if not sliding:
        return {}
    rope = sliding[0].attention.rope
    return {"sliding_layers": [b.index for b in sliding], "window": sliding[0].attention.window,
            "rope_local_base": rope.base if rope is not None else None}


def _kv_shared(anatomy) -> dict[str, Any]:
    """The layers that reuse another layer's keys and values (Gemma 4's last num_kv_shared_layers), each with its
    source layer, and the RoPE scalings by name ("proportional": Gemma 4's partial RoPE); {} for neither."""
    shared = {b.index: b.attention.kv_shared_from for b in anatomy.blocks if b.attention.kv_shared_from is not None}
    ropes = [b.attention.rope for b in anatomy.blocks if b.attention.rope is not None]
    scalings = sorted({rope.scaling for rope in ropes if rope.scaling})
    partial = [rope for rope in ropes if rope.scaling == "proportional"]
    return ({"kv_shared_from": shared} if shared else {}) | ({"rope_scalings": scalings} if scalings else {}) | (
        {"proportional_dims": [partial[0].rotary_dim, partial[0].head_dim]} if partial else {})


def _attention_layers(model: nn.Module, anatomy, kept: dict, seen_kv: dict, t: int) -> list:
    """Every layer's `[h, t, t]` weights (as lists), from its kept W_query output and rotated keys, by its own RoPE
    tables (Gemma 3's sliding and full layers have their own: `rope_of`)."""
    rope_of = getattr(model, "rope_of", lambda i: model.rope)
    return [attention_of(model.get_submodule(block.attention.path), kept[f"trf_blocks.{i}.att.W_query"],
                         seen_kv[i][0], *rope_of(i).at(0, t, seen_kv[i][0].device))[0].float().tolist()
            for i, block in enumerate(anatomy.blocks)]


def rope_reach(anatomy) -> dict[str, Any]:
    """Which layers RoPE turns, and how many of a head's dimensions (Qwen3.5: the full layers, 64 of 256; Tiny Aya:
    the sliding layers only, its full layers have no positions)."""
    turned = [block for block in anatomy.blocks if block.attention.rope is not None]
    if not turned:
        return {"rope_layers": []}
    rope = turned[0].attention.rope
    return {"rope_layers": [block.index for block in turned], "rope_dims": rope.rotary_dim or rope.head_dim}


def linear_stages(anatomy, b: int) -> list[dict[str, Any]]:
    """The linear-attention blocks (Qwen3.5's Gated DeltaNet), from the description: what they keep in place of
    keys and values. None for a model without them."""
    linear = [block for block in anatomy.blocks if block.attention.kind == "linear"]
    if not linear:
        return []
    att, state = linear[0].attention, linear[0].attention.state
    return [{"name": "linear attention", "module": att.path, "shape": [b, state.value_heads, att.head_dim,
                                                                      state.value_head_dim],
             "note": f"{len(linear)} of {anatomy.n_layers} blocks (layers {', '.join(str(x.index) for x in linear)}) "
                     f"keep no keys or values: a causal convolution over {state.conv_kernel} tokens, then a state "
                     f"[{att.head_dim}, {state.value_head_dim}] per value head, decayed and corrected by the gated "
                     "delta rule at each token; the same size at any length"}]


def _first_causal(anatomy) -> int:
    """The first block with keys and values (Qwen3.5's first three are linear attention: a state, no keys)."""
    return next(i for i, block in enumerate(anatomy.blocks) if block.attention.kind == "causal")


def _stages(cfg, anatomy, seen: dict, q_shape: tuple, kv_shape: list[int],
            linear: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stages in the order the forward pass ran them, with the shapes the taps saw (`seen`: input and output
    shapes by module name), the sizes from the model's description."""
    b, h, t, hd = q_shape
    g, d, V = anatomy.blocks[_first_causal(anatomy)].attention.n_kv_groups, anatomy.embedding.emb_dim, \
        anatomy.embedding.vocab_size
    hidden_dim = anatomy.blocks[0].ff.hidden_dim
    return [
        {"name": "ids", "module": "", "shape": [b, t], "note": "token ids"},
        {"name": "tok_emb", "module": "tok_emb", "shape": list(seen["tok_emb"][1]),
         "note": f"vocab -> hidden: row lookup in the {[V, d]} weight"
                 + (f", times sqrt({d}) = {d ** 0.5:.2f}" if anatomy.embedding.scale else "") + "; no pos_emb is added"},
        {"name": "queries", "module": "trf_blocks.N.att.W_query", "shape": list(q_shape),
         "note": f"{list(seen['trf_blocks.0.att.W_query'][1])} split into {h} heads, RoPE-rotated"},
        {"name": "keys, values", "module": "trf_blocks.N.att.W_key, W_value", "shape": kv_shape,
         "note": f"{list(seen['trf_blocks.0.att.W_key'][1])} split into {g} heads; the cache keeps these"},
        {"name": "repeat_interleave", "module": "", "shape": list(q_shape),
         "note": f"each key/value head serves {h // g} neighbouring query heads"},
        *linear,  # Qwen3.5's linear-attention blocks, where it has them
        {"name": "ff", "module": "trf_blocks.N.ff", "shape": list(seen["trf_blocks.0.ff.fc1"][1]),
         "note": f"router gate: {cfg.num_experts} expert scores; each token runs its top {cfg.num_experts_per_tok} "
                 f"SwiGLU experts, {d} -> {cfg.moe_hidden_dim} -> {d}, weighted by the softmax of their scores"
         if getattr(cfg, "num_experts", 0) else f"GeGLU: fc3(gelu_tanh(fc1(x)) * fc2(x)), {d} -> {hidden_dim} -> {d}"
         if anatomy.blocks[0].ff.kind == "geglu" else f"SwiGLU: fc3(silu(fc1(x)) * fc2(x)), {d} -> {hidden_dim} -> {d}"},
        {"name": "final_norm", "module": "final_norm", "shape": list(seen["final_norm"][1]),
         "note": {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(anatomy.final_norm.kind, anatomy.final_norm.kind)},
        {"name": "out_head", "module": "out_head", "shape": list(seen["out_head"][1]),
         "note": f"hidden -> vocab: x @ W.T with W {[V, d]}"},
    ]


def attention_of(att: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """Attention weights `[b, h, tq, s]` by the model's own modules and formula: the queries `q` (W_query's output
    `[b, tq, h*hd]`, at the positions of the `[tq, hd]` rows cos and sin) through QK-norm (Qwen3) and RoPE, against
    the rotated keys `k` a cache is handed (`[b, g, s, hd]`), each query head reading its group's
    (repeat_interleave). Query j sits at position s - tq + j and sees the positions up to it."""
    b, tq, _ = q.shape
    q = q.view(b, tq, att.num_heads, att.head_dim).transpose(1, 2)  # [b, tq, h*hd] -> [b, h, tq, hd]
    if att.q_norm is not None:
        q = att.q_norm(q)
    q = apply_rope(q, cos, sin)
    k = k.repeat_interleave(att.group_size, dim=1)  # [b, g, s, hd] -> [b, h, s, hd]
    own = getattr(att, "attention_weights", None)  # Gemma 3's: its own scale, and a sliding layer's window
    return own(q, k) if own is not None else attention_weights(q, k)


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    """The token's text; a row of tok_emb past the tokenizer's ids (Qwen3 pads 151,669 ids to 151,936 rows) says so."""
    return tokenizer.decode([token_id]) if token_id < tokenizer.n_vocab else f"<row {token_id}: no token>"


def four_answers(model: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """The four questions as facts on the live model: the two transitions, the one-hot proof, the tie."""
    anatomy = describe(model)
    emb, head = model.get_submodule(anatomy.embedding.path).weight, model.get_submodule(anatomy.head.path).weight
    one_storage = emb.data_ptr() == head.data_ptr() and emb.shape == head.shape
    equal_values = bool(emb.shape == head.shape and torch.equal(emb, head))
    return {"vocab_to_hidden": {"module": anatomy.embedding.path, "weight_shape": list(emb.shape)},
            "hidden_to_vocab": {"module": anatomy.head.path, "weight_shape": list(head.shape)},
            "one_hot": check_embedding_is_linear(model, ids, timing=False),
            "tied": one_storage, "equal_values": equal_values}


# --- what changed from GPT-2 (explain --compare gpt2) ---------------------------------------------

def _count(*modules_or_params) -> int:
    """Parameters of these modules and tensors, each tensor once (a tied one is one tensor)."""
    unique = {}
    for m in modules_or_params:
        for p in (m.parameters() if isinstance(m, nn.Module) else [m]):
            unique[id(p)] = p
    return sum(p.numel() for p in unique.values())


def _shapes(module: nn.Module) -> str:
    return ", ".join(f"{name or 'weight'} {list(p.shape)}" for name, p in module.named_parameters())


@dataclass
class GPT2Changes(Result):
    """What changed from GPT-2 to a Qwen3/Llama model: one row per stage, with both models' shapes and counts."""

    family: str
    rows: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def changes_from_gpt2(model: nn.Module, gpt2: nn.Module) -> GPT2Changes:
    """GPT-2 and a Qwen3/Llama model stage by stage, in the order of the book's GPT-to-Llama bonus chapter
    (ch05/07_gpt_to_llama), with shapes and parameter counts read from the two live models."""
    g_blk, f_blk = gpt2.trf_blocks[0], model.trf_blocks[0]
    g_att, f_att = g_blk.att, f_blk.att
    n_g, n_f = len(gpt2.trf_blocks), len(model.trf_blocks)
    cfg = model.cfg
    g_norms = [m for blk in gpt2.trf_blocks for m in (blk.norm1, blk.norm2)] + [gpt2.final_norm]
    f_norms = [m for blk in model.trf_blocks for m in (blk.norm1, blk.norm2)] + [model.final_norm]
    rows = [
        {"change": "LayerNorm -> RMSNorm", "gpt2": f"norm1: {_shapes(g_blk.norm1)} (subtracts the mean, adds a shift)",
         "family": f"norm1: {_shapes(f_blk.norm1)} (divides by the root mean square only, in float32)",
         "gpt2_params": _count(*g_norms), "family_params": _count(*f_norms)},
        {"change": "GELU -> SwiGLU",
         "gpt2": f"ff.layers.0 {list(g_blk.ff.layers[0].weight.shape)}, GELU, ff.layers.2 "
                 f"{list(g_blk.ff.layers[2].weight.shape)}, with biases",
         "family": f"silu(fc1 {list(f_blk.ff.fc1.weight.shape)}) * fc2 {list(f_blk.ff.fc2.weight.shape)}, then fc3 "
                   f"{list(f_blk.ff.fc3.weight.shape)}, no biases",
         "gpt2_params": n_g * _count(g_blk.ff), "family_params": n_f * _count(f_blk.ff)},
        {"change": "pos_emb -> RoPE", "gpt2": f"pos_emb {list(gpt2.pos_emb.weight.shape)} added to tok_emb's output",
         "family": f"no weights: cos/sin tables {list(model.rope.cos.shape)} rotate q and k inside every attention",
         "gpt2_params": _count(gpt2.pos_emb), "family_params": 0},
        {"change": "multi-head -> grouped-query attention",
         "gpt2": f"{g_att.n_heads} heads: W_query {list(g_att.W_query.weight.shape)}, W_key "
                 f"{list(g_att.W_key.weight.shape)}, W_value {list(g_att.W_value.weight.shape)}",
         "family": f"{cfg.n_heads} query heads, {cfg.n_kv_groups} key/value heads: W_query "
                   f"{list(f_att.W_query.weight.shape)}, W_key {list(f_att.W_key.weight.shape)}, W_value "
                   f"{list(f_att.W_value.weight.shape)}",
         "gpt2_params": n_g * _count(g_att), "family_params": n_f * _count(f_att.W_query, f_att.W_key, f_att.W_value,
                                                                            f_att.out_proj)},
        {"change": "QK-norm", "gpt2": "none",
         "family": f"q_norm, k_norm: {_shapes(f_att.q_norm)} each, before RoPE" if f_att.q_norm is not None
         else "none (Llama 3 has none)",
         "gpt2_params": 0, "family_params": n_f * (_count(f_att.q_norm, f_att.k_norm) if f_att.q_norm is not None else 0)},
        {"change": "the head", "gpt2": _head_words(gpt2), "family": _head_words(model),
         "gpt2_params": 0 if _tied(gpt2) else _count(gpt2.out_head),
         "family_params": 0 if _tied(model) else _count(model.out_head)},
    ]
    rows.append({"change": "total", "gpt2": f"{n_g} blocks, d {gpt2.tok_emb.weight.shape[1]}",
                 "family": f"{n_f} blocks, d {cfg.emb_dim}", "gpt2_params": _count(gpt2),
                 "family_params": _count(model)})
    return GPT2Changes(cfg.family, rows)


def _tied(model: nn.Module) -> bool:
    return model.out_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()


def _head_words(model: nn.Module) -> str:
    w = list(model.out_head.weight.shape)
    return f"out_head {w}, " + ("tok_emb's own storage (tied)" if _tied(model) else "its own weights (untied)")

