"""Any GPT-2-shaped nn.Module, taken as it is: a glassgpt GPTModel over the module's own tensors.

    adopt(module, ids) -> GPTModel (or, for a Qwen3 or Llama 3 module, the glass model of its family)

The seam every function that takes a model goes through (explain, why, generate, eval, diff):
the book's GPTModel (with or without its `mask` buffers) or a reader's copy with the book's
names, nanoGPT's GPT, transformers' GPT2LMHeadModel (its Conv1D matrices are read transposed),
or glassgpt's own; and the book's next models, Qwen3 and Llama 3 (families/adopt.py: the book's
classes, their KV-cache variants, transformers' Qwen3ForCausalLM and LlamaForCausalLM). Nothing is copied: every parameter of the returned model is a view of the
module's storage, so it sees the module's weights as they change. The config is read from the
tensors' shapes and the module's attributes (the head count from `num_heads` / `n_head`).

The first time a module is used with a prompt, glassgpt's forward is checked against the
module's own logits (once per module); a module that computes something else is refused in one
line that points to `glassgpt.check(model)`, so no number shown is from a model that is not the
reader's. `adopted_from(model)` is the one line that says which kind was recognised.

`check_computable(model, tokenizer)` is the one check, before any analysis runs, that a model's
weights can compute at all: on the meta device, NaN or infinite values, or fewer rows of tok_emb
than the tokenizer has ids are each one line. Every function that runs a model calls it (through
`adopt(model, ids)` or directly).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from .config import GPTConfig
from .errors import ConfigError, GlassError, NonFiniteError, PromptError
from .families import FamilyConfig, is_bonus_model, is_family_model
from .families.adopt import build_family_glass, family_layout, family_line
from .families.bonus_hf import bonus_glass
from .model import GPTModel
from .tokenizer import Tokenizer, check_fits
from .variants import variant_of

# The logits check: max |ours - theirs| <= TOLERANCE[dtype] * max(1, max |theirs|). float32 leaves
# room for F.layer_norm and fused attention, which differ from the book's formulas in the last bits;
# float64 for the book's GELU, whose sqrt(2/pi) is a float32 number (1e-8 from transformers' in float64).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 1e-2}

LOOKED_FOR = ("the book's names (tok_emb, pos_emb, trf_blocks, final_norm, out_head), nanoGPT's or "
              "transformers' (transformer.wte, transformer.wpe, transformer.h, transformer.ln_f, lm_head)")


@dataclass
class Layout:
    """What one kind of module holds, in glassgpt's names: the tensors and where each stage is."""

    kind: str
    tensors: dict[str, torch.Tensor]
    n_heads: int | None
    stages: dict[str, str]             # glassgpt's stage name -> the module's submodule path
    eps: float = 1e-5
    drop_rate: float = 0.0
    exact_gelu: bool = False
    notes: list[str] = field(default_factory=list)
    family: FamilyConfig | None = None  # a Qwen3 or Llama 3 module: the config its glass model is built from


@dataclass
class _Adoption:
    model: GPTModel
    layout: Layout
    fingerprint: tuple
    verdict: str | None = None         # None: not checked yet; "" matched; else the refusal


_ADOPTED: "weakref.WeakKeyDictionary[nn.Module, _Adoption]" = weakref.WeakKeyDictionary()


def adopt(module: nn.Module, ids: torch.Tensor | Sequence[int] | None = None, *, described: bool = False) -> GPTModel:
    """`module` as a glassgpt GPTModel sharing its tensors; `ids` (`[b, t]` or `[t]`): a prompt on
    which, the first time the module is used with one, its own logits are checked against
    glassgpt's forward. Raises a one-line GlassError for a module of no known kind, on mixed
    devices or dtypes, or whose logits glassgpt's forward does not reproduce; with `ids` (it is
    about to compute), also for weights that cannot compute (check_computable) and ids past its rows.
    A Qwen3 or Llama 3 glass model (families/), or OLMo 3 or Tiny Aya (BONUS_MODELS), is returned as it is,
    checked the same way.
    described: the caller reads the model through its description only (the trace), so chapter 4's
    variants (variants/), which every other caller refuses in one line, are returned as they are too."""
    if described and variant_of(module):
        if ids is not None:
            check_computable(module)
            check_prompt_ids(ids, module.cfg.vocab_size)
        return module
    glass = isinstance(module, GPTModel) or is_family_model(module) or is_bonus_model(module)
    if glass or isinstance(getattr(module, "model", None), GPTModel):
        if ids is not None:  # about to compute on it
            check_computable(module)
            check_prompt_ids(ids, module.cfg.vocab_size)
        return module if glass else module.model  # an engine runs a GPTModel
    if not isinstance(module, nn.Module):
        raise GlassError(f"a model must be an nn.Module, got {type(module).__name__}")
    if ids is not None:
        check_computable(module)
    bonus = bonus_glass(module)  # transformers' OLMo 3 or Cohere2 (Tiny Aya): the glass model over its tensors
    if bonus is not None:
        if ids is not None:
            check_prompt_ids(ids, bonus.cfg.vocab_size)
            _check_bonus_logits(module, bonus, ids)
        return bonus
    adoption = _adoption(module)
    if ids is not None:
        check_prompt_ids(ids, adoption.model.cfg.vocab_size)
    if ids is not None and adoption.verdict is None:
        adoption.verdict = _check_logits(module, adoption, ids)
    if adoption.verdict:
        raise GlassError(adoption.verdict)
    return adoption.model


@torch.no_grad()
def _check_bonus_logits(module: nn.Module, glass: nn.Module, ids) -> None:
    """The module's own logits against the glass model's over its tensors, once per glass model."""
    if getattr(glass, "logits_checked", False):
        return
    batch = torch.as_tensor(ids, dtype=torch.long, device=glass.tok_emb.weight.device)
    batch = batch[None] if batch.dim() == 1 else batch
    theirs, ours = module(batch).logits.float(), glass(batch).float()
    allowed = TOLERANCE.get(glass.tok_emb.weight.dtype, 1e-4) * max(1.0, float(theirs.abs().max()))
    diff = float((ours - theirs).abs().max())
    if not diff <= allowed:
        raise GlassError(f"{type(module).__name__}'s logits differ from glassgpt's {type(glass).__name__} over its "
                         f"own tensors by {diff:.3g} (allowed {allowed:.3g}): its forward is not the one described")
    glass.logits_checked = True


def check_computable(model: nn.Module, tokenizer: Tokenizer | None = None) -> None:
    """Refuse, in one line, a model whose weights cannot compute, before anything runs on it:
    tensors on the meta device (shapes without values), NaN or infinite values (naming the first
    such tensor and how many values), or, with `tokenizer`, fewer rows of tok_emb than the
    tokenizer has ids. Each tensor is summed (a NaN or inf makes the sum one), and a module whose
    tensors have not changed since they last passed is not read again."""
    if not isinstance(model, nn.Module):
        raise GlassError(f"a model must be an nn.Module, got {type(model).__name__}")
    tensors = [(name, t) for name, t in (*model.named_parameters(), *model.named_buffers())]
    meta = [name for name, t in tensors if t.is_meta]
    if meta:
        more = f" and {len(meta) - 1:,} more" if len(meta) > 1 else ""
        raise GlassError(f"{type(model).__name__}'s weights are on the meta device ({meta[0]}{more}: shapes "
                         "without values), so nothing can be computed: load its weights first, e.g. "
                         "model.to_empty(device='cpu') then model.load_state_dict(...), or load it without "
                         "device_map='meta' / init_empty_weights")
    _check_finite(model, [(n, t) for n, t in tensors if t.is_floating_point() or t.is_complex()])
    if tokenizer is not None:
        vocab = adopt(model, described=True).cfg.vocab_size
        check_fits(tokenizer, vocab, f"ids {vocab:,} and up have no row in tok_emb; pass the model's own tokenizer")


def check_prompt_ids(ids: torch.Tensor | Sequence[int], vocab_size: int) -> None:
    """Refuse a prompt id past the model's tok_emb (it would be an IndexError deep in the forward)."""
    batch = torch.as_tensor(ids) if not isinstance(ids, torch.Tensor) else ids
    if batch.numel() and (int(batch.min()) < 0 or int(batch.max()) >= vocab_size):
        bad = int(batch.max()) if int(batch.max()) >= vocab_size else int(batch.min())
        raise PromptError(f"token id {bad:,} is out of range for this model: its vocab_size is {vocab_size:,} "
                          f"(ids 0..{vocab_size - 1:,}); encode the prompt with the model's own tokenizer")


_FINITE: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _check_finite(model: nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> None:
    stamp = _stamp(tensors)
    if stamp is not None and _FINITE.get(model) == stamp:
        return
    with torch.inference_mode():  # also reads inference tensors (a model loaded under inference_mode, FSDP's shards)
        # an FSDP/DTensor parameter: each rank reads the shard it holds
        tensors = [(name, t.to_local() if hasattr(t, "to_local") else t) for name, t in tensors]
        sums = [_sum(t) for _, t in tensors]
        suspects = [(name, t) for (name, t), s in zip(tensors, sums) if not bool(torch.isfinite(s))]
        broken = []
        for name, t in suspects:  # a sum overflows on huge finite values: count exactly before blaming
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if nan or inf:
                broken.append((name, t, nan, inf))
    if broken:
        name, t, nan, inf = broken[0]
        held = " and ".join(f"{n:,} {what}" for n, what in ((nan, "NaN"), (inf, "inf")) if n)
        others = len(broken) - 1
        more = f" (and {others:,} more tensor{'s' if others > 1 else ''})" if others else ""
        raise NonFiniteError(f"the model's weights cannot compute: {name} holds {held} of its {t.numel():,} values"
                             f"{more}, so every score after it would be NaN: load an earlier checkpoint (a run "
                             "that diverged saves such weights), or find what wrote them")
    if stamp is not None:
        _FINITE[model] = stamp


def _sum(t: torch.Tensor, rows: int = 1 << 20) -> torch.Tensor:
    """The sum of `t` (NaN or inf if it holds one), in float32 or wider, a slice of at most about `rows`
    values at a time: a bf16 tensor widened whole would double the weights' memory for a moment."""
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    if t.dim() == 0 or t.dtype == dtype or t.numel() <= rows:
        return t.sum(dtype=dtype)
    step = max(1, rows // max(1, t[0].numel()))
    return sum(chunk.sum(dtype=dtype) for chunk in t.split(step))


def _stamp(tensors: list[tuple[str, torch.Tensor]]) -> tuple | None:
    """What changes when a tensor is replaced or written in place; None for inference tensors (no version)."""
    try:
        return tuple((t.data_ptr(), t._version) for _, t in tensors)
    except RuntimeError:
        return None


def read_in_place(module: nn.Module) -> tuple[GPTModel, Layout]:
    """`module` as a GPTModel over its tensors and its Layout, without the logits check (check() uses
    it to find where a module that fails that check parts from the book's formulas)."""
    adoption = _adoption(module)
    return adoption.model, adoption.layout


def adopted_from(model: nn.Module) -> str | None:
    """The one line saying which kind of module `model` was taken from (None: glassgpt's own)."""
    return getattr(model, "adopted_from", None)


def adopted_kind(model: nn.Module) -> str | None:
    """The name of the kind `model` was taken from, e.g. "nanoGPT's GPT" (None: glassgpt's own)."""
    return getattr(model, "adopted_kind", None)


def is_added(p: torch.Tensor) -> bool:
    """Whether `p` is a zero bias or shift glassgpt added where the reader's module has none."""
    return getattr(p, "added_by_glassgpt", False)


def own_parameters(module: nn.Module) -> int:
    """The parameters of `module` (a model or one of its parts) without those glassgpt added: the
    count the reader's own module has (parameters() yields a tied matrix once)."""
    return sum(p.numel() for p in module.parameters() if not is_added(p))


def layout_of(module: nn.Module) -> Layout:
    """The kind of `module` and its tensors in glassgpt's names; a one-line GlassError if none fits."""
    if variant_of(module):  # GPT-2's names, another computation: never read as GPT-2 (docs/variants.md)
        raise GlassError(f"{type(module).__module__}.GPTModel is one of chapter 4's variants, which glassgpt's "
                         "why, compare and generate do not read yet (trace and check do): generate with "
                         "glassgpt.variants.generate_text_simple_cached(model, ids, max_new_tokens)")
    children = dict(module.named_children())
    if {"tok_emb", "pos_emb", "trf_blocks", "final_norm", "out_head"} <= set(children):
        return _book_layout(module)
    transformer = children.get("transformer")
    if transformer is not None and {"wte", "wpe", "h", "ln_f"} <= set(dict(transformer.named_children())):
        return _gpt2_layout(module, transformer)
    names = ", ".join(children) or "none"
    raise GlassError(f"{type(module).__name__} is not a GPT-2-shaped model glassgpt can read: it looks for "
                     f"{LOOKED_FOR}; this module's top-level children are: {names}")


# --- the kinds ------------------------------------------------------------------------

def _book_layout(module: nn.Module) -> Layout:
    """The book's GPTModel or a reader's copy: glassgpt's names already, `mask` buffers left out;
    or the book's GPTModelFast (one qkv matrix, `proj`, nn.LayerNorm's weight and bias)."""
    d = module.tok_emb.weight.shape[1]
    tensors = {}
    for name, t in module.named_parameters(remove_duplicate=False):
        tensors.update(_book_names(name, t, d))
    att = module.trf_blocks[0].att
    n_heads = _head_count(att, ("num_heads", "n_heads", "n_head"), module)
    stages = {"tok_emb": "tok_emb", "pos_emb": "pos_emb", "final_norm": "final_norm", "out_head": "out_head"}
    for i in range(len(module.trf_blocks)):
        stages.update({f"trf_blocks.{i}{s}": f"trf_blocks.{i}{s}" for s in ("", ".norm1", ".att", ".norm2", ".ff")})
    ff = module.trf_blocks[0].ff
    act = ff.layers[1] if isinstance(getattr(ff, "layers", None), nn.Sequential) and len(ff.layers) > 1 else None
    kind = (f"the book's {type(module).__name__}" if type(module).__module__.startswith("llms_from_scratch")
            else f"{type(module).__name__} with the book's names (a reader's copy)")
    return Layout(kind, tensors, n_heads, stages, _eps(module.final_norm), _drop(module, "drop_emb"),
                  _is_exact_gelu(act))


def _book_names(name: str, t: torch.Tensor, d: int) -> dict[str, torch.Tensor]:
    head, _, leaf = name.rpartition(".")
    if head.endswith(".att.qkv"):  # one [3d, d] matrix: the queries' rows, then the keys', then the values'
        return {f"{head[:-3]}{w}.{leaf}": t[j * d:(j + 1) * d] for j, w in enumerate(("W_query", "W_key", "W_value"))}
    if head.endswith(".att.proj"):
        return {f"{head[:-4]}out_proj.{leaf}": t}
    if head.endswith(("norm1", "norm2", "final_norm")) and leaf in ("weight", "bias"):  # nn.LayerNorm's names
        return {f"{head}.{'scale' if leaf == 'weight' else 'shift'}": t}
    return {name: t}


def _gpt2_layout(module: nn.Module, tr: nn.Module) -> Layout:
    """nanoGPT's GPT (nn.Linear matrices, [out, in]) or transformers' GPT2LMHeadModel (Conv1D, [in, out])."""
    d = tr.wte.weight.shape[1]
    conv1d = tuple(tr.h[0].attn.c_attn.weight.shape) == (d, 3 * d)
    kind = "transformers' GPT2LMHeadModel" if conv1d else "nanoGPT's GPT"

    def w(linear: nn.Module) -> torch.Tensor:  # as nn.Linear stores it, [out, in]: a transposed view for Conv1D
        return linear.weight.t() if conv1d else linear.weight

    tensors = {"tok_emb.weight": tr.wte.weight, "pos_emb.weight": tr.wpe.weight,
               "final_norm.scale": tr.ln_f.weight, "final_norm.shift": tr.ln_f.bias}
    stages = {"tok_emb": "transformer.wte", "pos_emb": "transformer.wpe", "final_norm": "transformer.ln_f",
              "out_head": "lm_head"}
    for i, blk in enumerate(tr.h):
        p, qkv = f"trf_blocks.{i}", w(blk.attn.c_attn)
        for j, name in enumerate(("W_query", "W_key", "W_value")):
            tensors[f"{p}.att.{name}.weight"] = qkv[j * d:(j + 1) * d]
            if blk.attn.c_attn.bias is not None:
                tensors[f"{p}.att.{name}.bias"] = blk.attn.c_attn.bias[j * d:(j + 1) * d]
        tensors.update({
            f"{p}.att.out_proj.weight": w(blk.attn.c_proj), f"{p}.att.out_proj.bias": blk.attn.c_proj.bias,
            f"{p}.norm1.scale": blk.ln_1.weight, f"{p}.norm1.shift": blk.ln_1.bias,
            f"{p}.norm2.scale": blk.ln_2.weight, f"{p}.norm2.shift": blk.ln_2.bias,
            f"{p}.ff.layers.0.weight": w(blk.mlp.c_fc), f"{p}.ff.layers.0.bias": blk.mlp.c_fc.bias,
            f"{p}.ff.layers.2.weight": w(blk.mlp.c_proj), f"{p}.ff.layers.2.bias": blk.mlp.c_proj.bias})
        stages.update({p: f"transformer.h.{i}", f"{p}.norm1": f"transformer.h.{i}.ln_1",
                       f"{p}.att": f"transformer.h.{i}.attn", f"{p}.norm2": f"transformer.h.{i}.ln_2",
                       f"{p}.ff": f"transformer.h.{i}.mlp"})
    head = module.lm_head
    tensors["out_head.weight"] = head.weight
    if getattr(head, "bias", None) is not None:
        tensors["out_head.bias"] = head.bias
    attn = tr.h[0].attn
    n_heads = _head_count(attn, ("n_head", "num_heads", "n_heads"), module)
    act = getattr(tr.h[0].mlp, "gelu", None) or getattr(tr.h[0].mlp, "act", None)
    tensors = {name: t for name, t in tensors.items() if t is not None}  # bias=False: zeros, in _fill_missing
    return Layout(kind, tensors, n_heads, stages, _eps(tr.ln_f), _drop(tr, "drop"), _is_exact_gelu(act))


def _head_count(att: nn.Module, names: tuple[str, ...], module: nn.Module) -> int | None:
    for name in names:
        value = getattr(att, name, None)
        if isinstance(value, int):
            return value
    config = getattr(module, "config", None)
    for source in (config, getattr(module, "cfg", None)):
        value = source.get("n_heads") if isinstance(source, dict) else getattr(source, "n_head", None)
        if isinstance(value, int):
            return value
    return None


def _eps(norm: nn.Module) -> float:
    eps = getattr(norm, "eps", 1e-5)
    return float(eps) if isinstance(eps, (int, float)) else 1e-5


def _drop(module: nn.Module, name: str) -> float:
    drop = getattr(module, name, None)
    return float(drop.p) if isinstance(drop, nn.Dropout) else 0.0


def _is_exact_gelu(act: nn.Module | None) -> bool:
    return isinstance(act, nn.GELU) and act.approximate == "none"


# --- building the GPTModel over the module's tensors -----------------------------------

def _adoption(module: nn.Module) -> _Adoption:
    fingerprint = tuple((p.data_ptr(), p.dtype, p.device) for p in module.parameters())
    found = _ADOPTED.get(module)
    if found is not None and found.fingerprint == fingerprint:
        return found
    family = family_layout(module)
    if family is not None:
        kind, cfg, tensors, stages = family
        layout = Layout(kind, tensors, cfg.n_heads, stages, cfg.norm_eps, family=cfg)
    else:
        layout = layout_of(module)
    _check_placement(module)
    found = _Adoption(_build_family(module, layout) if layout.family else _build(module, layout), layout, fingerprint)
    _ADOPTED[module] = found
    return found


def _check_placement(module: nn.Module) -> None:
    params = list(module.parameters())
    devices = sorted({str(p.device) for p in params})
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    if len(devices) > 1:
        raise GlassError(f"{type(module).__name__}'s tensors are on {' and '.join(devices)}: move it to one "
                         f"device first (model.to('{devices[0]}'))")
    if len(dtypes) > 1:
        raise GlassError(f"{type(module).__name__}'s tensors are in {' and '.join(dtypes)}: give them one dtype "
                         "first (model.to(torch.float32))")


def config_of(module: nn.Module, layout: Layout) -> GPTConfig:
    """The GPTConfig that `layout`'s tensors and the module's attributes say."""
    t = layout.tensors
    vocab, d = t["tok_emb.weight"].shape
    n_layers = len({k.split(".")[1] for k in t if k.startswith("trf_blocks.")})
    out_rows = t["out_head.weight"].shape[0]
    tied = _same_view(t["out_head.weight"], t["tok_emb.weight"])
    n_heads = layout.n_heads or (d // 64 if d % 64 == 0 else 1)
    try:
        return GPTConfig(vocab_size=vocab, context_length=t["pos_emb.weight"].shape[0], emb_dim=d, n_heads=n_heads,
                         n_layers=n_layers, drop_rate=layout.drop_rate, qkv_bias="trf_blocks.0.att.W_query.bias" in t,
                         tie_embeddings=tied, num_classes=None if out_rows == vocab and "out_head.bias" not in t
                         else out_rows)
    except ConfigError as err:
        raise GlassError(f"{type(module).__name__}: {err}") from None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _build(module: nn.Module, layout: Layout) -> GPTModel:
    cfg = config_of(module, layout)
    with torch.device("meta"):
        glass = GPTModel(cfg)
    assigned = set()
    for name, tensor in layout.tensors.items():
        if name == "out_head.weight" and cfg.tie_embeddings:
            continue
        owner, _, leaf = name.rpartition(".")
        target = glass.get_submodule(owner) if _has_submodule(glass, owner) else None
        expected = getattr(target, leaf, None)
        if expected is None:
            raise GlassError(f"{type(module).__name__} has a tensor glassgpt's GPT-2 does not: {name} "
                             f"{list(tensor.shape)}")
        if expected.shape != tensor.shape:
            raise GlassError(f"{type(module).__name__}: {name} is {list(tensor.shape)} but its config "
                             f"({_config_line(cfg)}) wants {list(expected.shape)}")
        setattr(target, leaf, nn.Parameter(tensor.detach(), requires_grad=False))  # a view: nothing copied
        assigned.add(name)
    glass.tie_weights()
    for blk in glass.trf_blocks:
        blk.norm1.eps = blk.norm2.eps = layout.eps
        if layout.exact_gelu:  # nanoGPT's nn.GELU(): the exact erf, where the book writes the tanh form
            blk.ff.layers[1] = nn.GELU()
    glass.final_norm.eps = layout.eps
    _fill_missing(glass, module, layout, assigned)
    n_heads = "" if layout.n_heads else f"; n_heads {cfg.n_heads} by GPT-2's rule of 64 per head (none found)"
    gelu = ", its exact GELU" if layout.exact_gelu else ""
    glass.adopted_from = "; ".join([f"{layout.kind} ({_config_line(cfg)}{gelu}), read in place{n_heads}"] + layout.notes)
    glass.adopted_kind = layout.kind
    return glass.eval()


def _build_family(module: nn.Module, layout: Layout) -> nn.Module:
    glass = build_family_glass(module, layout.family, layout.tensors)
    glass.adopted_from = f"{layout.kind} ({family_line(layout.family)}), read in place"
    glass.adopted_kind = layout.kind
    return glass


def _has_submodule(glass: GPTModel, path: str) -> bool:
    try:
        glass.get_submodule(path)
        return True
    except AttributeError:
        return False


def _fill_missing(glass: GPTModel, module: nn.Module, layout: Layout, assigned: set[str]) -> None:
    """Zeros for the biases and shifts a module was built without (the same computation); any
    other tensor glassgpt needs and the module lacks is one line naming it."""
    for name, p in list(glass.named_parameters()):
        if name in assigned or not p.is_meta:  # (a module on the meta device is read as it is)
            continue
        if not name.endswith((".bias", ".shift")):
            raise GlassError(f"{type(module).__name__} has no tensor for glassgpt's {name} {list(p.shape)}: "
                             f"it looks for {LOOKED_FOR}")
        like = glass.tok_emb.weight
        owner, _, leaf = name.rpartition(".")
        zeros = nn.Parameter(torch.zeros(p.shape, device=like.device, dtype=like.dtype), requires_grad=False)
        zeros.added_by_glassgpt = True  # not the reader's: parameter counts leave it out (own_parameters)
        setattr(glass.get_submodule(owner), leaf, zeros)
        note = f"{layout.kind} has no {leaf} on some layers (e.g. {name}): glassgpt adds zeros, the same computation"
        if not any(n.startswith(f"{layout.kind} has no {leaf}") for n in layout.notes):
            layout.notes.append(note)


def _config_line(cfg: GPTConfig) -> str:
    head = "tied head" if cfg.tie_embeddings else ("own head" if cfg.num_classes is None
                                                   else f"{cfg.num_classes}-class head")
    return (f"vocab_size {cfg.vocab_size}, context_length {cfg.context_length}, emb_dim {cfg.emb_dim}, "
            f"n_heads {cfg.n_heads}, n_layers {cfg.n_layers}, qkv_bias {cfg.qkv_bias}, {head}")


# --- the logits check ------------------------------------------------------------------

def module_logits(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What `module(ids)` returns, as logits `[b, t', V]` (nanoGPT returns the last position's only)."""
    out = module(ids)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return getattr(out, "logits", out)


class evaluating_all:
    """Every submodule of `module` in eval mode inside the block, each in its own mode again after."""

    def __init__(self, module: nn.Module):
        self.module, self.modes = module, []

    def __enter__(self) -> nn.Module:
        self.modes = [(m, m.training) for m in self.module.modules()]
        self.module.eval()
        return self.module

    def __exit__(self, *exc) -> None:
        for m, mode in self.modes:
            m.training = mode


def _check_logits(module: nn.Module, adoption: _Adoption, ids) -> str:
    glass = adoption.model
    device = glass.tok_emb.weight.device
    batch = torch.as_tensor(ids, dtype=torch.long, device=device)
    batch = (batch.unsqueeze(0) if batch.dim() == 1 else batch)[:, -glass.cfg.context_length:]
    with torch.inference_mode(), evaluating_all(module):
        theirs = module_logits(module, batch)
        ours = glass(batch)[:, -theirs.shape[1]:]
    if ours.shape != theirs.shape:
        return (f"{adoption.layout.kind} returned logits of shape {list(theirs.shape)} where glassgpt's forward "
                f"gives {list(ours.shape)}: run glassgpt.check(model) to see where they part")
    diff = float((ours.double() - theirs.double()).abs().max())
    tol = TOLERANCE.get(theirs.dtype, 1e-4) * max(1.0, float(theirs.double().abs().max()))
    if not diff <= tol:  # nan too
        return (f"glassgpt's forward on {adoption.layout.kind}'s weights does not give its logits (largest "
                f"difference {diff:.3g}, tolerance {tol:.3g}), so glassgpt would show numbers that are not your "
                "model's: run glassgpt.check(model) to find the first stage that differs")
    return ""


