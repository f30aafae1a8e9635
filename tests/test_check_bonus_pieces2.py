"""glassgpt.check on Qwen3.5's gated full attention and Gemma 4's attention (the book's ch05/16_qwen3.5 and
17_gemma4 notebooks), and on the two notebooks' compute_rope_params: each written here as the notebook writes it
comes out equal to glassgpt's formula; each planted mistake is named by the property it breaks, at its first
position, and by the catalogue's line where one reproduces it. PLANTED_OUTSIDE_CATALOGUE marks the plants no
catalogue entry reproduces. Tolerances: float32 pieces against float64 formulas within report.RTOL = 1e-5 of the
largest output; "values normed" allows qwen3_5_gemma4.NORMED_RTOL = 1e-3; "one token everywhere gives equal
scores" allows qwen3_5_gemma4.EVEN = 1e-5 of the largest score.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import glassgpt
from glassgpt.explain.pieces import build
from glassgpt.explain.pieces.qwen3_5_gemma4 import GEMMA4_TINY

from helpers import assert_planted_piece


def named(cls: type, name: str) -> type:
    return type(name, (cls,), {})


# --- Qwen3.5, as the notebook writes it ----------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Qwen3.5's: (1 + weight), the weight starting at zero."""

    def __init__(self, emb_dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        x_f = x.float()
        x_norm = x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x_norm * (1.0 + self.weight.float())).to(x.dtype)


class PlainRMSNorm(RMSNorm):
    """Qwen3's: a plain weight starting at one."""

    def __init__(self, emb_dim, eps=1e-6):
        super().__init__(emb_dim, eps)
        self.weight = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x):
        x_f = x.float()
        return (x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def compute_rope_params(head_dim, theta_base=10_000, context_length=4096, partial_rotary_factor=1.0,
                        dtype=torch.float32):
    rotary_dim = int(head_dim * partial_rotary_factor)
    rotary_dim = max(2, rotary_dim - (rotary_dim % 2))
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, rotary_dim, 2, dtype=dtype)[: rotary_dim // 2].float()
                                     / rotary_dim))
    angles = torch.arange(context_length, dtype=dtype).unsqueeze(1) * inv_freq.unsqueeze(0)
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    seq_len, head_dim = x.shape[2], x.shape[-1]
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot[..., : rot_dim // 2], x_rot[..., rot_dim // 2:]
    cos, sin = cos[:seq_len, :][None, None], sin[:seq_len, :][None, None]
    x_rotated = (x_rot * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    return torch.cat([x_rotated, x_pass], dim=-1).to(dtype=x.dtype)


class GroupedQueryAttention(nn.Module):
    """Qwen3.5's full attention: a gated Q projection (2x wide), (1 + w) QK-norm, partial RoPE."""
    norm = RMSNorm

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, dtype=None):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = head_dim or d_in // num_heads
        self.d_out = num_heads * self.head_dim
        self.W_query = nn.Linear(d_in, self.d_out * 2, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        self.q_norm = self.norm(self.head_dim) if qk_norm else None
        self.k_norm = self.norm(self.head_dim) if qk_norm else None

    def rope(self, x, cos, sin):
        return apply_rope(x, cos, sin)

    def gated(self, context, gate):
        return context * torch.sigmoid(gate)

    def split(self, q_and_gate):
        b, t, _ = q_and_gate.shape
        queries, gate = torch.chunk(q_and_gate.view(b, t, self.num_heads, self.head_dim * 2), 2, dim=-1)
        return queries, gate.reshape(b, t, self.d_out)

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        queries, gate = self.split(self.W_query(x))
        queries = queries.transpose(1, 2)
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.q_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = self.rope(queries, cos, sin), self.rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores * (self.head_dim ** -0.5), dim=-1, dtype=torch.float32)
        context = (attn_weights.to(queries.dtype) @ values).transpose(1, 2).reshape(b, t, self.d_out)
        return self.out_proj(self.gated(context, gate))


class NoGate(GroupedQueryAttention):
    def gated(self, context, gate):
        return context  # planted: the output gate left out


class GateNoSigmoid(GroupedQueryAttention):
    def gated(self, context, gate):
        return context * gate  # planted: the gate without its sigmoid


class WholeHeadRope(GroupedQueryAttention):
    def rope(self, x, cos, sin):  # planted: Qwen3's apply_rope, which turns the whole head
        t, hd = x.shape[2], x.shape[-1]
        rotated = torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)
        return (x * cos[:t] + rotated * sin[:t]).to(x.dtype)


class LastDimsRope(GroupedQueryAttention):
    def rope(self, x, cos, sin):  # planted: the last rot_dim dimensions turned, the first passed through
        rot = cos.shape[-1]
        turned = apply_rope(x[..., -rot:], cos, sin)
        return torch.cat([x[..., :-rot], turned], dim=-1)


class SplitBeforeHeads(GroupedQueryAttention):
    def split(self, q_and_gate):  # planted: all queries, then all gates (the notebook splits each head's 2 * hd)
        b, t, _ = q_and_gate.shape
        queries, gate = torch.chunk(q_and_gate, 2, dim=-1)
        return queries.reshape(b, t, self.num_heads, self.head_dim), gate


class NoRope(GroupedQueryAttention):
    def rope(self, x, cos, sin):
        return x  # planted: RoPE left out


class PlainQKNorm(GroupedQueryAttention):
    norm = PlainRMSNorm  # planted: Qwen3's QK-norm, weight * x / rms(x)


def compute_rope_params_whole(head_dim, theta_base=10_000, context_length=4096, partial_rotary_factor=1.0,
                              dtype=torch.float32):
    return compute_rope_params(head_dim, theta_base, context_length, 1.0, dtype)  # planted: the factor ignored


# --- Gemma 4, as the notebook writes it ----------------------------------------------------------------------

def gemma4_compute_rope_params(head_dim, theta_base=10_000.0, context_length=4096, rope_type="default",
                               partial_rotary_factor=1.0, dtype=torch.float32):
    if rope_type == "proportional":
        rope_angles = int(partial_rotary_factor * head_dim // 2)
        inv_freq_rotated = 1.0 / (theta_base ** (torch.arange(0, 2 * rope_angles, 2, dtype=torch.float32)
                                                 / head_dim))
        nope_angles = head_dim // 2 - rope_angles
        inv_freq = torch.cat([inv_freq_rotated, torch.zeros(nope_angles)]) if nope_angles > 0 else inv_freq_rotated
    else:
        inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.arange(context_length, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


def gemma4_rope_params_default_only(head_dim, theta_base=10_000.0, context_length=4096, rope_type="default",
                                    partial_rotary_factor=1.0, dtype=torch.float32):
    return gemma4_compute_rope_params(head_dim, theta_base, context_length)  # planted: "proportional" ignored


def gemma4_rope_params_turned_width(head_dim, theta_base=10_000.0, context_length=4096, rope_type="default",
                                    partial_rotary_factor=1.0, dtype=torch.float32):
    """Planted: the frequencies over the turned width, and no zeros for the pairs past it."""
    rot = int(partial_rotary_factor * head_dim) if rope_type == "proportional" else head_dim
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / rot))
    angles = torch.arange(context_length, dtype=torch.float32).unsqueeze(1) * inv_freq.unsqueeze(0)
    angles = torch.cat([angles, angles], dim=1)
    return torch.cos(angles), torch.sin(angles)


def gemma4_apply_rope(x, cos, sin):
    seq_len, head_dim = x.shape[2], x.shape[-1]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    cos, sin = cos[:seq_len, :][None, None], sin[:seq_len, :][None, None]
    return ((x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)).to(dtype=x.dtype)


class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, with_scale=True):
        super().__init__()
        self.eps, self.with_scale = eps, with_scale
        if with_scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_float = x.float()
        x_norm = x_float * torch.pow(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps, -0.5)
        if self.with_scale:
            x_norm = x_norm * self.weight.float()
        return x_norm.to(dtype=x.dtype)


class Gemma4Attention(nn.Module):
    v_scale = False  # the value norm: Gemma4RMSNorm(..., with_scale=False)

    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_type = cfg["layer_types"][layer_idx]
        self.is_sliding = self.layer_type == "sliding_attention"
        self.head_dim = cfg["head_dim"] if self.is_sliding else cfg["global_head_dim"]
        self.num_heads, self.num_kv_heads = cfg["n_heads"], cfg["n_kv_heads"]
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.q_proj = nn.Linear(cfg["emb_dim"], self.num_heads * self.head_dim, bias=False, dtype=cfg["dtype"])
        self.k_proj = nn.Linear(cfg["emb_dim"], self.num_kv_heads * self.head_dim, bias=False, dtype=cfg["dtype"])
        self.v_proj = nn.Linear(cfg["emb_dim"], self.num_kv_heads * self.head_dim, bias=False, dtype=cfg["dtype"])
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg["emb_dim"], bias=False, dtype=cfg["dtype"])
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps=cfg["layer_norm_eps"])
        self.k_norm = Gemma4RMSNorm(self.head_dim, eps=cfg["layer_norm_eps"])
        self.v_norm = Gemma4RMSNorm(self.head_dim, eps=cfg["layer_norm_eps"], with_scale=self.v_scale)

    def values(self, value):
        return self.v_norm(value)

    def turn_keys(self, key, cos, sin):
        return gemma4_apply_rope(key, cos, sin)

    def scores(self, query, key):
        return query @ key.transpose(-1, -2)

    def forward(self, x, mask, cos, sin, shared_kv=None, return_kv=False):
        b, t, _ = x.shape
        query = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        query = gemma4_apply_rope(self.q_norm(query), cos, sin)
        key = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        key, value = self.turn_keys(self.k_norm(key), cos, sin), self.values(value)
        key = key.repeat_interleave(self.num_key_value_groups, dim=1)
        value = value.repeat_interleave(self.num_key_value_groups, dim=1)
        attn_scores = self.scores(query, key)
        attn_scores = attn_scores.masked_fill(mask.unsqueeze(0).unsqueeze(0), torch.finfo(attn_scores.dtype).min)
        attn_weights = torch.softmax(attn_scores.float(), dim=-1).to(dtype=query.dtype)
        context = (attn_weights @ value).transpose(1, 2).contiguous().view(b, t, self.num_heads * self.head_dim)
        return self.o_proj(context), None


class Gemma4VNormWeight(Gemma4Attention):
    v_scale = True  # planted: the value norm with a weight


class Gemma4NoVNorm(Gemma4Attention):
    def values(self, value):
        return value  # planted: no value norm


class Gemma4ScaledScores(Gemma4Attention):
    def scores(self, query, key):
        return (query @ key.transpose(-1, -2)) * self.head_dim ** -0.5  # planted: scaled as in Gemma 3


class Gemma4KeysUnturned(Gemma4Attention):
    def turn_keys(self, key, cos, sin):
        return key  # planted: RoPE on the queries only


class Gemma4SlidingWithoutRope(Gemma4Attention):
    def forward(self, x, mask, cos, sin, shared_kv=None, return_kv=False):  # planted: no RoPE in sliding layers
        if self.is_sliding:
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        return super().forward(x, mask, cos, sin)


class Gemma4WithoutVNorm(Gemma4Attention):
    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        del self.v_norm  # planted: no value norm at all

    def values(self, value):
        return value


class Gemma4NormPlusOne(Gemma4RMSNorm):
    def forward(self, x):  # planted: Gemma 3's (1 + weight)
        x_float = x.float()
        x_norm = x_float * torch.pow(x_float.pow(2).mean(dim=-1, keepdim=True) + self.eps, -0.5)
        return (x_norm * (1.0 + self.weight.float())).to(x.dtype)


class Gemma4NormEpsOutside(Gemma4RMSNorm):
    def forward(self, x):  # planted: eps outside the root
        x_float = x.float()
        x_norm = x_float / (x_float.pow(2).mean(dim=-1, keepdim=True).sqrt() + self.eps)
        return (x_norm * self.weight.float() if self.with_scale else x_norm).to(x.dtype)


class Gemma4FeedForward(nn.Module):
    act = staticmethod(lambda h: nn.functional.gelu(h, approximate="tanh"))

    def __init__(self, cfg, layer_idx):
        super().__init__()
        first_kv_shared_layer_idx = cfg["n_layers"] - cfg["num_kv_shared_layers"]
        is_kv_shared_layer = layer_idx >= first_kv_shared_layer_idx > 0
        intermediate_size = cfg["hidden_dim"] * (2 if cfg["use_double_wide_mlp"] and is_kv_shared_layer else 1)
        self.gate_proj = nn.Linear(cfg["emb_dim"], intermediate_size, bias=False, dtype=cfg["dtype"])
        self.up_proj = nn.Linear(cfg["emb_dim"], intermediate_size, bias=False, dtype=cfg["dtype"])
        self.down_proj = nn.Linear(intermediate_size, cfg["emb_dim"], bias=False, dtype=cfg["dtype"])

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4FeedForwardSiLU(Gemma4FeedForward):
    act = staticmethod(nn.functional.silu)  # planted: SwiGLU's activation


class Gemma4FeedForwardGeluOnUp(Gemma4FeedForward):
    def forward(self, x):  # planted: GELU on the up projection
        return self.down_proj(self.gate_proj(x) * self.act(self.up_proj(x)))


def _with_weights(att: nn.Module) -> nn.Module:
    """Norm weights of their own (the notebooks build them at 0 or 1): a plain and a (1 + w) norm differ more."""
    for norm in (att.q_norm, att.k_norm):
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.2, 0.6, norm.weight.numel()))
    return att


CORRECT = {
    "qwen3_5_attention_class": (lambda: glassgpt.check(GroupedQueryAttention, args="qwen3_5"),
                                "Qwen3.5 GroupedQueryAttention"),
    "qwen3_5_attention_own_norm_weights": (lambda: glassgpt.check(_with_weights(build(GroupedQueryAttention,
                                                                                      "qwen3_5"))),
                                           "Qwen3.5 GroupedQueryAttention"),
    "qwen3_5_attention_no_args": (lambda: glassgpt.check(GroupedQueryAttention), "Qwen3.5 GroupedQueryAttention"),
    "gemma4_attention_full_layer": (lambda: glassgpt.check(Gemma4Attention), "Gemma 4 Attention"),
    "gemma4_attention_sliding_layer": (lambda: glassgpt.check(Gemma4Attention(GEMMA4_TINY, 0)), "Gemma 4 Attention"),
    "gemma4_rms_norm": (lambda: glassgpt.check(Gemma4RMSNorm), "Gemma4RMSNorm"),
    "gemma4_value_norm": (lambda: glassgpt.check(Gemma4RMSNorm(16, with_scale=False)), "Gemma4RMSNorm"),
    "gemma4_feed_forward": (lambda: glassgpt.check(Gemma4FeedForward), "Gemma4FeedForward (GeGLU)"),
    "qwen3_5_compute_rope_params": (lambda: glassgpt.check(compute_rope_params), "compute_rope_params (partial)"),
    "gemma4_compute_rope_params": (lambda: glassgpt.check(named_fn(gemma4_compute_rope_params)),
                                   "compute_rope_params (proportional)"),
}


def named_fn(fn):
    fn.__name__ = "compute_rope_params"
    return fn


@pytest.mark.parametrize("case", sorted(CORRECT))
def test_each_notebook_piece_equals_glassgpts_formula(case):
    run, kind = CORRECT[case]
    result = run()
    assert result.ok and result.kind == kind, result.to_text()


def _gemma4(cls: type, layer: int = 1) -> nn.Module:
    torch.manual_seed(123)
    return cls(GEMMA4_TINY, layer)


# (run, stage, where, property, catalogue key or None)
PLANTED = {
    "qwen3_5_no_gate": (lambda: glassgpt.check(named(NoGate, "GroupedQueryAttention"), args="qwen3_5"),
                        "out_proj input", "position 0", "output_gate", "gate_missing"),
    "qwen3_5_gate_no_sigmoid": (lambda: glassgpt.check(named(GateNoSigmoid, "GroupedQueryAttention"),
                                                       args="qwen3_5"),
                                "out_proj input", "position 0", "output_gate", "gate_no_sigmoid"),
    "qwen3_5_rope_whole_head": (lambda: glassgpt.check(named(WholeHeadRope, "GroupedQueryAttention"),
                                                       args="qwen3_5"),
                                "RoPE", "every head", "rope_span", "rope_whole_head"),
    "qwen3_5_rope_last_dims": (lambda: glassgpt.check(named(LastDimsRope, "GroupedQueryAttention"), args="qwen3_5"),
                               "attention weights", "row 1 of head 0", "rope_span", None),
    "qwen3_5_no_rope": (lambda: glassgpt.check(named(NoRope, "GroupedQueryAttention"), args="qwen3_5"),
                        "attention weights", "every row", "rope_span", None),
    "qwen3_5_plain_qk_norm": (lambda: glassgpt.check(named(PlainQKNorm, "GroupedQueryAttention"), args="qwen3_5"),
                              "q_norm", "row 0", "scale_plus_one", None),
    "qwen3_5_rope_params_whole_head": (lambda: glassgpt.check(named_fn(compute_rope_params_whole)), "shape",
                                       "its shape", "rope_span", "partial_ignored"),
    "gemma4_v_norm_weight": (lambda: glassgpt.check(_gemma4(Gemma4VNormWeight)), "v_norm", "every value",
                             "value_norm_weight", "v_norm_weight"),
    "gemma4_no_v_norm": (lambda: glassgpt.check(_gemma4(Gemma4NoVNorm)), "v_norm", "position 0", "values_normed",
                         "v_norm_missing"),
    "gemma4_without_v_norm": (lambda: glassgpt.check(named(Gemma4WithoutVNorm, "Gemma4Attention")), "v_norm",
                              "position 0", "values_normed", "v_norm_missing"),
    "gemma4_sliding_without_rope": (lambda: glassgpt.check(named(Gemma4SlidingWithoutRope, "Gemma4Attention")),
                                    "attention weights", "every row", "rope_span", None),
    "gemma4_scaled_scores": (lambda: glassgpt.check(_gemma4(Gemma4ScaledScores)), "attention weights", "every row",
                             "scale", "scale_head_dim"),
    "gemma4_keys_unturned": (lambda: glassgpt.check(_gemma4(Gemma4KeysUnturned)), "attention weights",
                             "every row", "rope_span", None),
    "gemma4_norm_plus_one": (lambda: glassgpt.check(named(Gemma4NormPlusOne, "Gemma4RMSNorm")), "output", "row 0",
                             "scale_plus_one", None),
    "gemma4_value_norm_eps_outside": (lambda: glassgpt.check(named(Gemma4NormEpsOutside, "Gemma4RMSNorm")(
        16, with_scale=False)), "output", "row 2", "eps", None),
    "gemma4_feed_forward_silu": (lambda: glassgpt.check(named(Gemma4FeedForwardSiLU, "Gemma4FeedForward")),
                                 "output", "position 0", "activation", None),
    "gemma4_feed_forward_gelu_on_up": (lambda: glassgpt.check(named(Gemma4FeedForwardGeluOnUp,
                                                                    "Gemma4FeedForward")),
                                       "output", "position 0", "gate", None),
    "gemma4_rope_params_default_only": (lambda: glassgpt.check(named_fn(gemma4_rope_params_default_only)), "output",
                                        "dimension 2", "rope_span", "proportional_ignored"),
    "gemma4_rope_params_turned_width": (lambda: glassgpt.check(named_fn(gemma4_rope_params_turned_width)), "output",
                                        "dimension 2", "rope_span", None),
}
# The plants no catalogue entry reproduces: their property alone names them.
PLANTED_OUTSIDE_CATALOGUE = {"qwen3_5_rope_last_dims", "qwen3_5_no_rope", "qwen3_5_plain_qk_norm",
                             "gemma4_sliding_without_rope", "gemma4_keys_unturned", "gemma4_norm_plus_one",
                             "gemma4_value_norm_eps_outside", "gemma4_feed_forward_silu",
                             "gemma4_feed_forward_gelu_on_up",
                             "gemma4_rope_params_turned_width"}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_each_planted_mistake_is_named_by_its_property_at_its_first_position(case):
    assert_planted_piece(PLANTED, PLANTED_OUTSIDE_CATALOGUE, case)


def test_a_missing_gate_and_a_gate_without_sigmoid_are_told_apart():
    assert "every factor 1: no gate multiplies it" in PLANTED["qwen3_5_no_gate"][0]().finding
    finding = PLANTED["qwen3_5_gate_no_sigmoid"][0]().finding
    assert "factors outside (0, 1)" in finding and "multiplied by the gate itself" in finding


def test_rope_over_the_whole_head_names_the_partial_width():
    finding = PLANTED["qwen3_5_rope_whole_head"][0]().finding
    assert "fed Qwen3.5's RoPE tables, 4 wide (partial_rotary_factor 0.25 of head_dim 16)" in finding
    assert "fed tables 16 wide it runs and equals the formula with RoPE over all 16 dimensions" in finding
    assert "the scores read no position from them" in PLANTED["qwen3_5_no_rope"][0]().finding


def test_gemma4s_value_norm_with_a_weight_and_without_are_told_apart():
    assert "v_norm holds a weight of 16 numbers" in PLANTED["gemma4_v_norm_weight"][0]().finding
    finding = PLANTED["gemma4_no_v_norm"][0]().finding
    assert "with v_proj's weight 4 times larger the output changes" in finding and "not RMS-normed" in finding



def test_a_gemma4_class_is_checked_at_a_full_and_a_sliding_layer():
    result = glassgpt.check(Gemma4Attention)
    assert result.ok and "layer 0 (sliding_attention, window 3, RoPE over the whole head): matches too" in \
        result.lines, result.to_text()
    finding = PLANTED["gemma4_sliding_without_rope"][0]().finding
    assert finding.startswith("layer 0 (sliding_attention): ") and "the scores read no position from them" in finding


def test_queries_and_gates_split_before_the_heads_are_not_blamed_on_rope():
    """Zeroing rows of W_query tests RoPE only where, fed tables that turn nothing, the piece equals the formula:
    a piece that takes its queries from other rows is not told that RoPE turns the wrong dimensions."""
    result = glassgpt.check(named(SplitBeforeHeads, "GroupedQueryAttention"), args="qwen3_5")
    assert not result.ok and result.prop != "rope_span", result.to_text()
    assert "RoPE turns dimensions" not in result.finding


def test_the_cli_checks_a_gemma4_attention_file(tmp_path, capsys):
    import inspect
    from glassgpt.cli import main
    body = "import torch\nfrom torch import nn\n\n\n" + "\n\n".join(
        inspect.getsource(f) for f in (gemma4_apply_rope, Gemma4RMSNorm, Gemma4Attention))
    (tmp_path / "good.py").write_text(body)
    (tmp_path / "bad.py").write_text(body.replace("return self.v_norm(value)", "return value"))
    assert main(["check", f"{tmp_path / 'good.py'}:Gemma4Attention"]) == 0
    assert "Gemma 4 Attention matches glassgpt's formula" in capsys.readouterr().out
    assert main(["check", f"{tmp_path / 'bad.py'}:Gemma4Attention"]) == 1
    assert "the values are not RMS-normed" in capsys.readouterr().out


def test_the_cli_checks_a_qwen3_5_attention_file_without_args(tmp_path, capsys):
    """The model class beside it in its file (Qwen3_5Model) says whose; the doubled W_query says which kind."""
    import inspect
    from glassgpt.cli import main
    body = "import torch\nfrom torch import nn\n\n\n" + "\n\n".join(
        inspect.getsource(f) for f in (RMSNorm, apply_rope, GroupedQueryAttention)) + \
        "\n\nclass Qwen3_5Model(nn.Module):\n    pass\n"
    (tmp_path / "good.py").write_text(body)
    (tmp_path / "bad.py").write_text(body.replace("return context * torch.sigmoid(gate)", "return context"))
    assert main(["check", f"{tmp_path / 'good.py'}:GroupedQueryAttention"]) == 0
    assert "Qwen3.5 GroupedQueryAttention matches glassgpt's formula" in capsys.readouterr().out
    assert main(["check", f"{tmp_path / 'bad.py'}:GroupedQueryAttention"]) == 1
    assert "no gate multiplies it" in capsys.readouterr().out
