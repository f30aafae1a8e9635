"""A model's anatomy: what it is made of, as plain data that every analysis reads.

    describe(cfg) -> Anatomy         each glass model file says its own (model.py, families/qwen3.py, llama3.py)
    glassgpt.describe(model)         the same for any model object a reader built (kinds.py)

An Anatomy names each part by its module path in the described object ("trf_blocks.3.att.W_query"
in glassgpt's and the book's classes, "model.layers.3.self_attn.q_proj" in transformers'), so an
analysis finds a module through the description, never by the model's family. It is data, not a
second implementation: kinds.description_mismatches checks every described part against the module
(shapes, the tie by storage, the norm's formula on a probe), and tests/test_anatomy.py runs that
check for every kind of model glassgpt reads.

The vocabulary is wider than the three models written so far, so that the book's bonus models can be
described without changing an analysis: an embedding scaled by sqrt(d) (Gemma 3) and per-layer
embeddings (Gemma 4); norms after the sublayer (OLMo 3), on both sides (Gemma's sandwich) or one norm
for a parallel attention and feed-forward (Tiny Aya); (1 + weight) RMSNorm (Gemma); per-layer
attention kinds (sliding and full, each with its own RoPE base; a cached latent, MLA; linear attention with a recurrent
state, Qwen3.5), layers without positions, kv-shared layers and softcaps; a weightless value norm and a stored
number times each block's output (Gemma 4); GeGLU and mixtures of experts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Callable

# What each field may say (a value outside these is a description error, refused when it is built).
NORM_KINDS = ("layernorm", "rmsnorm", "rmsnorm_plus_one")  # scale*(x-mean)/std+shift; w*x/rms; (1+w)*x/rms
PLACEMENTS = ("pre", "post", "sandwich", "parallel")       # norm before, after, both sides, one norm for both
POSITION_KINDS = ("learned", "rope", "none")
ATTENTION_KINDS = ("causal", "linear")                     # linear: a recurrent state instead of a KV cache
FF_KINDS = ("gelu_mlp", "swiglu", "geglu", "moe")
# The layouts glassgpt writes a model in: the book's class's state dict (+ its config .json), transformers'
# folder (config.json + model.safetensors), llama.cpp's GPT-2 GGUF file.
EXPORTS = ("pth", "hf", "gguf")
# How generate runs it over a KV cache: glassgpt's Engine and its native step (engine/), the engine's TwinSteps over
# cache_for's KVCache or HybridCache, the glass model's own kv_cache(), or the model's own forward(ids,
# use_cache=True) and reset_kv_cache() (the book repository's cache API, kept in its modules).
DECODINGS = ("engine", "twin", "kv_cache", "own_cache")


def _one_of(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(allowed)}")


@dataclass(frozen=True)
class Linear:
    """One matrix, as nn.Linear stores it: `[out_features, in_features]`.

    rows: a slice (start, stop) of a fused module's output rows (GPT-2's c_attn holds q, k and v);
    head_rows: (block, start, stop): rows start..stop of every block of `block` rows (Qwen3.5's W_query
    holds, per head, hd query rows then hd gate rows);
    transposed: the module stores `[in, out]` (transformers' Conv1D)."""

    path: str
    in_features: int
    out_features: int
    bias: bool
    rows: tuple[int, int] | None = None
    transposed: bool = False
    head_rows: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Norm:
    """A normalisation over the last dimension: `kind` (NORM_KINDS), its weight and (LayerNorm's) bias leaves."""

    path: str
    kind: str
    dim: int
    eps: float
    weight: str | None = "weight"  # the parameter's leaf name: the book's "scale", torch's "weight"; None: no weight,
                                   # x / rms(x) alone (Gemma 4's value norm)
    bias: str | None = None      # the book's "shift", torch's "bias"; None: no shift (RMSNorm)
    role: str = ""               # in a block: attn_in, attn_out, ff_in, ff_out; q_norm, k_norm, v_norm; final

    def __post_init__(self) -> None:
        _one_of(self.kind, NORM_KINDS, "norm kind")


@dataclass(frozen=True)
class Rope:
    """Rotary positions: q and k (`rotates`) turned by an angle per position, pair i at base^(-2i/hd).

    pairs: "halves" (dimensions i and i + hd/2: the book's and transformers' layout) or "neighbours"
    (Meta's originals); rotary_dim: how many of hd's dimensions turn (None: all); scaling: a named
    frequency scaling ("llama3", "linear", "yarn") and its values as (name, value) pairs."""

    base: float
    head_dim: int
    pairs: str = "halves"
    rotates: tuple[str, ...] = ("q", "k")
    rotary_dim: int | None = None
    scaling: str | None = None
    scaling_values: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class RecurrentState:
    """What a linear attention keeps in place of a KV cache (Qwen3.5's Gated DeltaNet): per sequence, a
    `[key head_dim, value_head_dim]` state per value head, and the short causal convolution's last
    conv_kernel - 1 inputs of its conv_channels; the same bytes whatever the sequence's length.

    rule: "gated_delta" (S <- exp(g) S, then S += k (beta (v - S^T k))^T; output S^T q); gate: the output
    norm's gate (silu); beta: the step size's matrix (sigmoid); decay: the decay's (g = -exp(A_log) *
    softplus(a + dt_bias)); norm: the gated output norm, one per value head."""

    rule: str
    value_heads: int
    value_head_dim: int
    conv: str
    conv_kernel: int
    conv_channels: int
    gate: Linear
    beta: Linear
    decay: Linear
    norm: Norm


@dataclass(frozen=True)
class Attention:
    """One block's attention: h query heads, g key/value groups (h // g query heads share each), head size hd."""

    path: str
    kind: str                    # ATTENTION_KINDS
    n_heads: int
    n_kv_groups: int
    head_dim: int
    query: Linear
    key: Linear
    value: Linear
    out: Linear
    rope: Rope | None = None     # None: no positions in this layer (learned ones enter at the embedding)
    window: int | None = None    # sliding-window attention: each query sees the last `window` positions
    q_norm: Norm | None = None   # QK-norm (Qwen3): each query and key head normed before the rotation
    k_norm: Norm | None = None
    v_norm: Norm | None = None   # each value head normed too (Gemma 4's, without a weight), after the projection
    scale: float | None = None   # the scores' factor; None: 1 / sqrt(hd)
    softcap: float | None = None
    kv_shared_from: int | None = None  # a layer that reuses another layer's keys and values (Gemma 4)
    latent: Linear | None = None  # latent attention (MLA): x -> a c-wide latent, the one thing cached; then
                                  # key and value are made from it (their in_features is c, not d)
    output_gate: Linear | None = None  # context * sigmoid(gate(x)) before `out` (Qwen3.5's full layers)
    state: RecurrentState | None = None  # kind "linear": what it keeps instead of keys and values

    def __post_init__(self) -> None:
        _one_of(self.kind, ATTENTION_KINDS, "attention kind")


@dataclass(frozen=True)
class Experts:
    """A mixture of experts: a router picks `per_token` of `n_experts` feed-forwards for each token.

    The FeedForward's up, gate and down describe expert 0; expert j's are the same paths with the
    index 0 as j (the book repository's ModuleLists fc1.j, fc2.j, fc3.j under `path`)."""

    router: Linear
    n_experts: int
    per_token: int
    path: str                    # the experts' ModuleList; expert j's matrices are `FeedForward.up` etc. under it


def expert_path(path: str, j: int) -> str:
    """Expert j's module path from expert 0's: its last index 0 as j ("ff.fc1.0" -> "ff.fc1.5",
    "mlp.experts.0.gate_proj" -> "mlp.experts.5.gate_proj")."""
    parts = path.split(".")
    last = max(i for i, p in enumerate(parts) if p == "0")
    return ".".join(parts[:last] + [str(j)] + parts[last + 1:])


@dataclass(frozen=True)
class FeedForward:
    """d -> hidden -> d. gelu_mlp: down(act(up(x))); swiglu / geglu: down(act(gate(x)) * up(x))."""

    path: str
    kind: str                    # FF_KINDS
    hidden_dim: int
    activation: str              # "gelu_tanh", "gelu", "silu"
    up: Linear
    down: Linear
    gate: Linear | None = None
    activation_path: str | None = None  # the activation's own module, where it has one (GPT-2's ff.layers.1)
    experts: Experts | None = None

    def __post_init__(self) -> None:
        _one_of(self.kind, FF_KINDS, "feed-forward kind")


@dataclass(frozen=True)
class PerLayerInput:
    """A block's per-layer input (Gemma 4), added after its feed-forward:
    x + norm(projection(gelu_tanh(gate(x)) * the block's slice of the per-layer inputs))."""

    gate: Linear                 # d -> p
    projection: Linear           # p -> d
    norm: Norm                   # d


@dataclass(frozen=True)
class PerLayerInputs:
    """Gemma 4's per-layer inputs (its "E"): a second table `[vocab_size, n_layers * dim]` (at Embedding.per_layer),
    times sqrt(dim), plus `norm`(`projection`(the scaled embedding) / sqrt(d)) per layer, times 2^-0.5: one
    `dim`-wide vector per token and layer, which block i reads (Block.per_layer_input)."""

    vocab_size: int
    dim: int
    n_layers: int
    projection: Linear           # d -> n_layers * dim
    norm: Norm                   # dim


@dataclass(frozen=True)
class Block:
    """One transformer block: where its norms sit, its attention, its feed-forward.

    pre: x + att(norm1(x)), x + ff(norm2(x)); post: x + norm(att(x)) ...; sandwich: norms on both
    sides; parallel: x + att(norm(x)) + ff(norm(x)), one norm read by both."""

    index: int
    path: str
    placement: str               # PLACEMENTS
    norms: tuple[Norm, ...]
    attention: Attention
    ff: FeedForward
    layer_type: str = "full_attention"  # "sliding_attention", "linear_attention", ... as configs name them
    per_layer_input: PerLayerInput | None = None  # Gemma 4
    output_scale: str | None = None  # the block's whole output times one stored number, this leaf of the block
                                     # (Gemma 4's layer_scalar): x_out = (x + ... + per-layer input) * scale

    def __post_init__(self) -> None:
        _one_of(self.placement, PLACEMENTS, "norm placement")

    def norm(self, role: str) -> Norm | None:
        return next((n for n in self.norms if n.role == role), None)


@dataclass(frozen=True)
class Embedding:
    """ids -> vectors: a row of the `[vocab_size, emb_dim]` weight, times `scale` (Gemma: sqrt(d)) where given."""

    path: str
    vocab_size: int
    emb_dim: int
    scale: float | None = None
    per_layer: str | None = None  # Gemma 4's per-layer embeddings: their module's path
    per_layer_inputs: PerLayerInputs | None = None  # and what is made of them
    dropout: str | None = None    # the dropout the embeddings pass (GPT-2's drop_emb): its output is the first block's input


@dataclass(frozen=True)
class Positions:
    """Where positions enter: a learned `[context_length, d]` table added to the embeddings (at `path`),
    RoPE inside every attention (each block's Attention.rope says its own), or none."""

    kind: str                    # POSITION_KINDS
    context_length: int
    path: str | None = None      # the learned table's module

    def __post_init__(self) -> None:
        _one_of(self.kind, POSITION_KINDS, "positions")


@dataclass(frozen=True)
class Head:
    """hidden -> vocab (or classes): logits = x @ W.T (+ bias), times `logit_scale`, capped by `softcap`.
    tied: W is the embedding's own storage (told by data_ptr, never by equal values)."""

    path: str
    out_features: int
    tied: bool
    bias: bool = False
    logit_scale: float | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class Anatomy:
    """A whole model, from the ids to the logits."""

    name: str                    # what it is, for a reader: "GPT-2", "Qwen3", "Llama 3.2"
    source: str                  # which kind of object it describes: "glassgpt's GPTModel", "transformers' ..."
    embedding: Embedding
    positions: Positions
    blocks: tuple[Block, ...]
    final_norm: Norm
    head: Head
    config_fields: tuple[str, ...]  # the config fields the model reads
    blocks_path: str = "trf_blocks"  # the ModuleList holding the blocks
    exports: tuple[str, ...] = ()    # the layouts `glassgpt export` writes it in (EXPORTS); (): none yet
    decoding: str | None = None      # how generate runs it over a KV cache (DECODINGS); None: only without one

    def __post_init__(self) -> None:
        for layout in self.exports:
            _one_of(layout, EXPORTS, "export layout")
        if self.decoding is not None:
            _one_of(self.decoding, DECODINGS, "decoding")

    @property
    def n_layers(self) -> int:
        return len(self.blocks)

    def norms(self) -> list[Norm]:
        """Every norm, in the order the forward pass meets them (QK-norms inside their block)."""
        per_layer = self.embedding.per_layer_inputs
        found = [per_layer.norm] if per_layer else []
        for block in self.blocks:
            att = block.attention
            found += list(block.norms) + [n for n in (att.q_norm, att.k_norm, att.v_norm) if n]
            found += [block.per_layer_input.norm] if block.per_layer_input else []
        return found + [self.final_norm]

    def linears(self) -> list[Linear]:
        per_layer = self.embedding.per_layer_inputs
        found = [per_layer.projection] if per_layer else []
        for block in self.blocks:
            att, ff = block.attention, block.ff
            found += [block.per_layer_input.gate, block.per_layer_input.projection] if block.per_layer_input else []
            found += [att.query, att.key, att.value, att.out, ff.up, ff.down] + ([ff.gate] if ff.gate else [])
            found += [att.output_gate] if att.output_gate else []
            found += [att.state.gate, att.state.beta, att.state.decay] if att.state else []
            found += [att.latent] if att.latent else []
            found += [ff.experts.router] if ff.experts else []
        return found


def renamed(anatomy: Anatomy, path_of: Callable[[str], str | tuple[str, tuple[int, int] | None, bool]],
            norm_leaves: tuple[str, str | None] | None = None, source: str | None = None) -> Anatomy:
    """The same anatomy with every path mapped by `path_of` (a loader's name map): for a matrix it may
    give (path, rows, transposed), for a fused or Conv1D module. norm_leaves: the norms' (weight, bias)
    names in that object; a norm with no bias keeps none."""

    def path(p: str | None) -> str | None:
        if p is None:
            return None
        mapped = path_of(p)
        return mapped if isinstance(mapped, str) else mapped[0]

    def linear(lin: Linear | None) -> Linear | None:
        if lin is None:
            return None
        mapped = path_of(lin.path)
        if isinstance(mapped, str):
            return replace(lin, path=mapped)
        return replace(lin, path=mapped[0], rows=mapped[1], transposed=mapped[2])

    def norm(n: Norm | None) -> Norm | None:
        if n is None:
            return None
        leaves = {} if norm_leaves is None else {"weight": norm_leaves[0] if n.weight is not None else None,
                                                 "bias": norm_leaves[1] if n.bias is not None else None}
        return replace(n, path=path(n.path), **leaves)

    def block(b: Block) -> Block:
        att, ff = b.attention, b.ff
        att = replace(att, path=path(att.path), query=linear(att.query), key=linear(att.key), value=linear(att.value),
                      out=linear(att.out), q_norm=norm(att.q_norm), k_norm=norm(att.k_norm), v_norm=norm(att.v_norm),
                      latent=linear(att.latent),
                      output_gate=linear(att.output_gate))
        experts = ff.experts and replace(ff.experts, router=linear(ff.experts.router), path=path(ff.experts.path))
        ff = replace(ff, path=path(ff.path), up=linear(ff.up), down=linear(ff.down), gate=linear(ff.gate),
                     activation_path=path(ff.activation_path), experts=experts)
        own = b.per_layer_input and replace(b.per_layer_input, gate=linear(b.per_layer_input.gate),
                                            projection=linear(b.per_layer_input.projection),
                                            norm=norm(b.per_layer_input.norm))
        return replace(b, path=path(b.path), norms=tuple(norm(n) for n in b.norms), attention=att, ff=ff,
                       per_layer_input=own)

    per_layer = anatomy.embedding.per_layer_inputs
    return replace(anatomy, source=source or anatomy.source,
                   embedding=replace(anatomy.embedding, path=path(anatomy.embedding.path),
                                     dropout=path(anatomy.embedding.dropout), per_layer=path(anatomy.embedding.per_layer),
                                     per_layer_inputs=per_layer and replace(per_layer, projection=linear(
                                         per_layer.projection), norm=norm(per_layer.norm))),
                   positions=replace(anatomy.positions, path=path(anatomy.positions.path)),
                   blocks=tuple(block(b) for b in anatomy.blocks), final_norm=norm(anatomy.final_norm),
                   head=replace(anatomy.head, path=path(anatomy.head.path)), blocks_path=path(anatomy.blocks_path))


def own_description(module: object) -> Anatomy | None:
    """The description of one of glassgpt's glass modules, as the glass file that defines its class gives it
    (that file's describe(cfg) over the module's cfg, its embedding one of the module's children); None for any
    other object (a reader's module, which kinds.describe reads through a name map). A subclass made around a
    glass class (FSDP's) is still the glass module."""
    cfg = getattr(module, "cfg", None)
    children = getattr(module, "_modules", None)
    if cfg is None or not children:
        return None
    package = __name__.partition(".")[0]
    for cls in type(module).__mro__:
        file = sys.modules.get(cls.__module__)
        describe = getattr(file, "describe", None)
        if (cls.__module__.startswith(package + ".") and callable(describe)
                and getattr(describe, "__module__", None) == cls.__module__):  # the file's own, not one it imports
            try:
                anatomy = describe(cfg)
            except (AttributeError, TypeError, ValueError):  # a cfg of another kind: not this file's model
                return None
            return anatomy if isinstance(anatomy, Anatomy) and anatomy.embedding.path in children else None
    return None
