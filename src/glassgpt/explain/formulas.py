"""The formulas a model's description states, computed from the description alone: RoPE's tables and turn,
and the attention weights (the scale, a softcap, the causal edge and a window).

verify.py checks a module stage by stage against these; trace.py computes every head's weights with them
from the tensors the taps recorded (and checks them against what the module's own attention gave out_proj).
None of them knows a model's name: each reads an `anatomy.Rope` or `anatomy.Attention`. Shape letters as
model.py's: b, h (query heads), t (queries), s (positions seen), hd.
"""

from __future__ import annotations

import math

import torch

from .. import anatomy as an


def rope_tables(rope: an.Rope, t: int, base: float | None = None, scaled: bool = True,
                pairs: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[t, rotary_dim]` in float64: pair i turns at base^(-2i/rotary_dim), Llama 3's or YaRN's
    scaling as described; each angle written for both dimensions of its pair (halves, or neighbours).
    "proportional" (Gemma 4's full layers): `[t, head_dim]`, pair i of all hd/2 at base^(-2i/hd), the pairs from
    rotary_dim/2 on still (angle 0)."""
    rd = rope.rotary_dim or rope.head_dim
    if rope.scaling == "proportional":
        inv_freq = 1.0 / ((base or rope.base) ** (torch.arange(0, rope.head_dim, 2, dtype=torch.float64) / rope.head_dim))
        inv_freq[rd // 2:] = 0.0  # [hd/2]
    else:
        inv_freq = 1.0 / ((base or rope.base) ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))  # [rd/2]
    values, factor = dict(rope.scaling_values), 1.0
    if scaled and rope.scaling == "llama3":
        inv_freq = llama3_frequencies(inv_freq, values)
    elif scaled and rope.scaling == "yarn":
        inv_freq, factor = yarn_frequencies(inv_freq, values, rd, base or rope.base), values["rope_attention_factor"]
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]  # [t, rd/2]
    halves = (pairs or rope.pairs) == "halves"
    angles = torch.cat([angles, angles], dim=1) if halves else angles.repeat_interleave(2, dim=1)
    return torch.cos(angles) * factor, torch.sin(angles) * factor


def llama3_frequencies(inv_freq: torch.Tensor, v: dict) -> torch.Tensor:
    """Llama 3's: the slow pairs / factor, the fast kept, a blend between."""
    low_wavelen = v["original_context_length"] / v["low_freq_factor"]
    high_wavelen = v["original_context_length"] / v["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / v["factor"], inv_freq)
    smooth = (v["original_context_length"] / wavelen - v["low_freq_factor"]) / (v["high_freq_factor"] - v["low_freq_factor"])
    blended = (1 - smooth) * inv_freq / v["factor"] + smooth * inv_freq
    return torch.where((wavelen <= low_wavelen) & (wavelen >= high_wavelen), blended, scaled)


def yarn_frequencies(inv_freq: torch.Tensor, v: dict, rd: int, base: float) -> torch.Tensor:
    """YaRN's: pairs turning more than beta_fast times in rope_orig_max positions kept, fewer than beta_slow
    divided by rope_factor, a linear ramp between."""
    def pair_turning(turns: float) -> float:
        return rd * math.log(v["rope_orig_max"] / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(v["beta_fast"])), 0)
    high = min(math.ceil(pair_turning(v["beta_slow"])), rd - 1)
    keep = 1 - ((torch.arange(rd // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    return inv_freq / v["rope_factor"] * (1 - keep) + inv_freq * keep


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: str) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dimensions of each head `[b, h, t, hd]`; the rest pass as they are."""
    rd = cos.shape[-1]
    turned, rest = x[..., :rd], x[..., rd:]
    if pairs == "halves":
        rotated = torch.cat((-turned[..., rd // 2:], turned[..., : rd // 2]), dim=-1)
    else:
        rotated = torch.stack((-turned[..., 1::2], turned[..., ::2]), dim=-1).flatten(-2)
    return torch.cat([turned * cos + rotated * sin, rest], dim=-1)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Meta's original pairing, (x[0], x[1]), (x[2], x[3]), ..., with a halves table's angles per pair."""
    hd = x.shape[-1]
    c, s = cos[..., : hd // 2].repeat_interleave(2, dim=-1), sin[..., : hd // 2].repeat_interleave(2, dim=-1)
    return rotate(x, c, s, "neighbours")


def hidden(t: int, s: int, window: int | None, device: torch.device | str) -> torch.Tensor:
    """`[t, s]`, True where query j (at position s - t + j) may not look: the future, and with a `window` every
    position `window` or more back."""
    query = torch.arange(s - t, s, device=device)[:, None]
    key = torch.arange(s, device=device)[None, :]
    out = key > query
    return out | (query - key >= window) if window is not None else out


def attention_weights(att: an.Attention, q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                      windowed: bool = True, masked: bool = True) -> torch.Tensor:
    """softmax(q @ k.T * scale), softcapped as described, over the positions each query may see: `[b, h, t, hd]`
    (after QK-norm and RoPE) and `[b, h, s, hd]` (each query head's own keys, its group's repeated) ->
    `[b, h, t, s]`; the queries are the last t of the s positions. The scale, softcap and window are the
    description's (`att.scale`, else 1 / sqrt(hd)); `scale`, `windowed` and `masked` (False: no window, no mask at
    all) put something else in their place (verify.py's known mistakes)."""
    t, s, hd = q.shape[-2], k.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1)  # [b, h, t, hd] @ [b, h, hd, s] -> [b, h, t, s]
    scale = scale if scale is not None else att.scale
    scores = scores / math.sqrt(hd) if scale is None else scores * scale
    if att.softcap is not None:
        scores = torch.tanh(scores / att.softcap) * att.softcap
    if masked:
        scores = scores.masked_fill(hidden(t, s, att.window if windowed else None, q.device), -torch.inf)
    return scores.softmax(dim=-1)
