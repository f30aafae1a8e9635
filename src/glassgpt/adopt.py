"""Any model module glassgpt reads, taken as it is: its glass model over the module's own tensors.

    adopt(module, ids) -> GPTModel (or, for a Qwen3 or Llama 3 module, the glass model of its family)

The seam every function that takes a model goes through (explain, why, generate, eval, diff):
the book's GPTModel (with or without its `mask` buffers) or a reader's copy with the book's
names, nanoGPT's GPT, transformers' GPT2LMHeadModel (its Conv1D matrices are read transposed),
or glassgpt's own; and the book's next models, Qwen3 and Llama 3, and the bonus Gemma 3 (the book's
and the notebooks' classes, their KV-cache variants, transformers' Qwen3ForCausalLM, LlamaForCausalLM
and Gemma3ForCausalLM). A module of no kind read is one UnreadableModelError line naming what was
looked for and every kind read. Nothing is copied: every parameter of the returned model is a view of the
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
from typing import Any, Sequence

import torch
from torch import nn

from .config import FamilyConfig, GPTConfig, RopeFreq, moe_from_hf
from .errors import ConfigError, GlassError, NonFiniteError, PromptError, UnreadableModelError
from .anatomy import own_description
from .families import build_model
from .families.bonus_hf import bonus_glass
from .families.gemma3 import Gemma3Config
from .model import GPTModel
from .tokenizer import Tokenizer, check_fits
from .variants import variant_of

# The logits check: max |ours - theirs| <= TOLERANCE[dtype] * max(1, max |theirs|). float32 leaves
# room for F.layer_norm and fused attention, which differ from the book's formulas in the last bits;
# float64 for the book's GELU, whose sqrt(2/pi) is a float32 number (1e-8 from transformers' in float64).
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 5e-2, torch.float16: 1e-2}

KINDS_READ = ("glassgpt's GPTModel, Qwen3Model, Llama3Model, Gemma3Model, Qwen3_5Model, Olmo3Model, TinyAyaModel and "
              "Gemma4DenseModel "
              "(and chapter 4's variants.gqa/mla/swa/moe GPTModel); the book's GPTModel, Qwen3Model and Llama3Model "
              "(and their kv_cache variants) or a copy with the book's names; nanoGPT's GPT; transformers' "
              "GPT2LMHeadModel, Qwen3ForCausalLM, Qwen3MoeForCausalLM (its fused experts read as views), "
              "LlamaForCausalLM, Gemma3ForCausalLM, Olmo3ForCausalLM, Cohere2ForCausalLM and Gemma4ForCausalLM")
LOOKED_FOR = ("the book's children (tok_emb, pos_emb or none, trf_blocks or the Gemma 3 notebook's blocks, final_norm, "
              "out_head), nanoGPT's and GPT-2's (transformer.wte, transformer.wpe, transformer.h, transformer.ln_f, "
              "lm_head) or Qwen3's, Llama's and Gemma 3's (model.embed_tokens, model.layers, model.norm, lm_head)")


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
    One of glassgpt's glass modules (one its own glass file describes: anatomy.own_description), or an engine
    over one, is returned as it is, checked the same way.
    described: the caller reads the model through its description only (the trace), so chapter 4's
    variants (variants/), which every other caller refuses in one line, are returned as they are too."""
    # one of glassgpt's glass modules (its own file describes it), or an engine over one: taken as it is; chapter 4's
    # variants only by a caller that reads the description (layout_of's line refuses them to the others)
    glass = module if own_description(module) is not None else getattr(module, "model", None)
    if (glass is module or own_description(glass) is not None) and (described or not variant_of(glass)):
        if ids is not None:  # about to compute on it
            check_computable(glass)
            check_prompt_ids(ids, glass.cfg.vocab_size)
        return glass
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


def _check_bonus_logits(module: nn.Module, glass: nn.Module, ids) -> None:
    """The module's own logits against the glass model's over its tensors, once per glass model."""
    if getattr(glass, "logits_checked", False):
        return
    verdict = _logits_verdict(module, glass, ids, f"transformers' {type(module).__name__}")
    if verdict:
        raise GlassError(verdict)
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
    """The kind of `module` and its tensors in glassgpt's names; a one-line UnreadableModelError naming
    what was looked for and every kind read if none fits."""
    if variant_of(module):  # GPT-2's names, another computation: never read as GPT-2 (docs/variants.md)
        raise GlassError(f"{type(module).__module__}.GPTModel is one of chapter 4's variants: GPT-2's tensor names, "
                         "another computation, so only what reads a model through its description reads it: trace, why, "
                         "check, generate, compare, diff, a passage, eval and the page (glassgpt explain, generate, diff, "
                         "eval and serve)")
    family = family_layout(module)
    if family is not None:
        kind, cfg, tensors, stages = family
        return Layout(kind, tensors, cfg.n_heads, stages, cfg.norm_eps, family=cfg)
    children = dict(module.named_children())
    if {"tok_emb", "pos_emb", "trf_blocks", "final_norm", "out_head"} <= set(children):
        return _book_layout(module)
    transformer = children.get("transformer")
    if transformer is not None and {"wte", "wpe", "h", "ln_f"} <= set(dict(transformer.named_children())):
        return _gpt2_layout(module, transformer)
    names = ", ".join(children) or "none"
    raise UnreadableModelError(f"{type(module).__name__} is not a model glassgpt can read: it looks for "
                               f"{LOOKED_FOR}; this module's top-level children are: {names}; glassgpt reads "
                               f"{KINDS_READ}")


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


def _book_eps(book: dict, family: str) -> float:
    """The norms' eps as the config says it (the book's classes write it in: Qwen3 1e-6, Llama 3 1e-5), not as a
    norm module holds it: check (explain/verify.py) compares the module's against it."""
    eps = book.get("norm_eps", book.get("rms_norm_eps"))
    return float(eps) if isinstance(eps, (int, float)) else (1e-6 if family == "qwen3" else 1e-5)


def _eps(norm: nn.Module, default: float = 1e-5) -> float:
    eps = getattr(norm, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else default


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
    """Tied is told by storage, never by equal values (a copied embedding is not a tie)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _build(module: nn.Module, layout: Layout) -> GPTModel:
    cfg = config_of(module, layout)
    with torch.device("meta"):
        glass = GPTModel(cfg)
    assigned = set()
    for name, tensor in layout.tensors.items():
        if name == "out_head.weight" and cfg.tie_embeddings:
            continue
        _assign_view(glass, module, name, tensor, "GPT-2", f" ({_config_line(cfg)})")
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


def _assign_view(glass: nn.Module, module: nn.Module, name: str, tensor: torch.Tensor, model: str,
                 config: str = "") -> None:
    """glass's parameter `name` made a view of the module's `tensor` (nothing copied), or one line: a tensor the
    glass `model` has no place for, or one of another shape than its config (`config`: that config, said)."""
    owner, _, leaf = name.rpartition(".")
    target = glass.get_submodule(owner) if _has_submodule(glass, owner) else None
    expected = getattr(target, leaf, None)
    if not isinstance(expected, torch.Tensor):
        raise GlassError(f"{type(module).__name__} has a tensor glassgpt's {model} does not: {name} "
                         f"{list(tensor.shape)}")
    if expected.shape != tensor.shape:
        raise GlassError(f"{type(module).__name__}: {name} is {list(tensor.shape)} but its config{config} wants "
                         f"{list(expected.shape)}")
    setattr(target, leaf, nn.Parameter(tensor.detach(), requires_grad=False))  # a view: nothing copied


def _has_submodule(glass: nn.Module, path: str) -> bool:
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


# --- the book's next models: Qwen3 (and its MoE), Llama 3, Gemma 3 -------------------------------
# The book's Qwen3Model / Llama3Model (llms_from_scratch.qwen3 / llama3) and their KV-cache variants
# (kv_cache.qwen3 / llama3, kv_cache_batched.qwen3), or a reader's copy with the book's names; the bonus
# notebooks' Qwen3Model with MoEFeedForward and Gemma3Model (its cfg dict read as a Gemma3Config);
# transformers' Qwen3ForCausalLM / LlamaForCausalLM / Gemma3ForCausalLM (their names mapped to the
# glass files', no transposes: all store nn.Linear's [out, in]). The config is read from the tensors'
# shapes and the module's attributes: heads from the attention's num_heads / num_kv_groups / head_dim
# (the book's) or the module's transformers config; RoPE's base and Llama 3's scaling from the book's
# `cfg` dict or that config. build_family_glass makes the glass model with every parameter a view of
# the module's storage.

# transformers' names inside one decoder layer -> the book's (families/layers.py), the same [out, in] matrices
HF_LAYER_NAMES = {"self_attn.q_proj.weight": "att.W_query.weight", "self_attn.k_proj.weight": "att.W_key.weight",
                  "self_attn.v_proj.weight": "att.W_value.weight", "self_attn.o_proj.weight": "att.out_proj.weight",
                  "mlp.gate_proj.weight": "ff.fc1.weight", "mlp.up_proj.weight": "ff.fc2.weight",
                  "mlp.down_proj.weight": "ff.fc3.weight"}
HF_NORMS = {"self_attn.q_norm": "att.q_norm", "self_attn.k_norm": "att.k_norm", "input_layernorm": "norm1",
            "post_attention_layernorm": "norm2"}
HF_FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "llama": "llama3"}


def family_layout(module: nn.Module) -> tuple[str, FamilyConfig, dict[str, torch.Tensor], dict[str, str]] | None:
    """What a Qwen3 or Llama 3 module holds, in the book's names; None if `module` is neither kind."""
    children = dict(module.named_children())
    if {"tok_emb", "trf_blocks", "final_norm", "out_head"} <= set(children) and "pos_emb" not in children \
            and hasattr(module.trf_blocks[0].att, "num_kv_groups"):
        return _book_family(module)
    if {"tok_emb", "blocks", "final_norm", "out_head"} <= set(children) and "layer_types" in (
            getattr(module, "cfg", None) or {}):
        return _notebook_gemma3(module)
    inner = children.get("model")
    if inner is not None and "lm_head" in children and {"embed_tokens", "layers", "norm"} <= set(
            dict(inner.named_children())) and getattr(getattr(module, "config", None), "model_type", None):
        return _hf_family(module)
    return None


def _book_family(module: nn.Module):
    att, ff, norm = module.trf_blocks[0].att, module.trf_blocks[0].ff, module.final_norm
    family = "qwen3" if hasattr(norm, "scale") else "llama3"  # the book's RMSNorm (`scale`) or torch.nn.RMSNorm
    book = getattr(module, "cfg", None)
    book = book if isinstance(book, dict) else {}
    vocab, d = module.tok_emb.weight.shape
    cos = getattr(module, "cos", None)
    context = book.get("context_length") or (cos.shape[0] if isinstance(cos, torch.Tensor) else None)
    if "rope_base" not in book or context is None:
        raise GlassError(f"{type(module).__name__} keeps no `cfg` dict with rope_base and context_length (the book's "
                         "classes do): glassgpt cannot tell its RoPE; build it as the book's Qwen3Model(cfg) does")
    rope_freq = book.get("rope_freq")
    hd = att.head_dim
    moe = {}
    if isinstance(ff.fc1, nn.ModuleList):  # the MoE notebook's MoEFeedForward: one fc1, fc2, fc3 per expert
        moe = {"num_experts": len(ff.fc1), "num_experts_per_tok": ff.num_experts_per_tok,
               "moe_hidden_dim": ff.fc1[0].weight.shape[0]}
    cfg = _family_config(module, family=family, vocab_size=vocab, context_length=int(context), emb_dim=d, **moe,
                  n_heads=att.num_heads, n_layers=len(module.trf_blocks),
                  hidden_dim=moe["moe_hidden_dim"] if moe else ff.fc1.weight.shape[0],
                  n_kv_groups=att.num_kv_groups, rope_base=float(book["rope_base"]),
                  head_dim=None if family == "llama3" and hd == d // att.num_heads else hd,
                  qk_norm=getattr(att, "q_norm", None) is not None,
                  rope_freq=RopeFreq(**rope_freq) if rope_freq else None,
                  tie_embeddings=_same_view(module.out_head.weight, module.tok_emb.weight),
                  norm_eps=_book_eps(book, family))
    tensors = dict(module.named_parameters(remove_duplicate=False))
    stages = {s: s for s in ("tok_emb", "final_norm", "out_head")}
    for i in range(cfg.n_layers):
        stages.update({f"trf_blocks.{i}{s}": f"trf_blocks.{i}{s}" for s in ("", ".norm1", ".att", ".norm2", ".ff")})
    source = type(module).__module__
    kind = (f"the book's {type(module).__name__}" + (f" ({source.removeprefix('llms_from_scratch.')})"
                                                     if "kv_cache" in source else "")
            if source.startswith("llms_from_scratch") else f"{type(module).__name__} with the book's names (a reader's copy)")
    return kind, cfg, tensors, stages


def _notebook_gemma3(module: nn.Module):
    """The Gemma 3 notebook's Gemma3Model (or the KV-cache notebook's): its cfg dict is the config, its names are
    glassgpt's."""
    fields = {f.name for f in Gemma3Config.__dataclass_fields__.values()}
    try:
        cfg = Gemma3Config(**{k: v for k, v in module.cfg.items() if k in fields},
                           tie_embeddings=_same_view(module.out_head.weight, module.tok_emb.weight),
                           norm_eps=_eps(module.final_norm, 1e-6))
    except TypeError as err:  # a key the notebook's dict always has is missing
        raise GlassError(f"{type(module).__name__}'s cfg is not the Gemma 3 notebook's config dict: {err}") from None
    except GlassError as err:
        raise GlassError(f"{type(module).__name__}: {err}") from None
    stages = {s: s for s in ("tok_emb", "final_norm", "out_head")}
    stages.update({f"trf_blocks.{i}": f"blocks.{i}" for i in range(cfg.n_layers)})
    kind = ("the Gemma 3 notebook's Gemma3Model" if type(module).__name__ == "Gemma3Model"
            else f"{type(module).__name__} with the Gemma 3 notebook's names (a reader's copy)")
    return kind, cfg, dict(module.named_parameters(remove_duplicate=False)), stages


def _hf_family(module: nn.Module):
    hf = module.config
    model_type = hf.model_type
    if model_type == "gemma3_text":
        return _hf_gemma3(module)
    if model_type not in HF_FAMILIES:
        raise GlassError(f"{type(module).__name__} is a {model_type} model: glassgpt adopts transformers' "
                         "Qwen3ForCausalLM (qwen3), Qwen3MoeForCausalLM (qwen3_moe), LlamaForCausalLM (llama) and "
                         "GPT2LMHeadModel (gpt2)")
    family = HF_FAMILIES[model_type]
    rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    rope_base = rope.get("rope_theta", getattr(hf, "rope_theta", None) or 10_000.0)
    rope_freq = None
    if rope.get("rope_type", rope.get("type", "default")) == "llama3":
        rope_freq = RopeFreq(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                             high_freq_factor=float(rope["high_freq_factor"]),
                             original_context_length=int(rope["original_max_position_embeddings"]))
    elif rope.get("rope_type", rope.get("type", "default")) != "default":
        raise GlassError(f"{type(module).__name__}'s RoPE scaling {rope.get('rope_type')!r} is not Llama 3's: "
                         "glassgpt has only that one")
    inner, first = module.model, module.model.layers[0]
    vocab, d = inner.embed_tokens.weight.shape
    hd = getattr(hf, "head_dim", None) or d // hf.num_attention_heads
    moe = _hf_moe(module) if model_type == "qwen3_moe" else {}
    cfg = _family_config(module, family=family, vocab_size=vocab, context_length=hf.max_position_embeddings, emb_dim=d,
                  n_heads=hf.num_attention_heads, n_layers=len(inner.layers), **moe,
                  hidden_dim=moe["moe_hidden_dim"] if moe else first.mlp.gate_proj.weight.shape[0],
                  n_kv_groups=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
                  rope_base=float(rope_base), head_dim=None if family == "llama3" and hd == d // hf.num_attention_heads
                  else hd, qk_norm=hasattr(first.self_attn, "q_norm"), rope_freq=rope_freq,
                  tie_embeddings=_same_view(module.lm_head.weight, inner.embed_tokens.weight),
                  norm_eps=float(hf.rms_norm_eps))
    norm = "scale" if family == "qwen3" else "weight"  # the glass RMSNorm's name in each family
    tensors = {"tok_emb.weight": inner.embed_tokens.weight, f"final_norm.{norm}": inner.norm.weight,
               "out_head.weight": module.lm_head.weight}
    stages = {"tok_emb": "model.embed_tokens", "final_norm": "model.norm", "out_head": "lm_head"}
    for i, layer in enumerate(inner.layers):
        for name, p in layer.named_parameters():
            owner = name.rpartition(".")[0]
            if name in HF_LAYER_NAMES:
                tensors[f"trf_blocks.{i}.{HF_LAYER_NAMES[name]}"] = p
            elif moe and name in HF_EXPERTS:
                tensors.update(_expert_views(f"trf_blocks.{i}.ff", name, p, moe["moe_hidden_dim"]))
            elif owner in HF_NORMS:
                tensors[f"trf_blocks.{i}.{HF_NORMS[owner]}.{norm}"] = p
            else:
                raise GlassError(f"{type(module).__name__} has a tensor glassgpt's {family} does not: "
                                 f"model.layers.{i}.{name} {list(p.shape)}")
        stages.update({f"trf_blocks.{i}": f"model.layers.{i}", f"trf_blocks.{i}.norm1": f"model.layers.{i}.input_layernorm",
                       f"trf_blocks.{i}.att": f"model.layers.{i}.self_attn", f"trf_blocks.{i}.ff": f"model.layers.{i}.mlp",
                       f"trf_blocks.{i}.norm2": f"model.layers.{i}.post_attention_layernorm"})
    return f"transformers' {type(module).__name__}", cfg, tensors, stages


# transformers' Qwen3MoeSparseMoeBlock: the router, and every expert's matrices fused into one 3-D tensor each
HF_EXPERTS = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _hf_moe(module: nn.Module) -> dict[str, int]:
    """transformers' Qwen3MoeForCausalLM's experts as the MoE notebook's config keys (config.moe_from_hf: what the
    notebook's MoEFeedForward does not do is refused by its field)."""
    name = type(module).__name__
    try:
        return moe_from_hf(module.config.to_dict(), name, name)
    except ConfigError as err:
        raise GlassError(str(err)) from None


def _expert_views(ff: str, name: str, p: torch.Tensor, m: int) -> dict[str, torch.Tensor]:
    """One fused tensor of transformers' experts as the notebook's per-expert matrices, each a view of it (nothing
    copied): gate_up_proj [E, 2m, d] holds expert e's gate rows (fc1) then its up rows (fc2); down_proj [E, d, m]
    its down matrix (fc3); the router's weight is the notebook's `gate`."""
    if name == "mlp.gate.weight":
        return {f"{ff}.gate.weight": p}
    if name == "mlp.experts.gate_up_proj":
        return {f"{ff}.{fc}.{e}.weight": p[e, rows] for e in range(p.shape[0])
                for fc, rows in (("fc1", slice(0, m)), ("fc2", slice(m, 2 * m)))}
    return {f"{ff}.fc3.{e}.weight": p[e] for e in range(p.shape[0])}


GEMMA3_HF_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def _hf_gemma3(module: nn.Module):
    """transformers' Gemma3ForCausalLM: its config's fields as the notebook's keys, its tensors by gemma3.py's names
    (its Gemma3RMSNorm is (1 + weight) too)."""
    hf, inner = module.config, module.model
    for setting in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if getattr(hf, setting, None):
            raise GlassError(f"{type(module).__name__} sets {setting} ({getattr(hf, setting)!r}): the notebook's "
                             "Gemma3Model has none")
    rope = getattr(hf, "rope_parameters", None) or {}
    for kind in ("full_attention", "sliding_attention"):
        if rope.get(kind, {}).get("rope_type", "default") != "default":
            raise GlassError(f"{type(module).__name__}'s {kind} layers scale RoPE ({rope[kind]['rope_type']!r}): the "
                             "notebook's Gemma3Model turns them by plain RoPE")
    vocab, d = inner.embed_tokens.weight.shape
    try:
        cfg = Gemma3Config(vocab_size=vocab, context_length=hf.max_position_embeddings, emb_dim=d,
                           n_heads=hf.num_attention_heads, n_layers=len(inner.layers), hidden_dim=hf.intermediate_size,
                           head_dim=hf.head_dim, n_kv_groups=hf.num_key_value_heads,
                           rope_local_base=float(rope.get("sliding_attention", {}).get("rope_theta", 10_000.0)),
                           rope_base=float(rope.get("full_attention", {}).get("rope_theta", 1_000_000.0)),
                           sliding_window=hf.sliding_window, layer_types=list(hf.layer_types),
                           query_pre_attn_scalar=hf.query_pre_attn_scalar,
                           tie_embeddings=_same_view(module.lm_head.weight, inner.embed_tokens.weight),
                           norm_eps=float(hf.rms_norm_eps))
    except GlassError as err:
        raise GlassError(f"{type(module).__name__}: {err}") from None
    tensors = {"tok_emb.weight": inner.embed_tokens.weight, "final_norm.scale": inner.norm.weight,
               "out_head.weight": module.lm_head.weight}
    stages = {"tok_emb": "model.embed_tokens", "final_norm": "model.norm", "out_head": "lm_head"}
    # Qwen3's and Llama's names for the matrices and QK-norms; Gemma 3's four block norms keep their own
    ours = {theirs.removesuffix(".weight"): mine.removesuffix(".weight") for theirs, mine in HF_LAYER_NAMES.items()}
    ours |= {theirs: mine for theirs, mine in HF_NORMS.items() if theirs.startswith("self_attn.")}
    for i, layer in enumerate(inner.layers):
        for name, p in layer.named_parameters():
            owner = name.rpartition(".")[0]
            if owner not in ours and owner not in GEMMA3_HF_NORMS:
                raise GlassError(f"{type(module).__name__} has a tensor glassgpt's gemma3 does not: "
                                 f"model.layers.{i}.{name} {list(p.shape)}")
            leaf = "scale" if owner in GEMMA3_HF_NORMS else "weight"
            tensors[f"blocks.{i}.{ours.get(owner, owner)}.{leaf}"] = p
        stages[f"trf_blocks.{i}"] = f"model.layers.{i}"
    return f"transformers' {type(module).__name__}", cfg, tensors, stages


def _family_config(module: nn.Module, **fields: Any) -> FamilyConfig:
    try:
        return FamilyConfig(**fields)
    except GlassError as err:
        raise GlassError(f"{type(module).__name__}: {err}") from None


def build_family_glass(module: nn.Module, cfg: FamilyConfig, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """The glass model of `cfg` whose every parameter is a view of `tensors` (the module's storage)."""
    with torch.device("meta"):
        glass = build_model(cfg)
    for name, tensor in tensors.items():
        if name == "out_head.weight" and cfg.tie_embeddings:
            continue
        _assign_view(glass, module, name, tensor, cfg.family)
    glass.tie_weights()
    missing = [n for n, p in glass.named_parameters() if p.is_meta]
    if missing:
        raise GlassError(f"{type(module).__name__} has no tensor for glassgpt's {missing[0]}: it looks for the "
                         "book's names (tok_emb, trf_blocks, final_norm, out_head) or transformers' (model.layers, lm_head)")
    return glass.eval()


def family_line(cfg: FamilyConfig) -> str:
    """The config in one line, for `adopted_from`."""
    return (f"vocab_size {cfg.vocab_size}, emb_dim {cfg.emb_dim}, {cfg.n_layers} layers, {cfg.n_heads} query heads "
            f"sharing {cfg.n_kv_groups} key/value groups of {cfg.head_dim_value}, "
            f"{'tied head' if cfg.tie_embeddings else 'own head'}")


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
    return _logits_verdict(module, adoption.model, ids, adoption.layout.kind)


def _logits_verdict(module: nn.Module, glass: nn.Module, ids, kind: str) -> str:
    """"" where glassgpt's forward over the module's tensors gives the module's own logits on `ids` (within
    TOLERANCE of their dtype); else the one line that says they part."""
    device = glass.tok_emb.weight.device
    batch = torch.as_tensor(ids, dtype=torch.long, device=device)
    batch = (batch.unsqueeze(0) if batch.dim() == 1 else batch)[:, -glass.cfg.context_length:]
    with torch.inference_mode(), evaluating_all(module):
        theirs = module_logits(module, batch)
        ours = glass(batch)[:, -theirs.shape[1]:]
    if ours.shape != theirs.shape:
        return (f"{kind} returned logits of shape {list(theirs.shape)} where glassgpt's forward "
                f"gives {list(ours.shape)}: run glassgpt.check(model) to see where they part")
    diff = float((ours.double() - theirs.double()).abs().max())
    tol = TOLERANCE.get(theirs.dtype, 1e-4) * max(1.0, float(theirs.double().abs().max()))
    if not diff <= tol:  # nan too
        return (f"glassgpt's forward on {kind}'s weights does not give its logits (largest "
                f"difference {diff:.3g}, tolerance {tol:.3g}), so glassgpt would show numbers that are not your "
                "model's: run glassgpt.check(model) to find the first stage that differs")
    return ""


