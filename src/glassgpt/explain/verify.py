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
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..adopt import Layout, check_computable, evaluating_all, module_logits, read_in_place
from ..errors import GlassError
from ..model import GELU, GPTModel
from ..tokenizer import get_tokenizer
from .result import Result

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

    @property
    def ok(self) -> bool:
        return self.first is None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "prompt": self.prompt, "ok": self.ok, "mistake": self.mistake,
                "finding": self.finding, "notes": self.notes,
                "stages": [{"name": s.name, "max_diff": s.max_diff, "tolerance": s.tolerance, "ok": s.ok,
                            "where": s.where, "non_finite": s.non_finite} for s in self.stages]}

    def to_text(self) -> str:
        lines = [f"glassgpt check: {self.kind}", f"  on {self.prompt!r}, each stage against model.py in float64"]
        for s in self.stages:
            mark = "ok" if s.ok else "DIFFERS"
            where = f"  at {_where_text(s.where)}" if not s.ok else ""
            lines.append(f"  {s.name:<26} {mark:<8} {s.diff_text}{where}")
        return "\n".join(lines + [""] + [self.finding] + [f"note: {n}" for n in self.notes])


def check(model: nn.Module, text: str = DEFAULT_TEXT, ids: list[int] | None = None) -> CheckResult:
    """Check `model` (the book's GPTModel, a reader's copy, nanoGPT's or transformers' GPT) against
    the book's formulas on `text` (or token `ids`): see the module's docstring."""
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
        blk.ff.layers[1] = GELU()
    stages, first, mistake = [], None, None
    for name, (key, io), book_fn, kind in _stages(ref, runs[0], batch):
        got = runs[0][key][io]
        stage = _compare(name, got, book_fn(None), got.dtype)
        stages.append(stage)
        if first is None and not stage.ok:
            first = stage
            if not same_numbers(got, runs[1][key][io]):  # eval mode must give the same numbers twice
                mistake = "dropout"
            else:
                mistake = _likely_mistake(kind, got, book_fn, stage.tolerance)
    return CheckResult(layout.kind, shown, stages, first, mistake, _finding(stages, first, mistake),
                       _tie_note(glass))


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
    if name.startswith("trf_blocks."):
        where = {"block": int(name.split(".")[1]), **where}
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


def _finding(stages: list[StageCheck], first: StageCheck | None, mistake: str | None) -> str:
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
    return f"{at}; no known mistake reproduces it: compare your {first.name.split('.')[-1]} line by line with the book's."


def _tie_note(glass: GPTModel) -> list[str]:
    if glass.tied or glass.cfg.num_classes is not None:
        return []
    if torch.equal(glass.out_head.weight, glass.tok_emb.weight):
        return ["out_head.weight holds the same numbers as tok_emb.weight but is a copy, not the same tensor: "
                "training will move them apart; to tie them, assign model.out_head.weight = model.tok_emb.weight"]
    return []
