"""glassgpt.check for a reader's Qwen3 or Llama 3 port: stage by stage against families/, and the mistake.

verify.py's method, for the book's next models. The reader's module (a copy of the book's
Qwen3Model or Llama3Model, with its `cfg` dict, or glassgpt's own) runs once on a few ids with
forward hooks on `tok_emb`, each block's `norm1`, `att`, `norm2`, `ff` and output, `final_norm`
and `out_head`. Each stage is computed again by families/layers.py on the same weights, from the
reader's own input to it (float64, but RMSNorm in the reader's dtype: its float32 formula is
exact), so a mistake shows at the stage that makes it. At the first stage that differs, each
known mistake of that stage's kind (MISTAKES) is computed in turn; the one that reproduces the
reader's numbers is named. A head that equals tok_emb in value but not in storage is a copy, not a
tie: said in a note, as the data_ptr tells it.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..errors import GlassError
from ..families import FamilyConfig, build_model, is_family_model
from ..families.layers import apply_rope, compute_rope_params, rms_norm
from ..model import attention_weights
from . import verify
from .verify import CheckResult, StageCheck, _compare, _where_text

MISTAKES = {
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
    "norm_eps": ("norm", "RMSNorm's eps is {eps:g}, not {want:g}: Qwen3 uses 1e-6, Llama 3 1e-5"),
    "norm_low_precision": ("norm", "RMSNorm is computed in {dtype}: square and average in float32 "
                                   "(x = x.to(torch.float32)), then cast back, as the book's qwen3_compatible does"),
    "gate_up_swapped": ("ff", "SwiGLU's gate and up are swapped: silu(fc1(x)) * fc2(x), with fc1 the gate "
                              "(gate_proj) and fc2 the up (up_proj)"),
}
ROPE_BASES = (10_000.0, 500_000.0, 1_000_000.0)
EPSILONS = (1e-5, 1e-6, 1e-8, 0.0)


class FamilyCheckResult(CheckResult):
    def to_text(self) -> str:
        return super().to_text().replace("against model.py in float64", "against families/ in float64 (RMSNorm in "
                                                                         "the port's dtype)")


def check(model: nn.Module, text: str = verify.DEFAULT_TEXT, ids: list[int] | None = None) -> CheckResult:
    """glassgpt.check: a Qwen3/Llama port here (on `ids`: its tokenizer is not known), else verify.check (GPT-2)."""
    if is_family_port(model):
        return check_family(model, ids, text)
    return verify.check(model, text, ids)


def is_family_port(model: nn.Module) -> bool:
    """A Qwen3/Llama model: glassgpt's, or a module with the book's names and config dict."""
    if is_family_model(model):
        return True
    cfg = getattr(model, "cfg", None)
    return isinstance(cfg, dict) and "n_kv_groups" in cfg and hasattr(model, "trf_blocks")


def port_config(model: nn.Module) -> FamilyConfig:
    if is_family_model(model):
        return model.cfg
    state = model.state_dict()
    family = "qwen3" if "trf_blocks.0.norm1.scale" in state else "llama3"
    return FamilyConfig.from_book_dict(family, model.cfg)


def check_family(model: nn.Module, ids: list[int] | None = None, text: str | None = None) -> CheckResult:
    """Check a reader's Qwen3/Llama module against families/ on `ids`, else on `text` read as its UTF-8
    bytes (the port's own tokenizer is not loaded; ids modulo a toy vocabulary), else on 12 ids spread
    over the vocabulary."""
    cfg = port_config(model)
    if ids is None and text:
        ids = [b % cfg.vocab_size for b in text.encode("utf-8")][-cfg.context_length:]
    if ids is None:
        ids = [(7919 * i + 11) % cfg.vocab_size for i in range(12)]
    weight = model.tok_emb.weight
    batch = torch.tensor([ids], device=weight.device)
    seen = _record(model, cfg, batch)
    ref = build_model(cfg).double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()}, strict=False)
    t = batch.shape[1]
    stages, first, mistake = [], None, None
    with torch.no_grad():
        return _checked(model, cfg, ref, seen, batch, t, ids)


def _checked(model, cfg, ref, seen, batch, t, ids) -> CheckResult:
    stages, first, mistake = [], None, None
    for name, got, book_fn, kind in _stages(ref, cfg, seen, batch, t):
        stage = _compare(name, got, book_fn(None), got.dtype if kind != "norm" else torch.float32)
        stages.append(stage)
        if first is None and not stage.ok:
            first = stage
            mistake = _likely_mistake(kind, got, book_fn, stage.tolerance)
    kind = f"{type(model).__name__} ({cfg.family})"
    return FamilyCheckResult(kind, " ".join(map(str, ids)), stages, first, mistake and mistake[0],
                       _finding(stages, first, mistake, cfg), _tie_note(model))


def _record(model: nn.Module, cfg: FamilyConfig, batch: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def tap(name: str):
        def hook(_mod, args, out):
            seen[name] = (args[0].detach().clone(), out.detach().clone())
        return hook

    paths = ["tok_emb", "final_norm", "out_head"] + [f"trf_blocks.{i}{s}" for i in range(cfg.n_layers)
                                                     for s in ("", ".norm1", ".att", ".norm2", ".ff")]
    handles = [model.get_submodule(p).register_forward_hook(tap(p)) for p in paths]
    was_training = model.training
    try:
        with torch.inference_mode():
            model.eval()
            model(batch)
    except Exception as err:  # the reader's own forward failed: say where, in one line
        raise GlassError(f"{type(model).__name__}.forward failed on a {list(batch.shape)} prompt: "
                         f"{type(err).__name__}: {err}") from None
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return seen


def _stages(ref: nn.Module, cfg: FamilyConfig, seen: dict, batch: torch.Tensor, t: int):
    """(stage name, the reader's output, fn(mistake) -> families/' output with it, kind), in data-flow order."""
    yield "tok_emb", seen["tok_emb"][1], lambda m: ref.tok_emb.weight[batch], "tok_emb"
    for i, blk in enumerate(ref.trf_blocks):
        p = f"trf_blocks.{i}"
        x_mid = seen[f"{p}.norm2"][0]
        yield f"{p}.norm1", seen[f"{p}.norm1"][1], _norm(blk.norm1, seen[f"{p}.norm1"][0], cfg), "norm"
        yield f"{p}.att", seen[f"{p}.att"][1], _attention(blk.att, seen[f"{p}.att"][0], cfg, t), "att"
        yield f"{p}.shortcut1", x_mid, lambda m, x=seen[p][0], a=seen[f"{p}.att"][1]: x.double() + a.double(), "sum"
        yield f"{p}.norm2", seen[f"{p}.norm2"][1], _norm(blk.norm2, x_mid, cfg), "norm"
        yield f"{p}.ff", seen[f"{p}.ff"][1], _feed_forward(blk.ff, seen[f"{p}.ff"][0]), "ff"
        yield f"{p}.shortcut2", seen[p][1], lambda m, x=x_mid, f=seen[f"{p}.ff"][1]: x.double() + f.double(), "sum"
    yield "final_norm", seen["final_norm"][1], _norm(ref.final_norm, seen["final_norm"][0], cfg), "norm"
    yield "out_head", seen["out_head"][1], lambda m, x=seen["out_head"][0]: ref.out_head(x.double()), "out_head"


def _norm(norm: nn.Module, x: torch.Tensor, cfg: FamilyConfig) -> Callable:
    """RMSNorm in the reader's dtype (its float32 formula is exact), or with a mistake: (name, value) pairs."""
    weight = (norm.scale if hasattr(norm, "scale") else norm.weight).to(torch.float32)

    def run(mistake):
        if mistake is None:
            return rms_norm(x, weight, cfg.norm_eps).double()
        name, value = mistake
        if name == "norm_eps":
            return rms_norm(x, weight, value).double()
        low = x.pow(2).mean(dim=-1, keepdim=True)  # in x's dtype; then times a scale of value[1]'s dtype
        return ((x * torch.rsqrt(low + cfg.norm_eps)) * weight.to(value[1])).to(x.dtype).double()
    return run


def _feed_forward(ff: nn.Module, x: torch.Tensor) -> Callable:
    def run(mistake):
        h = x.double()
        if mistake is None:
            return ff(h)
        return ff.fc3(nn.functional.silu(ff.fc2(h)) * ff.fc1(h))  # gate_up_swapped
    return run


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Meta's original pairing, (x[0], x[1]), (x[2], x[3]), ..., with the same angles per pair."""
    hd = x.shape[-1]
    c, s = cos[..., : hd // 2].repeat_interleave(2, dim=-1), sin[..., : hd // 2].repeat_interleave(2, dim=-1)
    pairs = x.view(*x.shape[:-1], hd // 2, 2)
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * c + rotated * s


def _attention(att: nn.Module, x: torch.Tensor, cfg: FamilyConfig, t: int) -> Callable:
    def tables(base: float, scaled: bool):
        cos, sin = compute_rope_params(cfg.head_dim_value, base, t, cfg.rope_freq if scaled else None)
        return cos.double().to(x.device), sin.double().to(x.device)

    def run(mistake):
        name, value = mistake or (None, None)
        h = x.double()
        b = h.shape[0]
        cos, sin = tables(value if name == "rope_base" else cfg.rope_base, name != "no_freq_scaling")
        q = att.W_query(h).view(b, t, att.num_heads, att.head_dim).transpose(1, 2)
        k = att.W_key(h).view(b, t, att.num_kv_groups, att.head_dim).transpose(1, 2)
        v = att.W_value(h).view(b, t, att.num_kv_groups, att.head_dim).transpose(1, 2)
        norm_first = att.q_norm is not None and name not in ("no_qk_norm", "qk_norm_after_rope")
        if norm_first:
            q, k = att.q_norm(q), att.k_norm(k)
        rope = _rope_interleaved if name == "rope_interleaved" else apply_rope
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if name == "rope_on_values":
            v = rope(v, cos, sin)
        if name == "qk_norm_after_rope":
            q, k = att.q_norm(q), att.k_norm(k)
        if name == "repeat":
            k, v = k.repeat(1, att.group_size, 1, 1), v.repeat(1, att.group_size, 1, 1)
        else:
            k, v = k.repeat_interleave(att.group_size, dim=1), v.repeat_interleave(att.group_size, dim=1)
        context = (attention_weights(q, k) @ v).transpose(1, 2).reshape(b, t, att.d_out)
        return att.out_proj(context)
    return run


def _candidates(kind: str, got: torch.Tensor):
    """(name, value) of every known mistake of this stage's kind."""
    for name, (stage_kind, _) in MISTAKES.items():
        if stage_kind != kind:
            continue
        if name == "rope_base":
            yield from ((name, base) for base in ROPE_BASES)
        elif name == "norm_eps":
            yield from ((name, eps) for eps in EPSILONS)
        elif name == "norm_low_precision":
            if got.dtype != torch.float32:  # the scale kept in float32 (the book's RMSNorm) or in x's dtype
                yield from ((name, (str(got.dtype).removeprefix("torch."), w)) for w in (torch.float32, got.dtype))
        else:
            yield name, None


def _likely_mistake(kind: str, got: torch.Tensor, book_fn, tol: float):
    best, best_diff = None, math.inf
    for candidate in _candidates(kind, got):
        try:
            want = book_fn(candidate)
        except (RuntimeError, TypeError):  # a mistake this model cannot make (no QK-norm to move)
            continue
        if want.shape != got.shape or torch.equal(want, book_fn(None)):
            continue  # the same numbers as the right formula: not what the reader did
        diff = float((got.double() - want).abs().max())
        if diff < best_diff:
            best, best_diff = candidate, diff
    return best if best_diff <= tol else None


def _finding(stages: list[StageCheck], first: StageCheck | None, mistake, cfg: FamilyConfig) -> str:
    if first is None:
        worst = max(stages, key=lambda s: s.max_diff / s.tolerance)
        return (f"matches glassgpt's Qwen3/Llama formulas at every stage (largest difference {worst.max_diff:.2g}, "
                f"at {worst.name})")
    at = (f"{first.name} is the first stage that differs (largest difference {first.max_diff:.3g} at "
          f"{_where_text(first.where)})")
    if mistake is None:
        return f"{at}; no known mistake reproduces it: compare your {first.name.split('.')[-1]} line by line with the book's."
    name, value = mistake
    want = cfg.rope_base if name == "rope_base" else cfg.norm_eps
    dtype = value[0] if name == "norm_low_precision" else None
    return f"{at}: " + MISTAKES[name][1].format(base=value or 0, eps=value or 0, dtype=dtype, want=want) + "."


def _tie_note(model: nn.Module) -> list[str]:
    emb, head = model.tok_emb.weight, model.out_head.weight
    if emb.data_ptr() != head.data_ptr() and emb.shape == head.shape and torch.equal(emb, head):
        return ["out_head.weight holds the same numbers as tok_emb.weight but is a copy, not the same tensor (its "
                "data_ptr differs): training will move them apart; to tie them, assign "
                "model.out_head.weight = model.tok_emb.weight"]
    return []
