"""glassgpt.check(model): a reader's own GPT module against the book's formulas, stage by stage.

The reader's module runs once on a prompt (in eval mode, left in its own mode after) with
forward hooks on its submodules: `tok_emb`, `pos_emb`, and in each block `norm1`, `att`, the
first shortcut, `norm2`, `ff`, the second shortcut; then `final_norm` and `out_head`. Each stage
is computed again by model.py on the same weights in float64, from the reader's own input to
that stage, so a mistake shows at the stage that makes it and not at every stage after it.
The first stage that differs beyond the tolerance is reported with its largest difference and
where it sits (block, position, feature); then the likely mistake, found by computing that stage
with each known mistake (MISTAKES) and taking the one that reproduces the reader's numbers.
A second run of the same prompt tells dropout left active in eval mode (the numbers change; a NaN
equals a NaN here, so NaNs alone never read as dropout). A NaN or inf is never a correct output: the
first stage that gives one is named with the position where it first appears and what makes it (a
row of attention scores masked everywhere, the diagonal included). Weights that hold a NaN or inf
are refused before anything runs (adopt.check_computable names the tensor).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .. import anatomy as an
from ..adopt import Layout, check_computable, evaluating_all, module_logits, read_in_place
from ..errors import GlassError
from ..kinds import describe
from ..tokenizer import get_tokenizer
from .formulas import attention_weights, rope_interleaved as _rope_interleaved, rope_tables as _rope_tables, \
    rotate as _rotate  # (causes.py reads them here)
from .result import Result

if TYPE_CHECKING:
    from ..model import GPTModel

DEFAULT_TEXT = "Every effort moves you"

# A stage matches when max |reader - book| <= TOLERANCE[dtype] * max |book| (the stage's own scale,
# so a stage of small numbers is held as tightly): float32's rounding in a d-wide dot product
# stays some 10x below it; the known mistakes are far above it.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 2e-3}

# Each known mistake: the stage kind it belongs to, and the sentence a reader can act on.
MISTAKES = {
    "pos_from_1": ("pos_emb", "the positions count from 1, not 0: use torch.arange(seq_len) for pos_emb"),
    "no_mask": ("att", "the attention has no causal mask, so each token also reads the tokens after it: fill the "
                       "scores above the diagonal (torch.triu(..., diagonal=1)) with -inf before the softmax"),
    "mask_wrong_side": ("att", "the causal mask hides the earlier tokens instead of the later ones: mask above the "
                               "diagonal, torch.triu(..., diagonal=1), not below it"),
    "softmax_dim": ("att", "the softmax runs over the queries (dim=-2): take it over the keys, dim=-1, so each "
                           "token's attention weights sum to 1"),
    "no_scale": ("att", "the attention scores are not divided by sqrt(head_dim): use "
                        "softmax(scores / keys.shape[-1]**0.5, dim=-1)"),
    "scale_emb_dim": ("att", "the attention scores are divided by sqrt(emb_dim), not by sqrt(head_dim): use "
                             "keys.shape[-1]**0.5 after the split into heads"),
    "mask_diagonal": ("att", "every position of row 0 of the attention weights is masked, the diagonal too, so "
                             "its softmax is NaN (0 / 0): mask only the future, torch.triu(..., diagonal=1), "
                             "so each token still sees itself"),
    "view_no_transpose": ("att", "the heads are split with .view(b, num_heads, num_tokens, head_dim) and no "
                                 "transpose, which mixes tokens into heads: view(b, num_tokens, num_heads, "
                                 "head_dim).transpose(1, 2)"),
    "no_shortcut": ("shortcut", "the shortcut is missing: add the block's input back, x = x + shortcut"),
    "unbiased_var": ("norm", "the LayerNorm divides by n - 1 (unbiased variance): use x.var(dim=-1, "
                             "keepdim=True, unbiased=False), as GPT-2 does"),
    "no_eps": ("norm", "the LayerNorm leaves out eps: divide by torch.sqrt(var + self.eps) with eps = 1e-5"),
    "exact_gelu": ("ff", "the feed forward uses the exact GELU (erf), where the book and GPT-2 use the tanh "
                         "approximation: 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))"),
    "relu": ("ff", "the feed forward uses ReLU where GPT-2 uses GELU"),
}
NON_FINITE = ("a NaN or inf comes from 0 / 0, inf - inf or a softmax over a row that is all -inf: print the "
              "stage's input and its intermediate values (the scores, the mask) at that position")
DROPOUT = ("dropout is active in eval mode (two runs of the same prompt give different numbers): use "
           "nn.Dropout modules, or F.dropout(x, p, training=self.training)")


@dataclass
class StageCheck:
    name: str
    max_diff: float
    tolerance: float
    where: dict[str, int] = field(default_factory=dict)  # block, position, feature of the largest difference
    non_finite: str | None = None  # "NaN" or "inf" when the reader's output holds one (where: the first)

    @property
    def ok(self) -> bool:
        return self.non_finite is None and self.max_diff <= self.tolerance

    @property
    def diff_text(self) -> str:
        return f"{self.non_finite} from" if self.non_finite else f"max |diff| {self.max_diff:.3g}"


@dataclass
class CheckResult(Result):
    """What `check` found: every stage, the first that differs (or None), and one sentence."""

    kind: str
    prompt: str
    stages: list[StageCheck]
    first: StageCheck | None
    mistake: str | None
    finding: str
    notes: list[str] = field(default_factory=list)
    against: str = "model.py in float64"  # what each stage was computed again by
    prop: str | None = None  # the property of the formula the first differing stage breaks (pieces/stages.py)
    prop_where: str | None = None  # where that property first breaks: "position 3", "row 2 of head 0"

    @property
    def ok(self) -> bool:
        return self.first is None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "prompt": self.prompt, "ok": self.ok, "mistake": self.mistake,
                "property": self.prop, "property_where": self.prop_where, "finding": self.finding, "notes": self.notes,
                "stages": [{"name": s.name, "max_diff": s.max_diff, "tolerance": s.tolerance, "ok": s.ok,
                            "where": s.where, "non_finite": s.non_finite} for s in self.stages]}

    def to_text(self) -> str:
        lines = [f"glassgpt check: {self.kind}", f"  on {self.prompt!r}, each stage against {self.against}"]
        for s in self.stages:
            mark = "ok" if s.ok else "DIFFERS"
            where = f"  at {_where_text(s.where)}" if not s.ok else ""
            lines.append(f"  {s.name:<26} {mark:<8} {s.diff_text}{where}")
        return "\n".join(lines + [""] + [self.finding] + [f"note: {n}" for n in self.notes])


def check(model: nn.Module, text: str = DEFAULT_TEXT, ids: list[int] | None = None) -> CheckResult:
    """Check `model` against its formulas on `text` (or token `ids`), stage by stage: GPT-2 (the book's
    GPTModel, a reader's copy, nanoGPT's or transformers' GPT) against model.py's, every other described
    model against its description's (check_described). See the module's docstring."""
    anatomy = _described(model)
    if anatomy is not None and anatomy.name != "GPT-2":
        return check_described(model, anatomy, ids, text)
    return check_gpt2(model, text, ids)


def _described(model: nn.Module) -> an.Anatomy | None:
    """The model's description, or None where kinds.py reads none (check_gpt2 then says what it found)."""
    try:
        return describe(model)
    except Exception:  # noqa: BLE001 - any module kinds.py cannot read: check_gpt2 names what it looked for
        return None


def check_gpt2(model: nn.Module, text: str = DEFAULT_TEXT, ids: list[int] | None = None) -> CheckResult:
    """A GPT-2 against model.py's formulas, stage by stage (the module's docstring)."""
    check_computable(model)  # weights that cannot compute are named before any stage is compared
    glass, layout = read_in_place(model)
    cfg = glass.cfg
    shown = text if ids is None else _decode(ids)
    if ids is None:  # a vocabulary smaller than GPT-2's (a toy model) reads the ids modulo its size
        ids = [i % cfg.vocab_size for i in get_tokenizer("gpt2").encode(text)]
    batch = torch.tensor([ids[-cfg.context_length:]], device=glass.tok_emb.weight.device)
    with torch.random.fork_rng(devices=[batch.device] if batch.device.type == "cuda" else []):
        runs = [_record(model, layout, batch) for _ in range(2)]  # two draws: dropout left on shows
    ref = copy.deepcopy(glass).double()
    for blk in ref.trf_blocks:  # the book's tanh GELU, where adopt keeps a module's exact one
        blk.ff.layers[1] = TanhGELU()
    stages, first, mistake, broken, first_kind = [], None, None, None, ""
    for name, (key, io), book_fn, kind in _stages(ref, runs[0], batch):
        got = runs[0][key][io]
        stage = _compare(name, got, book_fn(None), got.dtype)
        stages.append(stage)
        if first is None and not stage.ok:
            first, first_kind = stage, kind
            if not same_numbers(got, runs[1][key][io]):  # eval mode must give the same numbers twice
                mistake = "dropout"
            else:
                mistake = _likely_mistake(kind, got, book_fn, stage.tolerance)
                if mistake is None and not stage.non_finite:
                    broken = _gpt2_property(kind, name, got, book_fn, runs[0], key, ref, model, layout, batch)
    return CheckResult(layout.kind, shown, stages, first, mistake, _finding(stages, first, mistake, broken, first_kind),
                       _tie_note(glass), prop=broken.prop if broken else None,
                       prop_where=broken.where if broken else None)


SQRT_2_OVER_PI = torch.sqrt(torch.tensor(2.0 / torch.pi, dtype=torch.float32))  # model.py's constant, as it rounds it


class TanhGELU(nn.Module):
    """The book's GELU (its tanh approximation), the formula model.py's GELU computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3))))


def same_numbers(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same numbers, a NaN matching a NaN (torch.equal says NaN != NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def nan_aware_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| where both are numbers; 0 where both are NaN (or the same inf); inf where only one is."""
    got, want = got.double().reshape(want.shape), want.to(got.device).double()
    same = (got == want) | (got.isnan() & want.isnan())
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs())
    return float(torch.nan_to_num(diff, nan=math.inf).max()) if diff.numel() else 0.0


def _decode(ids: list[int]) -> str:
    try:
        return get_tokenizer("gpt2").decode(ids)
    except Exception:  # ids of another vocabulary: show them as numbers
        return " ".join(map(str, ids))


# --- recording the reader's module ---------------------------------------------------------

def _record(module: nn.Module, layout: Layout, batch: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{stage: (input, output)} of one forward pass of the reader's own module, through forward hooks."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def tap(name: str):
        def hook(_mod, args, kwargs, out):
            x = args[0] if args else next((v for v in kwargs.values() if torch.is_tensor(v)), None)
            y = out[0] if isinstance(out, (tuple, list)) else out
            seen[name] = (x.detach().clone() if x is not None else None, y.detach().clone())
        return hook

    handles = [module.get_submodule(path).register_forward_hook(tap(name), with_kwargs=True)
               for name, path in layout.stages.items()]
    try:
        with torch.inference_mode(), evaluating_all(module):
            seen["logits"] = (batch, module_logits(module, batch).detach().clone())
    except GlassError:
        raise
    except Exception as err:  # the reader's own forward failed: say where, in one line
        raise GlassError(f"{type(module).__name__}.forward failed on a {list(batch.shape)} prompt: "
                         f"{type(err).__name__}: {err}") from None
    finally:
        for h in handles:
            h.remove()
    return seen


# --- the book's formulas, stage by stage ----------------------------------------------------

def _stages(ref: GPTModel, seen: dict, batch: torch.Tensor):
    """(stage name, where the reader's output was recorded (stage, 0 input / 1 output), fn(mistake)
    -> model.py's output with that mistake (None: none), the stage's kind), in the order the data
    flows; each stage fed with the reader's own input to it."""
    t, d = batch.shape[1], ref.cfg.emb_dim
    tok, pos = seen["tok_emb"][1].double(), seen["pos_emb"][1].double().reshape(-1, t, d)[:1]
    yield "tok_emb", ("tok_emb", 1), lambda m: ref.tok_emb.weight[batch], "tok_emb"
    yield "pos_emb", ("pos_emb", 1), _positions(ref, t), "pos_emb"
    yield "embeddings", ("trf_blocks.0", 0), lambda m: tok + pos, "embeddings"
    for i, blk in enumerate(ref.trf_blocks):
        p = f"trf_blocks.{i}"
        x_in, x_mid = seen[p][0].double(), seen[f"{p}.norm2"][0].double()
        att_out, ff_out = seen[f"{p}.att"][1].double(), seen[f"{p}.ff"][1].double()
        yield f"{p}.norm1", (f"{p}.norm1", 1), _norm(blk.norm1, seen[f"{p}.norm1"][0]), "norm"
        yield f"{p}.att", (f"{p}.att", 1), _attention(blk.att, seen[f"{p}.att"][0]), "att"
        yield f"{p}.shortcut1", (f"{p}.norm2", 0), lambda m, x=x_in, a=att_out: a if m else x + a, "shortcut"
        yield f"{p}.norm2", (f"{p}.norm2", 1), _norm(blk.norm2, seen[f"{p}.norm2"][0]), "norm"
        yield f"{p}.ff", (f"{p}.ff", 1), _feed_forward(blk.ff, seen[f"{p}.ff"][0]), "ff"
        yield f"{p}.shortcut2", (p, 1), lambda m, x=x_mid, f=ff_out: f if m else x + f, "shortcut"
    yield "final_norm", ("final_norm", 1), _norm(ref.final_norm, seen["final_norm"][0]), "norm"
    yield "out_head", ("out_head", 1), lambda m, x=seen["out_head"][0]: ref.out_head(x.double()), "out_head"


def _positions(ref: GPTModel, t: int) -> Callable[[str | None], torch.Tensor | None]:
    def run(mistake: str | None) -> torch.Tensor | None:
        start = 1 if mistake == "pos_from_1" else 0
        return ref.pos_emb.weight[start:start + t][None] if start + t <= ref.cfg.context_length else None
    return run


def _norm(norm: nn.Module, x: torch.Tensor) -> Callable[[str | None], torch.Tensor]:
    def run(mistake: str | None) -> torch.Tensor:
        h = x.double()
        if mistake is None:
            return norm(h)  # model.py's LayerNorm
        mean = h.mean(dim=-1, keepdim=True)
        var = h.var(dim=-1, keepdim=True, unbiased=mistake == "unbiased_var")
        eps = 0.0 if mistake == "no_eps" else norm.eps
        return norm.scale * (h - mean) / torch.sqrt(var + eps) + norm.shift
    return run


def _feed_forward(ff: nn.Module, x: torch.Tensor) -> Callable[[str | None], torch.Tensor]:
    def run(mistake: str | None) -> torch.Tensor:
        h = x.double()
        if mistake is None:
            return ff(h)  # model.py's FeedForward
        act = F.relu if mistake == "relu" else F.gelu  # F.gelu: the exact erf form
        return ff.layers[2](act(ff.layers[0](h)))
    return run


def _attention(att: nn.Module, x: torch.Tensor) -> Callable[[str | None], torch.Tensor]:
    def run(mistake: str | None) -> torch.Tensor:
        h = x.double()
        if mistake is None:
            return att(h)  # model.py's MultiHeadAttention
        b, t, d = h.shape
        nh, hd = att.n_heads, att.head_dim
        if mistake == "view_no_transpose":
            split = lambda y: y.view(b, nh, t, hd)  # noqa: E731
        else:
            split = lambda y: y.view(b, t, nh, hd).transpose(1, 2)  # noqa: E731
        q, k, v = split(att.W_query(h)), split(att.W_key(h)), split(att.W_value(h))
        scores = q @ k.transpose(-2, -1)  # [b, h, t, t]
        future = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(0 if mistake == "mask_diagonal" else 1)
        if mistake == "mask_wrong_side":
            future = torch.ones(t, t, dtype=torch.bool, device=h.device).tril(-1)
        if mistake != "no_mask":
            scores = scores.masked_fill(future, -torch.inf)
        scale = {"no_scale": 1.0, "scale_emb_dim": d ** 0.5}.get(mistake, hd ** 0.5)
        weights = torch.softmax(scores / scale, dim=-2 if mistake == "softmax_dim" else -1)
        context = weights @ v  # [b, h, t, hd]
        merged = context.reshape(b, t, d) if mistake == "view_no_transpose" else context.transpose(1, 2).reshape(b, t, d)
        return att.out_proj(merged)
    return run


# --- comparing, and naming the mistake ------------------------------------------------------

def _compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> StageCheck:
    got, want = got.double().reshape(want.shape), want.to(got.device)
    diff = (got - want).abs()
    tol = TOLERANCE.get(dtype, 1e-5) * max(float(want.abs().max()), 1e-30)
    bad = ~torch.isfinite(got)
    non_finite = None
    if bool(bad.any()):  # where the first NaN (or inf) sits, in the order of the positions
        non_finite = "NaN" if bool(torch.isnan(got).any()) else "inf"
        index = tuple(torch.nonzero(bad.reshape(-1, *bad.shape[-2:]).any(0))[0])  # (position, feature)
        worst = nan_aware_diff(got, want)
    else:
        worst = float(diff.max()) if diff.numel() else 0.0
        index = torch.unravel_index(diff.argmax(), diff.shape)
    where = {"position": int(index[-2]), "feature": int(index[-1])}
    block = re.match(r"(?:[\w.]*\.)?(?:trf_blocks|blocks|layers|h)\.(\d+)\b", name)
    if block:
        where = {"block": int(block.group(1)), **where}
    return StageCheck(name, worst, tol, where, non_finite)


def _likely_mistake(kind: str, got: torch.Tensor, book_fn, tol: float) -> str | None:
    """The known mistake of this stage's kind whose output is closest to the reader's, if it reproduces it."""
    best, best_diff = None, math.inf
    for mistake, (stage_kind, _) in MISTAKES.items():
        if stage_kind != kind:
            continue
        want = book_fn(mistake)
        if want is None or want.numel() != got.numel():
            continue
        diff = nan_aware_diff(got, want)
        if diff < best_diff:
            best, best_diff = mistake, diff
    return best if best_diff <= tol else None


def _where_text(where: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in where.items())


def _gpt2_property(kind: str, name: str, got: torch.Tensor, book_fn, seen: dict, key: str, ref: GPTModel,
                   model: nn.Module, layout: Layout, batch: torch.Tensor):
    """The property of GPT-2's formula that this stage breaks, on the reader's own tensors (pieces/stages.py),
    where no known mistake reproduces it; None where none does."""
    from .pieces.stages import (attention_module, embeddings_sum, factor, feed_forward_module, norm_stage,
                                shortcut_sum, table_rows)  # here: pieces imports this module
    d, x = ref.cfg.emb_dim, seen[key][0]
    if kind == "tok_emb":
        broken = table_rows(name, got, ref.tok_emb.weight, batch[0].tolist(), "token")
    elif kind == "pos_emb":
        broken = table_rows(name, got, ref.pos_emb.weight, list(range(batch.shape[1])), "position")
    elif kind == "embeddings":
        broken = embeddings_sum(got, seen["tok_emb"][1], seen["pos_emb"][1].reshape(-1, *got.shape[-2:])[:1],
                                1.0, d)
    elif kind == "norm":
        norm = ref.get_submodule(name)
        broken = norm_stage(name, x, got, norm.scale, norm.shift, False, norm.eps)
    elif kind == "shortcut":
        part = book_fn("no_shortcut")
        broken = shortcut_sum(name, got, book_fn(None) - part, part, d)
    elif kind in ("att", "ff") and name in layout.stages:
        module = model.get_submodule(layout.stages[name])
        own = not type(module).__module__.startswith("transformers")  # transformers' masks come from outside it
        broken = attention_module(name, module, x, got, cut_off=own) if kind == "att" else \
            feed_forward_module(name, module, x, "GELU (the tanh form)")
    else:
        broken = None
    return broken or factor(name, got, book_fn(None), d)


def _finding(stages: list[StageCheck], first: StageCheck | None, mistake: str | None, broken=None,
             kind: str = "") -> str:
    if first is None:
        worst = max(stages, key=lambda s: s.max_diff / s.tolerance)
        return (f"matches the book's formulas at every stage (largest difference {worst.max_diff:.2g}, at "
                f"{worst.name}; tolerance {TOLERANCE[torch.float32]:g} of each stage's largest value)")
    if first.non_finite:
        at = f"{first.name} is the first stage that differs from the book's formulas: its output is " \
             f"{first.non_finite}, first at {_where_text(first.where)}"
    else:
        at = f"{first.name} is the first stage that differs from the book's formulas (largest difference " \
             f"{first.max_diff:.3g} at {_where_text(first.where)})"
    if mistake == "dropout":
        return f"{at}: {DROPOUT}."
    if mistake is not None:
        return f"{at}: {MISTAKES[mistake][1]}."
    if first.non_finite:
        return f"{at}: {NON_FINITE}."
    return _property_or_checked(at, broken, kind, first.name)


def _property_or_checked(at: str, broken, kind: str, name: str) -> str:
    """The broken property's sentence after where the stage differs; else what was checked there."""
    if broken is not None:
        return f"{at}: {broken.words}."
    from .pieces.stages import CHECKED
    return (f"{at}; it keeps what was checked there ({CHECKED.get(kind, 'a factor on the formula')}), and no known "
            f"mistake reproduces it: compare your {name.split('.')[-1]} line by line with the book's.")


def _tie_note(glass: GPTModel) -> list[str]:
    if glass.tied or glass.cfg.num_classes is not None:
        return []
    if torch.equal(glass.out_head.weight, glass.tok_emb.weight):
        return ["out_head.weight holds the same numbers as tok_emb.weight but is a copy, not the same tensor: "
                "training will move them apart; to tie them, assign model.out_head.weight = model.tok_emb.weight"]
    return []


# --- every other described model: each stage against its description's formulas ---------------------
# The description (anatomy.py, through kinds.describe) says where each part sits and what it computes: the
# norms' kind, eps and placement, the attention's heads, groups, RoPE, window, scale and QK-norm, the
# feed-forward's kind, the head's scale. Each stage is computed again from those formulas on the module's
# own weights (float64; a norm in the model's dtype through float32, as the models compute it, so that its
# float32 tolerance holds in bfloat16 too), from the module's own input to it. Between the stages, what each
# sublayer reads is checked against the placement (pre, post, sandwich, parallel): a "(input)" stage, shown
# only where it differs. Gemma 4's per-layer inputs are a stage before the blocks (from the module's own
# embeddings), each block's gated add of its slice and the norm on it two more, and its layer_scalar is part of
# the block's last shortcut. No model file is imported: the description is the reference.

DESCRIBED_MISTAKES = {
    "rope_interleaved": ("att", "RoPE rotates neighbouring pairs (x[0], x[1]), ... (interleaved); the book and "
                                "Hugging Face's weights pair the halves: x1 = x[..., :hd//2], x2 = x[..., hd//2:], "
                                "rotated = cat(-x2, x1)"),
    "rope_on_values": ("att", "RoPE is applied to the values too: rotate only the queries and the keys"),
    "no_qk_norm": ("att", "QK-norm is missing: Qwen3 RMS-norms each query and key head (q_norm, k_norm) before RoPE"),
    "qk_norm_after_rope": ("att", "QK-norm runs after RoPE: apply q_norm and k_norm first, then rotate"),
    "repeat": ("att", "the key/value groups are expanded with repeat ([K1, K2, K1, K2]): use "
                      "repeat_interleave(group_size, dim=1) ([K1, K1, K2, K2]), so neighbouring query heads share "
                      "a group"),
    "no_freq_scaling": ("att", "Llama 3's RoPE frequency scaling is missing: pass freq_config (factor, "
                               "low_freq_factor, high_freq_factor, original_context_length) to compute_rope_params"),
    "rope_base": ("att", "RoPE runs with theta base {base:,.0f}, not the config's rope_base {want:,.0f}: pass "
                         "theta_base=cfg['rope_base'] to compute_rope_params"),
    "no_mask": ("att", MISTAKES["no_mask"][1]),
    "no_scale": ("att", "the attention scores are not scaled: multiply q @ k.T by {scale:.4g} (1 / sqrt(head_dim), "
                        "or the model's own query_pre_attn_scalar^-0.5) before the softmax"),
    "no_window": ("att", "this {layer_type} layer lets each query see every earlier position: hide the keys {window} "
                         "or more positions back (query - key >= {window}) as well as the future"),
    "no_v_norm": ("att", "the values are not normed: this model RMS-normalises each value head, without a weight, "
                         "before the attention reads them: values = v_norm(values)"),
    "v_norm_scaled": ("att", "the value norm multiplies by a weight: this model's v_norm has none (Gemma4RMSNorm(..., "
                             "with_scale=False)), values / rms(values) alone"),
    "per_layer_emb_not_scaled": ("per_layer_inputs", "the per-layer embeddings are not multiplied by sqrt({p}): "
                                                     "embed_tokens_per_layer(ids) * hidden_size_per_layer_input ** 0.5"),
    "per_layer_not_halved": ("per_layer_inputs", "the per-layer embeddings and the projection of the embedding are "
                                                 "summed without the factor 2 ** -0.5: (projected + own) * 2 ** -0.5"),
    "layer_scalar_missing": ("shortcut", "the block's output is not multiplied by {scalar} ({scalar_value:.4g}): the "
                                         "block's last step is x * self.layer_scalar, one stored number per block"),
    "norm_eps": ("norm", "RMSNorm's eps is {eps:g}, not {want:g}: Qwen3 uses 1e-6, Llama 3 1e-5"),
    "norm_low_precision": ("norm", "RMSNorm is computed in {dtype}: square and average in float32 "
                                   "(x = x.to(torch.float32)), then cast back, as the book's qwen3_compatible does"),
    "norm_plus_one_missing": ("norm", "the RMSNorm multiplies by its weight, where this model's multiplies by "
                                      "(1 + weight) (the weight is stored zero-centred): x_norm * (1.0 + self.weight)"),
    "gate_up_swapped": ("ff", "SwiGLU's gate and up are swapped: silu(fc1(x)) * fc2(x), with fc1 the gate "
                              "(gate_proj) and fc2 the up (up_proj)"),
    "moe_not_renormalised": ("ff", "the chosen experts' weights are a softmax over all {n} experts' logits, so the "
                                   "{k} chosen do not sum to 1: take the top {k} logits first, then softmax over those "
                                   "(topk_probs = softmax(topk_scores))"),
    "emb_not_scaled": ("embeddings", "the embedding is not multiplied by sqrt(emb_dim) = {scale:.4g}: "
                                     "x = tok_emb(ids) * emb_dim ** 0.5, so that the residual stream starts at the "
                                     "size the blocks' outputs have"),
    "logit_scale_missing": ("head", "the logits are not multiplied by logit_scale {scale:g}: "
                                    "out_head(x) * logit_scale"),
    "norm_before": ("reads", "the norm sits before the sublayer, where this {placement}-norm block puts it after: "
                             "x + {norm}(sublayer(x)); the sublayer reads the residual stream itself"),
    "norm_skipped": ("reads", "the sublayer reads the block's residual stream, not its norm: x + sublayer({norm}(x))"),
    "sequential": ("reads", "the feed-forward reads the stream after the attention was added (one sublayer after "
                            "the other); this block is parallel: attention and feed-forward both read the one "
                            "{norm}(x), and the block returns x + att + ff"),
}
# The lines a Qwen3/Llama port's pieces are checked for alone (pieces/next_models.py), as verify_family.py had them.
PORT_MISTAKES = {name: DESCRIBED_MISTAKES[name] for name in (
    "rope_interleaved", "rope_on_values", "no_qk_norm", "qk_norm_after_rope", "repeat", "no_freq_scaling", "rope_base",
    "norm_eps", "norm_low_precision", "gate_up_swapped")}
ROPE_BASES = (10_000.0, 500_000.0, 1_000_000.0)
EPSILONS = (1e-5, 1e-6, 1e-8, 0.0)


@dataclass
class _Stage:
    name: str
    got: torch.Tensor
    formula: Callable  # (mistake or None) -> the formula's output, the mistake as (name, value)
    kind: str          # tok_emb, pos_emb, embeddings, norm, att, shortcut, ff, head, reads
    facts: dict[str, Any] = field(default_factory=dict)  # what the sentences name (the scale, the window, ...)


def check_described(model: nn.Module, anatomy: an.Anatomy, ids: list[int] | None = None,
                    text: str | None = None) -> CheckResult:
    """Check a described model on `ids`, else on `text` read as its UTF-8 bytes (its own tokenizer is not loaded;
    ids modulo a toy vocabulary), else on 12 ids spread over the vocabulary."""
    check_computable(model)
    vocab, context = anatomy.embedding.vocab_size, anatomy.positions.context_length
    if ids is None and text:
        ids = [b % vocab for b in text.encode("utf-8")][-context:]
    if ids is None:
        ids = [(7919 * i + 11) % vocab for i in range(12)]
    weight = _param(model, anatomy.embedding.path, "weight")
    batch = torch.tensor([ids], device=weight.device)
    seen = _record_described(model, anatomy, batch)
    stages, first, mistake, facts, broken = [], None, None, {}, None
    with torch.no_grad():
        for stage in _described_stages(model, anatomy, seen, batch):
            dtype = torch.float32 if stage.kind == "norm" else stage.got.dtype
            checked = _compare(stage.name, stage.got, stage.formula(None), dtype)
            if stage.kind == "reads" and checked.ok:
                continue  # the wiring is shown only where it is wrong
            stages.append(checked)
            if first is None and not checked.ok:
                first, facts = checked, stage.facts
                mistake = _described_mistake(stage, checked.tolerance)
                if mistake is None and not checked.non_finite:
                    broken = _described_property(stage, model, anatomy, seen)
    finding = _described_finding(anatomy, stages, first, mistake, facts, broken)
    return CheckResult(f"{type(model).__name__} ({anatomy.name})", " ".join(map(str, ids)), stages, first,
                       mistake and mistake[0], finding, _copy_note(model, anatomy),
                       against=f"{anatomy.name}'s description in float64 (norms in the model's dtype)",
                       prop=broken.prop if broken else None, prop_where=broken.where if broken else None)


def _described_property(stage: _Stage, model: nn.Module, anatomy: an.Anatomy, seen: dict):
    """The property of the description's formula this stage breaks, on the model's own tensors
    (pieces/stages.py), where no known mistake reproduces it; None where none does."""
    from .pieces.stages import (Call, attention_call, described_shortcut, embeddings_sum, factor,
                                feed_forward_call, norm_stage, placement)  # here: pieces imports this module
    d, want, facts = anatomy.embedding.emb_dim, stage.formula(None), stage.facts
    broken = None
    if stage.kind == "embeddings":
        pos = seen[anatomy.positions.path][1] if anatomy.positions.kind == "learned" else None
        tok = seen[anatomy.embedding.path][1]
        broken = embeddings_sum(stage.got, tok, None if pos is None else pos.reshape(-1, *tok.shape[-2:])[:1],
                                stage.facts["scale"], d)
    elif stage.kind == "norm":
        norm, mod = stage.facts["norm"], model.get_submodule(stage.facts["norm"].path)
        weight = getattr(mod, norm.weight).detach()
        scale = 1.0 + weight.double() if norm.kind == "rmsnorm_plus_one" else weight
        shift = getattr(mod, norm.bias).detach() if norm.bias else None
        broken = norm_stage(stage.name, seen[norm.path][0], stage.got, scale, shift, norm.kind != "layernorm",
                            norm.eps)
    elif stage.kind in ("att", "ff") and f"{stage.name}<call" in seen:
        call = Call(model.get_submodule(stage.name), *seen[f"{stage.name}<call"])
        x = seen[stage.name][0]
        broken = attention_call(stage.name, call, x, facts["att"], facts["layer_type"], facts.get("again"), model, d) \
            if stage.kind == "att" else feed_forward_call(stage.name, call, x, facts["ff"], model, d)
    elif stage.kind == "shortcut" and "around" in facts:
        broken = described_shortcut(stage.name, stage.got, facts["terms"], facts["around"], facts["formula"], d)
    elif stage.kind == "reads" and facts.get("options"):
        broken = placement(stage.name, stage.got, want, facts["options"])
    return broken or factor(stage.name, stage.got, want, d)


def stage_properties(model: nn.Module, text: str = DEFAULT_TEXT) -> dict[str, Any]:
    """{stage: the property it breaks, or None} for every attention, feed-forward and shortcut stage of a described
    model, measured as if that stage differed (what check does at the first stage that does): a correct model
    breaks none (tests/test_check_described_props.py)."""
    anatomy = describe(model)
    vocab = anatomy.embedding.vocab_size
    ids = [b % vocab for b in text.encode("utf-8")][-anatomy.positions.context_length:]
    weight = _param(model, anatomy.embedding.path, "weight")
    batch = torch.tensor([ids], device=weight.device)
    seen = _record_described(model, anatomy, batch)
    with torch.no_grad():
        return {stage.name: _described_property(stage, model, anatomy, seen)
                for stage in _described_stages(model, anatomy, seen, batch) if stage.kind in ("att", "ff", "shortcut")}


def _record_described(model: nn.Module, anatomy: an.Anatomy, batch: torch.Tensor) -> dict[str, tuple]:
    """{path: (input, output)} of each described part's first call in one forward pass (a module called twice,
    one norm read by two sublayers, keeps its first)."""
    paths = [anatomy.embedding.path, anatomy.final_norm.path, anatomy.head.path]
    paths += [anatomy.positions.path] if anatomy.positions.kind == "learned" else []
    for block in anatomy.blocks:
        paths += [block.path, block.attention.path, block.ff.path] + [n.path for n in block.norms]
        own = block.per_layer_input
        paths += [own.gate.path, own.norm.path] if own is not None else []
    seen: dict[str, tuple] = {}

    reads_own = {b.path for b in anatomy.blocks if b.per_layer_input is not None}
    called = {p for b in anatomy.blocks for p in (b.attention.path, b.ff.path)}  # run again by the properties

    def tap(name: str):
        def hook(_mod, args, kwargs, out):
            x = args[0] if args else next((v for v in kwargs.values() if torch.is_tensor(v)), None)
            y = out[0] if isinstance(out, (tuple, list)) else out
            if name not in seen:
                seen[name] = (None if x is None else x.detach().clone(), y.detach().clone())
                if name in called:
                    seen[f"{name}<call"] = (args, kwargs)
            if name in reads_own and f"{name}<per_layer" not in seen:  # Gemma 4's block(x, per_layer_input, ...)
                own = args[1] if len(args) > 1 else kwargs.get("per_layer_input")
                seen[f"{name}<per_layer"] = own.detach().clone()
        return hook

    handles = [model.get_submodule(p).register_forward_hook(tap(p), with_kwargs=True) for p in dict.fromkeys(paths)]
    try:
        with torch.inference_mode(), evaluating_all(model):
            seen["logits"] = (batch, module_logits(model, batch).detach().clone())
    except GlassError:
        raise
    except Exception as err:  # the reader's own forward failed: say where, in one line
        raise GlassError(f"{type(model).__name__}.forward failed on a {list(batch.shape)} prompt: "
                         f"{type(err).__name__}: {err}") from None
    finally:
        for h in handles:
            h.remove()
    missing = [p for p in dict.fromkeys(paths) if p not in seen]
    if missing:
        raise GlassError(f"{type(model).__name__}.forward never calls {missing[0]}, which its description "
                         f"({anatomy.name}) names: check runs the parts the description names")
    return seen


def _described_stages(model: nn.Module, anatomy: an.Anatomy, seen: dict, batch: torch.Tensor):
    """Every stage in the order the data flows, each fed with the model's own input to it."""
    emb, t = anatomy.embedding, batch.shape[1]
    table = _param(model, emb.path, "weight").double()
    scale = emb.scale or 1.0
    # an embedding module that scales its own rows (transformers' Gemma3TextScaledWordEmbedding): the scale is its
    inside = scale != 1.0 and _compare(emb.path, seen[emb.path][1], table[batch] * scale, seen[emb.path][1].dtype).ok
    yield _Stage(emb.path, seen[emb.path][1], lambda m: table[batch] * (scale if inside else 1.0), "tok_emb")
    tok, pos = seen[emb.path][1].double(), 0.0
    if anatomy.positions.kind == "learned":
        path = anatomy.positions.path
        positions = _param(model, path, "weight").double()
        yield _Stage(path, seen[path][1], lambda m: positions[:t][None], "pos_emb")
        pos = seen[path][1].double().reshape(-1, t, emb.emb_dim)[:1]
    after = 1.0 if inside else scale
    yield _Stage("embeddings", seen[anatomy.blocks[0].path][0],
                 lambda m: (tok if m else tok * after) + pos, "embeddings", {"scale": after})
    previous = seen[anatomy.blocks[0].path][0]
    if emb.per_layer_inputs is not None:
        yield _per_layer_inputs_stage(model, anatomy, seen, batch)
    for block in anatomy.blocks:
        yield _reads(f"{block.path} (input)", seen[block.path][0], previous, {})
        src = block.attention.kv_shared_from  # a kv-shared layer's keys and values: from its source layer's input
        yield from _block_stages(model, block, seen, None if src is None else seen[anatomy.blocks[src].attention.path][0])
        previous = seen[block.path][1]
    final = anatomy.final_norm
    yield _reads(f"{final.path} (input)", seen[final.path][0], previous, {})
    yield _norm_stage(model, final, seen)
    head = anatomy.head
    yield _reads(f"{head.path} (input)", seen[head.path][0], seen[final.path][1], {})
    # a logit scale or softcap applied after the head's module (Tiny Aya's forward): the model's logits
    scaled = head.logit_scale is not None or head.softcap is not None
    yield _Stage(head.path, seen["logits" if scaled else head.path][1], _head_formula(model, head, seen[head.path][0]),
                 "head", {"scale": head.logit_scale or 1.0})


def _per_layer_inputs_stage(model: nn.Module, anatomy: an.Anatomy, seen: dict, batch: torch.Tensor) -> _Stage:
    """Gemma 4's per-layer inputs `[b, t, L, p]`, as the blocks read them (each its slice): the token's row of the
    second table times sqrt(p), plus norm(projection(the embeddings) / sqrt(d)) per layer, times 2^-0.5."""
    pl, emb = anatomy.embedding.per_layer_inputs, anatomy.embedding
    b, t = batch.shape
    got = torch.stack([seen[f"{blk.path}<per_layer"] for blk in anatomy.blocks], dim=2)  # L x [b, t, p] -> [b, t, L, p]
    own = _param(model, emb.per_layer, "weight").double()[batch].reshape(b, t, pl.n_layers, pl.dim) * pl.dim ** 0.5
    x = seen[anatomy.blocks[0].path][0]
    projected = (_linear(model, pl.projection, x) * emb.emb_dim ** -0.5).reshape(b, t, pl.n_layers, pl.dim)
    normed = _norm_formula(model, pl.norm, projected)(None)

    def formula(mistake):
        name = (mistake or (None,))[0]
        mixed = normed + (own / pl.dim ** 0.5 if name == "per_layer_emb_not_scaled" else own)
        return (mixed if name == "per_layer_not_halved" else mixed * 2 ** -0.5).reshape(b, t, -1)
    return _Stage("per-layer inputs", got.reshape(b, t, -1), formula, "per_layer_inputs", {"p": pl.dim})


def _block_stages(model: nn.Module, block: an.Block, seen: dict, kv_in: torch.Tensor | None = None):
    """One block's stages by its placement: pre x + sub(norm(x)); post x + norm(sub(x)); sandwich
    x + norm(sub(norm(x))); parallel x + att(norm(x)) + ff(norm(x)); then Gemma 4's per-layer input,
    x + norm(projection(gelu_tanh(gate(x)) * its input)), and the output times the block's stored scale.
    kv_in: a kv-shared layer's keys and values are made from its source layer's attention input."""
    att, ff, place = block.attention, block.ff, block.placement
    x, out = seen[block.path]
    (a_in, a_out), (f_in, f_out) = seen[att.path], seen[ff.path]
    before = {"pre": ("attn_in", "ff_in"), "sandwich": ("attn_in", "ff_in"), "parallel": ("attn_in", "attn_in")}
    after = {"post": ("attn_out", "ff_out"), "sandwich": ("attn_out", "ff_out")}
    n_in = [block.norm(r) for r in before.get(place, (None, None))]
    n_out = [block.norm(r) for r in after.get(place, (None, None))]
    # the attention
    if n_in[0] is not None:
        yield _reads(f"{n_in[0].path} (input)", seen[n_in[0].path][0], x, {})
        yield _norm_stage(model, n_in[0], seen)
        yield _reads(f"{att.path} (input)", a_in, seen[n_in[0].path][1], {"norm": n_in[0].path.rpartition(".")[2]},
                     {"norm_skipped": x})
    else:
        norm = n_out[0]
        yield _reads(f"{att.path} (input)", a_in, x, {"norm": norm.path.rpartition(".")[2], "placement": place},
                     {"norm_before": _norm_formula(model, norm, x)(None)})
    yield _attention_stage(model, att, a_in, a_out, block.layer_type, kv_in)
    added = yield from _norm_after(model, n_out[0], att.path, place, x, a_out, seen)
    if place == "parallel":
        normed = _norm_formula(model, n_in[0], x.double() + a_out.double())(None)
        yield _reads(f"{ff.path} (input)", f_in, seen[n_in[0].path][1], {"norm": n_in[0].path.rpartition(".")[2]},
                     {"sequential": normed})
        yield _Stage(ff.path, f_out, _ff_formula(model, ff, f_in), "ff", _ff_facts(ff))
        leaf = lambda p: p.rpartition(".")[2]  # noqa: E731
        yield _scaled(model, block, f"{block.path}.shortcut", out, lambda: x.double() + a_out.double() + f_out.double(),
                      {"around": "the attention and the feed-forward", "terms": (("its input", x), (
                          "the attention's output", a_out), ("the feed-forward's output", f_out)), "formula":
                       f"x + {leaf(att.path)}({leaf(n_in[0].path)}(x)) + {leaf(ff.path)}({leaf(n_in[0].path)}(x))"})
        return
    # the stream after the first shortcut, as the next part reads it
    h = seen[n_in[1].path][0] if n_in[1] is not None else f_in
    yield _Stage(f"{block.path}.shortcut1", h, lambda m: x.double() + added.double(), "shortcut",
                 _around("the attention", att.path, n_in[0], n_out[0], x, added))
    if n_in[1] is not None:
        yield _norm_stage(model, n_in[1], seen)
        yield _reads(f"{ff.path} (input)", f_in, seen[n_in[1].path][1], {"norm": n_in[1].path.rpartition(".")[2]},
                     {"norm_skipped": h})
    else:
        norm = n_out[1]
        yield _reads(f"{ff.path} (input)", f_in, h, {"norm": norm.path.rpartition(".")[2], "placement": place},
                     {"norm_before": _norm_formula(model, norm, h)(None)})
    yield _Stage(ff.path, f_out, _ff_formula(model, ff, f_in), "ff", _ff_facts(ff))
    added = yield from _norm_after(model, n_out[1], ff.path, place, h, f_out, seen)
    own = block.per_layer_input
    around = _around("the feed-forward", ff.path, n_in[1], n_out[1], h, added)
    if own is None:
        yield _scaled(model, block, f"{block.path}.shortcut2", out, lambda: h.double() + added.double(), around)
        return
    h2 = seen[own.gate.path][0]  # the stream after the second shortcut, as the per-layer gate reads it
    yield _Stage(f"{block.path}.shortcut2", h2, lambda m: h.double() + added.double(), "shortcut", around)
    yield _Stage(f"{block.path}.per_layer_input", seen[own.norm.path][0],
                 _per_layer_formula(model, own, h2, seen[f"{block.path}<per_layer"]), "per_layer")
    yield _norm_stage(model, own.norm, seen)
    normed = seen[own.norm.path][1]
    yield _scaled(model, block, f"{block.path}.shortcut3", out, lambda: h2.double() + normed.double())


def _per_layer_formula(model: nn.Module, own: an.PerLayerInput, x: torch.Tensor, per_layer: torch.Tensor) -> Callable:
    """projection(gelu_tanh(gate(x)) * the block's per-layer input), before its norm."""
    return lambda m: _linear(model, own.projection, F.gelu(_linear(model, own.gate, x), approximate="tanh")
                             * per_layer.double())


def _scaled(model: nn.Module, block: an.Block, name: str, out: torch.Tensor, summed: Callable,
            around: dict | None = None) -> _Stage:
    """The block's last shortcut, times its stored output scale where it has one (Gemma 4's layer_scalar)."""
    if block.output_scale is None:
        return _Stage(name, out, lambda m: summed(), "shortcut", around or {})
    scale = getattr(model.get_submodule(block.path), block.output_scale)
    value = scale.double().reshape(())
    return _Stage(name, out, lambda m: summed() if m else summed() * value, "shortcut",
                  {"scalar": f"{block.path}.{block.output_scale}", "scalar_value": float(value)})


def _around(part: str, path: str, before: an.Norm | None, after: an.Norm | None, x: torch.Tensor,
            added: torch.Tensor) -> dict:
    """What a shortcut's property names: the part it goes around, the block's input to it, what is added, and the
    placement's line, x + post(part(pre(x)))."""
    leaf = lambda p: p.rpartition(".")[2]  # noqa: E731
    inner = f"{leaf(path)}({leaf(before.path)}(x))" if before is not None else f"{leaf(path)}(x)"
    return {"around": part, "terms": (("its input", x), (f"{part}'s output", added)),
            "formula": f"x + {leaf(after.path)}({inner})" if after is not None else f"x + {inner}"}


def _norm_after(model: nn.Module, norm: an.Norm | None, path: str, place: str, x: torch.Tensor, out: torch.Tensor,
                seen: dict):
    """A norm after the sublayer at `path` (post, sandwich): what it reads (the sublayer's output `out`), then the
    norm itself; returns what the shortcut adds to the stream `x` (the sublayer's output where no norm follows)."""
    if norm is None:
        return out
    yield _reads(f"{norm.path} (input)", seen[norm.path][0], out, {"options": _post_ln(norm, path, place, x, out)})
    yield _norm_stage(model, norm, seen)
    return seen[norm.path][1]


def _post_ln(norm: an.Norm, path: str, place: str, x: torch.Tensor, out: torch.Tensor) -> tuple:
    """A norm after a sublayer that reads the stream after the add instead (the original Transformer's post-LN)."""
    n, p = norm.path.rpartition(".")[2], path.rpartition(".")[2]
    return ((f"{n} reads x + {p}(x), the stream after the shortcut (first at position {{p}}): the norm comes after "
             f"the add, as in the original Transformer's post-LN, where this {place}-norm block norms {p}'s output "
             f"before adding it, x + {n}({p}(...))", x.double() + out.double()),)


def _reads(name: str, got: torch.Tensor, want: torch.Tensor, facts: dict, wrong: dict | None = None) -> _Stage:
    """What a part reads against what the placement says it reads; `wrong`: a known miswiring's input."""
    wrong = wrong or {}
    return _Stage(name, got, lambda m: want.double() if m is None else wrong[m[0]].double(), "reads",
                  facts | {"wrong": tuple(wrong)})


def _norm_stage(model: nn.Module, norm: an.Norm, seen: dict) -> _Stage:
    x, y = seen[norm.path]
    return _Stage(norm.path, y, _norm_formula(model, norm, x), "norm",
                  {"norm": norm, "dtype": x.dtype})


def _ff_facts(ff: an.FeedForward) -> dict:
    return {"ff": ff} | ({"n": ff.experts.n_experts, "k": ff.experts.per_token} if ff.experts else {})


# --- the formulas, read from the description -------------------------------------------------------

def _param(model: nn.Module, path: str, leaf: str) -> torch.Tensor:
    return getattr(model.get_submodule(path), leaf)


def _matrix(model: nn.Module, lin: an.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight `[out, in]`, bias or None) in float64, as nn.Linear would hold them: the description's rows of
    a fused module, its head_rows, a Conv1D's transpose."""
    mod = model.get_submodule(lin.path)
    w, b = mod.weight.double(), getattr(mod, "bias", None)
    w = w.t() if lin.transposed else w
    b = None if b is None or not lin.bias else b.double()
    if lin.rows is not None:
        w, b = w[lin.rows[0]:lin.rows[1]], None if b is None else b[lin.rows[0]:lin.rows[1]]
    if lin.head_rows is not None:
        block, start, stop = lin.head_rows
        w = w.reshape(-1, block, w.shape[-1])[:, start:stop].reshape(-1, w.shape[-1])
        b = None if b is None else b.reshape(-1, block)[:, start:stop].reshape(-1)
    return w, b


def _linear(model: nn.Module, lin: an.Linear, x: torch.Tensor) -> torch.Tensor:
    w, b = _matrix(model, lin)
    return F.linear(x.double(), w, b)


def _norm_formula(model: nn.Module, norm: an.Norm, x: torch.Tensor) -> Callable:
    """The norm over the last dimension, computed through float32 and returned in x's dtype as the models do
    (float64 stays float64), or with a mistake (name, value)."""
    mod = model.get_submodule(norm.path)
    weight = getattr(mod, norm.weight) if norm.weight else None  # None: x / rms(x) alone (Gemma 4's value norm)
    bias = getattr(mod, norm.bias) if norm.bias else None

    def run(mistake):
        name, value = mistake or (None, None)
        if name == "norm_low_precision":  # in x's dtype; then times a scale of value[1]'s dtype
            low = x.pow(2).mean(dim=-1, keepdim=True)
            return ((x * torch.rsqrt(low + norm.eps)) * weight.to(value[1])).to(x.dtype).double()
        h = x if x.dtype == torch.float64 else x.float()
        if norm.kind == "layernorm":
            h = h - h.mean(dim=-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + (value if name == "norm_eps" else norm.eps))
        plus_one = norm.kind == "rmsnorm_plus_one" and name != "norm_plus_one_missing"
        if weight is not None:
            h = h * ((1.0 + weight.to(h.dtype)) if plus_one else weight.to(h.dtype))
        return (h if bias is None else h + bias.to(h.dtype)).to(x.dtype).double()
    return run


def _activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_tanh" else "none")


def _ff_formula(model: nn.Module, ff: an.FeedForward, x: torch.Tensor) -> Callable:
    """gelu_mlp: down(act(up(x))); swiglu / geglu: down(act(gate(x)) * up(x)); moe: the top-k experts' outputs,
    each weighted by the softmax over the k chosen router logits."""
    def one(up: an.Linear, gate: an.Linear | None, down: an.Linear, swapped: bool) -> torch.Tensor:
        if gate is None:
            return _linear(model, down, _activation(ff.activation, _linear(model, up, x)))
        g, u = _linear(model, gate, x), _linear(model, up, x)
        g, u = (u, g) if swapped else (g, u)
        return _linear(model, down, _activation(ff.activation, g) * u)

    def run(mistake):
        name = (mistake or (None,))[0]
        if ff.experts is None:
            return one(ff.up, ff.gate, ff.down, name == "gate_up_swapped")
        experts = ff.experts
        logits = _linear(model, experts.router, x)  # [b, t, E]
        top, chosen = torch.topk(logits, experts.per_token, dim=-1)  # [b, t, k]
        probs = logits.softmax(-1).gather(-1, chosen) if name == "moe_not_renormalised" else top.softmax(-1)
        out = torch.zeros_like(x, dtype=torch.float64)
        for j in range(experts.n_experts):
            weight = (probs * (chosen == j)).sum(-1, keepdim=True)  # [b, t, 1]: 0 where j is not chosen
            if bool(weight.any()):
                lin = [None if p is None else replace(p, path=f"{p.path.rpartition('.')[0]}.{j}")
                       for p in (ff.up, ff.gate, ff.down)]
                out = out + weight * one(*lin, name == "gate_up_swapped")
        return out
    return run


def _head_formula(model: nn.Module, head: an.Head, x: torch.Tensor) -> Callable:
    w = model.get_submodule(head.path).weight.double()
    b = getattr(model.get_submodule(head.path), "bias", None)

    def run(mistake):
        logits = F.linear(x.double(), w, None if b is None else b.double())
        if head.logit_scale is not None and mistake is None:
            logits = logits * head.logit_scale
        return logits if head.softcap is None else torch.tanh(logits / head.softcap) * head.softcap
    return run


def _attention_stage(model: nn.Module, att: an.Attention, x: torch.Tensor, out: torch.Tensor, layer_type: str,
                     kv_in: torch.Tensor | None = None):
    facts = {"att": att, "layer_type": layer_type.removesuffix("_attention"), "window": att.window,
             "scale": att.scale or att.head_dim ** -0.5,
             "v_norm_weight": att.v_norm is not None and isinstance(
                 getattr(model.get_submodule(att.v_norm.path), "weight", None), torch.Tensor)}
    formula = _linear_attention(model, att, x) if att.kind == "linear" else _causal_attention(model, att, x, kv_in)
    if att.kind == "causal":  # the formula again on another input (pieces/stages.py's properties)
        facts["again"] = lambda x_, mistake: _causal_attention(model, att, x_, kv_in)(mistake)
    return _Stage(att.path, out, formula, "att", facts)


def _causal_attention(model: nn.Module, att: an.Attention, x: torch.Tensor, kv_x: torch.Tensor | None = None) -> Callable:
    """softmax(q k^T * scale, causal, windowed) v, per head, with the described QK-norm, value norm, RoPE, groups,
    latent and output gate; or with a mistake (name, value). kv_x: what the keys and values are made from, where
    not x (a kv-shared layer: its source layer's input)."""
    b, t, _ = x.shape
    h, g, hd = att.n_heads, att.n_kv_groups, att.head_dim

    def heads(y: torch.Tensor, n: int) -> torch.Tensor:
        return y.reshape(b, t, n, hd).transpose(1, 2)  # [b, t, n*hd] -> [b, n, t, hd]

    def qk_norm(norm: an.Norm | None, y: torch.Tensor, whole: bool) -> torch.Tensor:
        if norm is None or (norm.dim != hd) != whole:
            return y
        return _norm_formula(model, norm, y)(None)

    def run(mistake):
        name, value = mistake or (None, None)
        kv_in = kv_x if kv_x is not None else x
        kv_in = _linear(model, att.latent, kv_in) if att.latent is not None else kv_in
        q, k, v = _linear(model, att.query, x), _linear(model, att.key, kv_in), _linear(model, att.value, kv_in)
        normed = name not in ("no_qk_norm", "qk_norm_after_rope")
        if normed:
            q, k = qk_norm(att.q_norm, q, True), qk_norm(att.k_norm, k, True)
        q, k, v = heads(q, h), heads(k, g), heads(v, g)
        if normed:
            q, k = qk_norm(att.q_norm, q, False), qk_norm(att.k_norm, k, False)
        if att.v_norm is not None and name != "no_v_norm":
            v_norm = att.v_norm if name != "v_norm_scaled" else replace(att.v_norm, weight="weight")
            v = _norm_formula(model, v_norm, v)(None)
        if att.rope is not None:
            cos, sin = _rope_tables(att.rope, t, value if name == "rope_base" else None, name != "no_freq_scaling",
                                    "neighbours" if name == "rope_interleaved" else None)
            pairs = "neighbours" if name == "rope_interleaved" else att.rope.pairs
            q, k = _rotate(q, cos, sin, pairs), _rotate(k, cos, sin, pairs)
            v = _rotate(v, cos, sin, pairs) if name == "rope_on_values" else v
        if name == "qk_norm_after_rope":
            q, k = qk_norm(att.q_norm, q, False), qk_norm(att.k_norm, k, False)
        expand = (lambda y: y.repeat(1, h // g, 1, 1)) if name == "repeat" else (
            lambda y: y.repeat_interleave(h // g, dim=1))
        k, v = expand(k), expand(v)
        if name == "raw_scores":  # q k^T as the description makes q and k (pieces/stages.py fits the scale on it)
            return q @ k.transpose(-2, -1)  # [b, h, t, s]
        attn = attention_weights(att, q, k, scale=1.0 if name == "no_scale" else (att.scale or hd ** -0.5),
                                 windowed=name != "no_window", masked=name != "no_mask")  # [b, h, t, t]
        context = (attn @ v).transpose(1, 2).reshape(b, t, h * hd)  # [b, t, h*hd]
        if att.output_gate is not None:
            context = context * torch.sigmoid(_linear(model, att.output_gate, x))
        if name == "context":  # what `out` reads (pieces/stages.py reads each head's row sums off it)
            return context
        return _linear(model, att.out, context)
    return run


def _linear_attention(model: nn.Module, att: an.Attention, x: torch.Tensor) -> Callable:
    """The gated delta rule (anatomy.RecurrentState): q, k, v through the short causal convolution (silu), q and k
    of unit length; per token S <- exp(g) S, S += k (beta (v - S^T k))^T, output S^T q / sqrt(dk); then the
    gated norm and out. A_log and dt_bias are the module's own (the notebook's and transformers' names)."""
    state, mod = att.state, model.get_submodule(att.path)
    b, t, _ = x.shape
    hk, dk, hv, dv = att.n_heads, att.head_dim, state.value_heads, state.value_head_dim

    def run(mistake):
        qkv = torch.cat([_linear(model, lin, x) for lin in (att.query, att.key, att.value)], dim=-1)  # [b, t, c]
        conv = model.get_submodule(state.conv).weight.double()  # [c, 1, kernel]
        padded = F.pad(qkv.transpose(1, 2), (state.conv_kernel - 1, 0))
        mixed = F.silu(F.conv1d(padded, conv, groups=conv.shape[0])).transpose(1, 2)  # [b, t, c]
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k = (y.reshape(b, t, hk, dk).repeat_interleave(hv // hk, dim=2) for y in (q, k))
        q, k = (y * torch.rsqrt((y * y).sum(-1, keepdim=True) + 1e-6) for y in (q, k))
        v = v.reshape(b, t, hv, dv)
        beta = torch.sigmoid(_linear(model, state.beta, x))  # [b, t, hv]
        g = -mod.A_log.double().exp() * F.softplus(_linear(model, state.decay, x) + mod.dt_bias.double())
        s = torch.zeros(b, hv, dk, dv, dtype=torch.float64, device=x.device)
        outs = []
        for i in range(t):
            s = s * g[:, i].exp()[..., None, None]
            delta = (v[:, i] - (s * k[:, i, :, :, None]).sum(-2)) * beta[:, i, :, None]  # [b, hv, dv]
            s = s + k[:, i, :, :, None] * delta[:, :, None, :]
            outs.append((s * q[:, i, :, :, None]).sum(-2) * dk ** -0.5)
        out = torch.stack(outs, dim=1)  # [b, t, hv, dv]
        normed = _norm_formula(model, state.norm, out)(None)
        z = _linear(model, state.gate, x).reshape(b, t, hv, dv)
        return _linear(model, att.out, (normed * F.silu(z)).reshape(b, t, hv * dv))
    return run


# --- naming the mistake ----------------------------------------------------------------------------

def _candidates(stage: _Stage):
    """(name, value) of every known mistake this stage's part can make, as its description says."""
    kind, facts = stage.kind, stage.facts
    if kind == "reads":
        yield from ((name, None) for name in facts["wrong"])
    elif kind == "embeddings" and facts["scale"] != 1.0:
        yield "emb_not_scaled", None
    elif kind == "head" and facts["scale"] != 1.0:
        yield "logit_scale_missing", None
    elif kind == "norm":
        norm = facts["norm"]
        yield from (("norm_eps", eps) for eps in EPSILONS if eps != norm.eps)
        if norm.kind == "rmsnorm_plus_one":
            yield "norm_plus_one_missing", None
        if norm.kind == "rmsnorm" and norm.weight and facts["dtype"] not in (torch.float32, torch.float64):
            yield from (("norm_low_precision", (str(facts["dtype"]).removeprefix("torch."), w))
                        for w in (torch.float32, facts["dtype"]))
    elif kind == "per_layer_inputs":
        yield from (("per_layer_emb_not_scaled", None), ("per_layer_not_halved", None))
    elif kind == "shortcut" and facts.get("scalar_value", 1.0) != 1.0:
        yield "layer_scalar_missing", None
    elif kind == "ff":
        ff = facts["ff"]
        yield from ([("gate_up_swapped", None)] if ff.gate is not None else [])
        yield from ([("moe_not_renormalised", None)] if ff.experts is not None else [])
    elif kind == "att" and facts["att"].kind == "causal":
        att = facts["att"]
        yield from (("no_mask", None), ("no_scale", None))
        yield from ([("no_window", None)] if att.window else [])
        yield from ([("repeat", None)] if att.n_kv_groups < att.n_heads else [])
        yield from ([("no_qk_norm", None), ("qk_norm_after_rope", None)] if att.q_norm else [])
        if att.v_norm is not None:  # left out, or given a weight of its own (a module that holds one)
            yield "no_v_norm", None
            yield from ([("v_norm_scaled", None)] if facts["v_norm_weight"] else [])
        if att.rope is not None:
            yield from ([("rope_interleaved", None)] if att.rope.pairs == "halves" else [])
            yield "rope_on_values", None
            yield from ([("no_freq_scaling", None)] if att.rope.scaling == "llama3" else [])
            yield from (("rope_base", base) for base in ROPE_BASES if base != att.rope.base)


def _described_mistake(stage: _Stage, tol: float):
    """The known mistake whose output reproduces the model's numbers (within the stage's tolerance), if one does."""
    best, best_diff = None, math.inf
    right = stage.formula(None)
    for candidate in _candidates(stage):
        want = stage.formula(candidate)
        if want.shape != stage.got.shape or torch.equal(want, right):
            continue  # the same numbers as the right formula: not what the model did
        diff = nan_aware_diff(stage.got, want)
        if diff < best_diff:
            best, best_diff = candidate, diff
    return best if best_diff <= tol else None


def _described_finding(anatomy: an.Anatomy, stages: list[StageCheck], first: StageCheck | None, mistake,
                       facts: dict, broken=None) -> str:
    if first is None:
        worst = max(stages, key=lambda s: s.max_diff / s.tolerance)
        return (f"matches {anatomy.name}'s formulas, as its description gives them, at every stage (largest "
                f"difference {worst.max_diff:.2g}, at {worst.name})")
    if first.name.endswith(" (input)"):
        at = (f"{first.name.removesuffix(' (input)')} is the first stage that differs: it does not read what the "
              f"block's {_placement(anatomy, first.name)} placement gives it (largest difference {first.max_diff:.3g} "
              f"at {_where_text(first.where)})")
    elif first.non_finite:
        at = f"{first.name} is the first stage that differs: its output is {first.non_finite}, first at " \
             f"{_where_text(first.where)}"
    else:
        at = (f"{first.name} is the first stage that differs (largest difference {first.max_diff:.3g} at "
              f"{_where_text(first.where)})")
    if mistake is None:
        kind = "reads" if first.name.endswith(" (input)") else next(
            (k for k in ("norm", "att", "ff", "shortcut") if k in facts or first.name.split(".")[-1].startswith(k)),
            "embeddings" if first.name == "embeddings" else "")
        return _property_or_checked(at, broken, f"described {kind}" if kind in ("att", "ff", "shortcut") else kind,
                                    first.name)
    name, value = mistake
    norm = facts.get("norm")
    words = DESCRIBED_MISTAKES[name][1].format(
        base=value if name == "rope_base" else 0, eps=value if name == "norm_eps" else 0,
        want=facts["att"].rope.base if name == "rope_base" else getattr(norm, "eps", 0),
        dtype=value[0] if name == "norm_low_precision" else None, **{k: v for k, v in facts.items() if k not in (
            "norm", "att", "ff", "wrong", "dtype", "v_norm_weight")}, **({"norm": norm} if isinstance(norm, str) else {}))
    return f"{at}: {words}."


def _placement(anatomy: an.Anatomy, name: str) -> str:
    block = next((b for b in anatomy.blocks if name.startswith(b.path + ".")), None)
    return block.placement if block is not None else "pre"


def _copy_note(model: nn.Module, anatomy: an.Anatomy) -> list[str]:
    emb = _param(model, anatomy.embedding.path, "weight")
    head = getattr(model.get_submodule(anatomy.head.path), "weight", None)
    if head is not None and emb.data_ptr() != head.data_ptr() and emb.shape == head.shape and torch.equal(emb, head):
        return [f"{anatomy.head.path}.weight holds the same numbers as {anatomy.embedding.path}.weight but is a copy, "
                "not the same tensor (its data_ptr differs): training will move them apart; to tie them, assign "
                f"model.{anatomy.head.path}.weight = model.{anatomy.embedding.path}.weight"]
    return []


# --- the same formulas for the pieces' and causes' checks (a Qwen3/Llama port's modules) -------------------

def is_described_port(model: nn.Module) -> bool:
    """A whole model that check_described reads: any described model but GPT-2 (check_gpt2's)."""
    anatomy = _described(model)
    return anatomy is not None and anatomy.name != "GPT-2"


def check_family(model: nn.Module, ids: list[int] | None = None, text: str | None = None) -> CheckResult:
    """check_described on a Qwen3/Llama port (or any described model), on `ids`."""
    return check_described(model, describe(model), ids, text)


def family_attention(att: nn.Module, x: torch.Tensor, cfg, t: int) -> Callable:
    """_causal_attention's formula for one grouped-query attention module with the book's names (W_query,
    W_key, W_value, out_proj, q_norm, k_norm) and a Qwen3/Llama config (rope_base, rope_freq, norm_eps)."""
    d, h, g, hd = x.shape[-1], att.num_heads, att.num_kv_groups, att.head_dim
    qk = {}
    if getattr(att, "q_norm", None) is not None:
        leaf = "scale" if hasattr(att.q_norm, "scale") else "weight"
        qk = {f"{n}_norm": an.Norm(f"{n}_norm", "rmsnorm", hd, cfg.norm_eps, weight=leaf) for n in ("q", "k")}
    freq = getattr(cfg, "rope_freq", None)
    rope = an.Rope(cfg.rope_base, hd, scaling=None if freq is None else "llama3",
                   scaling_values=() if freq is None else tuple((k, float(v)) for k, v in vars(freq).items()))
    described = an.Attention("", "causal", h, g, hd, query=an.Linear("W_query", d, h * hd, False),
                             key=an.Linear("W_key", d, g * hd, False), value=an.Linear("W_value", d, g * hd, False),
                             out=an.Linear("out_proj", h * hd, d, False), rope=rope, **qk)
    return _causal_attention(att, described, x[:, :t])
