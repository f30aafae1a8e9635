"""glassgpt.check on the bonus models' own pieces (the book's ch05/12_gemma3, 13_olmo3, 15_tiny-aya and
16_qwen3.5 notebooks): each written here as the notebook writes it comes out equal to glassgpt's formula; each
planted mistake is named by the property it breaks, at its first position, and the catalogue's line where one
reproduces it. PLANTED_OUTSIDE_CATALOGUE marks the plants no catalogue entry reproduces (the property alone
names them). Tolerances: float32 pieces against float64 formulas within report.RTOL = 1e-5 of the largest
output; the gated delta rule against glassgpt's float32 one within bonus_models.DELTA_RTOL = 1e-4.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import glassgpt
from glassgpt.explain.pieces import PieceError, build
from glassgpt.explain.pieces.bonus_models import GEMMA3_TINY

from helpers import assert_planted_piece


# --- the notebooks' pieces, as they write them ------------------------------------------------------------

class RMSNorm(nn.Module):
    """Gemma 3's: zero-centred weight, (1 + weight), in float32."""

    def __init__(self, emb_dim, eps=1e-6, bias=False):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.zeros(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x):
        x_f = x.float()
        x_norm = x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        out = x_norm * (1.0 + self.scale.float())
        return out.to(x.dtype)


class OlmoRMSNorm(nn.Module):
    """OLMo 3's: a plain weight starting at one."""

    def __init__(self, emb_dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x):
        x_f = x.float()
        return (self.weight * x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)


class FeedForward(nn.Module):
    """Gemma 3's GeGLU."""

    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], dtype=cfg["dtype"], bias=False)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc1(x), approximate="tanh") * self.fc2(x))


def rope(x, cos, sin):
    t, hd = x.shape[2], x.shape[-1]
    rotated = torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)
    return (x * cos[:t] + rotated * sin[:t]).to(x.dtype)


class GroupedQueryAttention(nn.Module):
    """Gemma 3's: QK-norm per head, queries times query_pre_attn_scalar**-0.5, the mask given."""

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, query_pre_attn_scalar=None,
                 dtype=None):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = head_dim or d_in // num_heads
        self.d_out = num_heads * self.head_dim
        self.W_query = nn.Linear(d_in, self.d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.scaling = (query_pre_attn_scalar if query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def scores(self, queries, keys):
        return (queries * self.scaling) @ keys.transpose(2, 3)

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.q_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = rope(queries, cos, sin), rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = self.scores(queries, keys).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores, dim=-1)
        return self.out_proj((attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out))


class OlmoAttention(nn.Module):
    """OLMo 3's: QK-norm over the whole projection, before the split into heads."""

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim, attention_bias=False, dtype=None,
                 sliding_window=None, attn_type="full_attention"):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim, self.d_out = head_dim, num_heads * head_dim
        self.attn_type = attn_type
        self.sliding_window = sliding_window if attn_type == "sliding_attention" else None
        self.W_query = nn.Linear(d_in, self.d_out, bias=attention_bias, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * head_dim, bias=attention_bias, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * head_dim, bias=attention_bias, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=attention_bias, dtype=dtype)
        self.q_norm = OlmoRMSNorm(self.d_out)
        self.k_norm = OlmoRMSNorm(num_kv_groups * head_dim)

    def project(self, x):
        b, t, _ = x.shape
        queries, keys = self.q_norm(self.W_query(x)), self.k_norm(self.W_key(x))
        return (queries.view(b, t, self.num_heads, self.head_dim).transpose(1, 2),
                keys.view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2))

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        queries, keys = self.project(x)
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        queries, keys = rope(queries, cos, sin), rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = (queries * self.head_dim ** -0.5) @ keys.transpose(2, 3)
        attn_weights = torch.softmax(attn_scores.masked_fill(mask, -torch.inf), dim=-1)
        return self.out_proj((attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out))


class CohereLayerNorm(nn.Module):
    def __init__(self, emb_dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x):
        x32 = x.to(torch.float32)
        mean = x32.mean(dim=-1, keepdim=True)
        variance = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
        return (self.weight * (x32 - mean) * torch.rsqrt(variance + self.eps)).to(x.dtype)


class AyaAttention(nn.Module):
    """Tiny Aya's: QK-norm a CohereLayerNorm per head (optional), RoPE in sliding_attention layers only."""

    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, attention_bias=False,
                 dtype=None, attn_type="full_attention"):
        super().__init__()
        self.num_heads, self.num_kv_groups = num_heads, num_kv_groups
        self.group_size = num_heads // num_kv_groups
        self.head_dim = head_dim or d_in // num_heads
        self.d_out = num_heads * self.head_dim
        self.attn_type = attn_type
        self.W_query = nn.Linear(d_in, self.d_out, bias=attention_bias, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=attention_bias, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * self.head_dim, bias=attention_bias, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=attention_bias, dtype=dtype)
        self.q_norm = CohereLayerNorm(self.head_dim, eps=1e-6) if qk_norm else None
        self.k_norm = CohereLayerNorm(self.head_dim, eps=1e-6) if qk_norm else None

    def turns(self):
        return self.attn_type == "sliding_attention"

    def forward(self, x, mask, cos, sin):
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values = self.W_value(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        if self.q_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if self.turns():
            queries, keys = rope(queries, cos, sin), rope(keys, cos, sin)
        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)
        attn_scores = (queries @ keys.transpose(2, 3)).masked_fill(mask, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim ** 0.5, dim=-1)
        return self.out_proj((attn_weights @ values).transpose(1, 2).reshape(b, t, self.d_out))


class GatedRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate):
        h = hidden_states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h.to(hidden_states.dtype) * F.silu(gate.float())).to(hidden_states.dtype)


class Qwen3_5GatedDeltaNet(nn.Module):
    """Qwen3.5's linear attention with transformers' names (the notebook imports this class), its gated
    delta rule written token by token."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads, self.num_k_heads = config.linear_num_value_heads, config.linear_num_key_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.head_k_dim * self.num_k_heads, self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.layer_idx = layer_idx
        self.layer_norm_epsilon = config.rms_norm_eps
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, bias=False,
                                groups=self.conv_dim, padding=self.conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(0, 16)))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=self.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)

    def mix(self, mixed_qkv, seq_len):
        return F.silu(self.conv1d(mixed_qkv)[:, :, :seq_len])

    def decay(self, a):
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        mixed = self.mix(self.in_proj_qkv(hidden_states).transpose(1, 2), t).transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        g = self.decay(self.in_proj_a(hidden_states))
        rep = self.num_v_heads // self.num_k_heads
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * self.head_k_dim ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        state = torch.zeros(b, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        out = []
        for i in range(t):
            state = state * g[:, i].exp()[..., None, None]
            k_i = k[:, i]  # [b, hv, dk]
            delta = (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k_i)) * beta[:, i, :, None]
            state = state + torch.einsum("bhk,bhv->bhkv", k_i, delta)
            out.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i]))
        out = torch.stack(out, dim=1)  # [b, t, hv, dv]
        z = self.in_proj_z(hidden_states).reshape(b, t, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(out, z).reshape(b, t, self.value_dim))


# --- planted mistakes --------------------------------------------------------------------------------------

class RMSNormPlainWeight(RMSNorm):
    def forward(self, x):
        x_f = x.float()
        return (x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)  # planted


class RMSNormEpsOutside(RMSNorm):
    def forward(self, x):
        x_f = x.float()
        return (x_f / (x_f.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * (1 + self.scale)).to(x.dtype)  # planted


class RMSNormInInputDtype(RMSNorm):
    def forward(self, x):
        x_norm = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # planted: no x.float()
        return (x_norm * (1.0 + self.scale)).to(x.dtype)


class RMSNormNoEps(RMSNorm):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * (1 + self.scale)  # planted: no eps


class GeGLUExactGELU(FeedForward):
    def forward(self, x):
        return self.fc3(F.gelu(self.fc1(x)) * self.fc2(x))  # planted: the erf GELU


class GeGLUWithSiLU(FeedForward):
    def forward(self, x):
        return self.fc3(F.silu(self.fc1(x)) * self.fc2(x))  # planted: Qwen3's SwiGLU gate


class GemmaScaleHeadDim(GroupedQueryAttention):
    def scores(self, queries, keys):
        return (queries * self.head_dim ** -0.5) @ keys.transpose(2, 3)  # planted: query_pre_attn_scalar ignored


class GemmaPlainQKNorm(GroupedQueryAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.q_norm, self.k_norm = OlmoRMSNorm(self.head_dim), OlmoRMSNorm(self.head_dim)  # planted: Qwen3's norm


class GemmaMaskIgnored(GroupedQueryAttention):
    def forward(self, x, mask, cos, sin):
        return super().forward(x, torch.triu(torch.ones_like(mask), diagonal=1), cos, sin)  # planted: no window


class OlmoNormPerHead(OlmoAttention):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim, attention_bias=False, dtype=None,
                 sliding_window=None, attn_type="full_attention"):
        super().__init__(d_in, num_heads, num_kv_groups, head_dim, attention_bias, dtype, sliding_window, attn_type)
        self.q_norm, self.k_norm = OlmoRMSNorm(head_dim), OlmoRMSNorm(head_dim)  # planted: Qwen3's per head

    def project(self, x):
        b, t, _ = x.shape
        queries = self.W_query(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = self.W_key(x).view(b, t, self.num_kv_groups, self.head_dim).transpose(1, 2)
        return self.q_norm(queries), self.k_norm(keys)


class DeltaConvNotCausal(Qwen3_5GatedDeltaNet):
    def mix(self, mixed_qkv, seq_len):
        return F.silu(self.conv1d(mixed_qkv)[:, :, -seq_len:])  # planted: the last t outputs


class DeltaDecaySign(Qwen3_5GatedDeltaNet):
    def decay(self, a):
        return self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # planted: the sign


class AyaRopeEverywhere(AyaAttention):
    def turns(self):
        return True  # planted: RoPE in the full_attention layers too


class CohereNoMean(CohereLayerNorm):
    def forward(self, x):
        x32 = x.float()
        return (self.weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)  # planted


def named(cls: type, name: str) -> type:
    return type(name, (cls,), {})


GEMMA_ATT = "Gemma 3 GroupedQueryAttention"
OLMO_ATT = "OLMo 3 GroupedQueryAttention"
CORRECT = {
    "gemma3_rmsnorm": (lambda: glassgpt.check(RMSNorm), "RMSNorm (1 + weight)"),
    "gemma3_rmsnorm_trained_weight": (lambda: glassgpt.check(_with_weight(build(RMSNorm, "gemma3"))),
                                      "RMSNorm (1 + weight)"),
    "gemma3_geglu": (lambda: glassgpt.check(FeedForward, args="gemma3"), "GeGLU FeedForward"),
    "gemma3_geglu_by_config": (lambda: glassgpt.check(FeedForward, args=GEMMA3_TINY), "GeGLU FeedForward"),
    "gemma3_attention": (lambda: glassgpt.check(GroupedQueryAttention), GEMMA_ATT),
    "olmo3_attention": (lambda: glassgpt.check(named(OlmoAttention, "GroupedQueryAttention")), OLMO_ATT),
    "olmo3_sliding_attention": (lambda: glassgpt.check(OlmoAttention(32, 4, 2, 16, sliding_window=3,
                                                                     attn_type="sliding_attention")), OLMO_ATT),
    "tiny_aya_attention": (lambda: glassgpt.check(named(AyaAttention, "GroupedQueryAttention")),
                           "Tiny Aya GroupedQueryAttention"),
    "tiny_aya_sliding_attention": (lambda: glassgpt.check(AyaAttention(32, 4, 2, 8, qk_norm=True,
                                                                       attn_type="sliding_attention")),
                                   "Tiny Aya GroupedQueryAttention"),
    "qwen3_5_gated_delta_net": (lambda: glassgpt.check(Qwen3_5GatedDeltaNet, args="qwen3_5"), "GatedDeltaNet"),
    "tiny_aya_cohere_layer_norm": (lambda: glassgpt.check(CohereLayerNorm), "CohereLayerNorm"),
}


def _with_weight(norm: nn.Module) -> nn.Module:
    with torch.no_grad():
        norm.scale.copy_(torch.linspace(-0.5, 0.5, norm.scale.numel()))
    return norm


@pytest.mark.parametrize("case", sorted(CORRECT))
def test_each_notebook_piece_equals_glassgpts_formula(case):
    run, kind = CORRECT[case]
    result = run()
    assert result.ok and result.kind == kind, result.to_text()


# (run, stage, where, property, catalogue key or None)
PLANTED = {
    "gemma3_rmsnorm_plain_weight": (lambda: glassgpt.check(named(RMSNormPlainWeight, "RMSNorm")), "output", "row 0",
                                    "scale_plus_one", None),
    "gemma3_rmsnorm_eps_outside": (lambda: glassgpt.check(named(RMSNormEpsOutside, "RMSNorm")), "output", "row 2",
                                   "eps", None),
    "gemma3_rmsnorm_in_bfloat16": (lambda: glassgpt.check(named(RMSNormInInputDtype, "RMSNorm")), "output", "row 0",
                                   "precision", None),
    "gemma3_rmsnorm_no_eps": (lambda: glassgpt.check(named(RMSNormNoEps, "RMSNorm")), "output", "row 2", "eps", None),
    "gemma3_geglu_exact_gelu": (lambda: glassgpt.check(named(GeGLUExactGELU, "FeedForward"), args="gemma3"),
                                "output", "position 0", "activation", None),
    "gemma3_geglu_silu": (lambda: glassgpt.check(named(GeGLUWithSiLU, "FeedForward"), args="gemma3"), "output",
                          "position 0", "activation", None),
    "gemma3_geglu_width": (lambda: glassgpt.check(_narrow_geglu()), "shape",
                           "its width", "width", None),
    "gemma3_attention_scale_head_dim": (lambda: glassgpt.check(named(GemmaScaleHeadDim, "GroupedQueryAttention")),
                                        "attention weights", "every row", "scale", "scale_head_dim"),
    "gemma3_attention_plain_qk_norm": (lambda: glassgpt.check(named(GemmaPlainQKNorm, "GroupedQueryAttention")),
                                       "q_norm", "row 0", "scale_plus_one", None),
    "gemma3_attention_window_ignored": (lambda: glassgpt.check(named(GemmaMaskIgnored, "GroupedQueryAttention")),
                                        "attention weights", "row 3 of head 0", "window", None),
    "olmo3_attention_norm_per_head": (lambda: glassgpt.check(named(OlmoNormPerHead, "GroupedQueryAttention")),
                                      "q_norm", "every query", "qk_norm_span", None),
    "qwen3_5_conv_not_causal": (lambda: glassgpt.check(named(DeltaConvNotCausal, "Qwen3_5GatedDeltaNet"),
                                                       args="qwen3_5"), "output", "position 0", "causal",
                                "conv_not_causal"),
    "qwen3_5_decay_sign": (lambda: glassgpt.check(named(DeltaDecaySign, "Qwen3_5GatedDeltaNet"), args="qwen3_5"),
                           "output", "position 1", "decay", "decay_sign"),  # position 0 decays a zero state
    "tiny_aya_attention_rope_everywhere": (lambda: glassgpt.check(named(AyaRopeEverywhere, "GroupedQueryAttention")),
                                           "attention weights", "row 1 of head 0", "position_free",
                                           "rope_in_full_layer"),
    "tiny_aya_cohere_no_mean": (lambda: glassgpt.check(named(CohereNoMean, "CohereLayerNorm")), "output", "row 0",
                                "norm_mean", None),
}
# The plants no catalogue entry reproduces: their property alone names them.
PLANTED_OUTSIDE_CATALOGUE = {"gemma3_rmsnorm_plain_weight", "gemma3_rmsnorm_eps_outside", "gemma3_rmsnorm_no_eps",
                             "gemma3_rmsnorm_in_bfloat16",
                             "gemma3_geglu_exact_gelu",
                             "gemma3_geglu_silu", "gemma3_geglu_width", "gemma3_attention_plain_qk_norm",
                             "gemma3_attention_window_ignored",
                             "olmo3_attention_norm_per_head", "tiny_aya_cohere_no_mean"}


def _narrow_geglu() -> nn.Module:
    ff = build(FeedForward, GEMMA3_TINY)
    ff.fc1 = nn.Linear(32, 40, bias=False)  # planted: fc1 and fc2 narrower than hidden_dim 48
    ff.fc2 = nn.Linear(32, 40, bias=False)
    ff.fc3 = nn.Linear(40, 32, bias=False)
    return ff


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_each_planted_mistake_is_named_by_its_property_at_its_first_position(case):
    assert_planted_piece(PLANTED, PLANTED_OUTSIDE_CATALOGUE, case)


def test_a_plain_weight_is_told_to_scale_by_one_plus_weight():
    finding = PLANTED["gemma3_rmsnorm_plain_weight"][0]().finding
    assert "by the weight alone, not by (1 + weight)" in finding and "1.0 + self.scale" in finding


def test_eps_outside_the_root_and_no_eps_are_told_apart():
    assert "eps = 1e-06 is added outside the root" in PLANTED["gemma3_rmsnorm_eps_outside"][0]().finding
    assert "there is no eps" in PLANTED["gemma3_rmsnorm_no_eps"][0]().finding


def test_the_geglu_activation_is_named():
    assert "the exact GELU (erf, nn.GELU())" in PLANTED["gemma3_geglu_exact_gelu"][0]().finding
    assert "SiLU of fc1(x)" in PLANTED["gemma3_geglu_silu"][0]().finding
    assert "40 wide" in PLANTED["gemma3_geglu_width"][0]().finding


def test_gemmas_scale_is_fitted_and_named_against_query_pre_attn_scalar():
    finding = PLANTED["gemma3_attention_scale_head_dim"][0]().finding
    assert "scaled by 1/sqrt(head_dim) = 1/sqrt(16)" in finding
    assert f"query_pre_attn_scalar**-0.5 = 1/sqrt(24) = {24 ** -0.5:.4g}" in finding


def test_the_window_is_named_with_its_edge():
    finding = PLANTED["gemma3_attention_window_ignored"][0]().finding
    assert "outside its window of 3" in finding and "position 0" in finding  # row 3 reads position 0


def test_olmos_per_head_norm_says_per_head_against_the_whole_projection():
    finding = PLANTED["olmo3_attention_norm_per_head"][0]().finding
    assert "16 numbers at a time (its input is [2, 4, 6, 16], split into heads): per head" in finding
    assert "whole projection, all num_heads * head_dim = 64 numbers" in finding


def test_the_delta_net_is_causal_and_its_leak_is_named():
    result = PLANTED["qwen3_5_conv_not_causal"][0]()
    assert "position 0's output changes when only the inputs after position 0 change" in result.finding
    assert "causal: no output" in "\n".join(CORRECT["qwen3_5_gated_delta_net"][0]().lines)


# --- kind detection -----------------------------------------------------------------------------------------

def test_the_qwen3_pieces_keep_their_kinds():
    import llms_from_scratch.qwen3 as book_qwen
    assert glassgpt.check(book_qwen.RMSNorm).kind == "RMSNorm"
    assert glassgpt.check(book_qwen.FeedForward).kind == "SwiGLU FeedForward"
    assert glassgpt.check(book_qwen.GroupedQueryAttention).kind == "GroupedQueryAttention"


def test_a_gemma_piece_is_told_by_the_model_class_beside_it(tmp_path):
    from glassgpt.cli.check import load_class
    (tmp_path / "my_gemma.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class FeedForward(nn.Module):\n"
        "    def __init__(self, cfg):\n        super().__init__()\n"
        "        self.fc1 = nn.Linear(cfg['emb_dim'], cfg['hidden_dim'], bias=False)\n"
        "        self.fc2 = nn.Linear(cfg['emb_dim'], cfg['hidden_dim'], bias=False)\n"
        "        self.fc3 = nn.Linear(cfg['hidden_dim'], cfg['emb_dim'], bias=False)\n\n"
        "    def forward(self, x):\n"
        "        return self.fc3(nn.functional.gelu(self.fc1(x), approximate='tanh') * self.fc2(x))\n\n\n"
        "class Gemma3Model(nn.Module):\n    pass\n")
    result = glassgpt.check(load_class(f"{tmp_path / 'my_gemma.py'}:FeedForward"))
    assert result.ok and result.kind == "GeGLU FeedForward", result.to_text()


def test_an_unknown_piece_lists_the_bonus_kinds_and_how_to_say_which():
    class Mystery(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(2, 2)

    with pytest.raises(PieceError) as err:
        glassgpt.check(Mystery())
    message = str(err.value)
    assert "\n" not in message
    for words in ("RMSNorm (1 + weight)", "GeGLU FeedForward", GEMMA_ATT, OLMO_ATT, "Tiny Aya GroupedQueryAttention",
                  "GatedDeltaNet",
                  "CohereLayerNorm", "gemma3, olmo3, qwen3_5 or tiny_aya"):
        assert words in message


def test_the_cli_checks_a_gemma_rmsnorm_file(tmp_path, capsys):
    from glassgpt.cli import main
    body = ("import torch\nfrom torch import nn\n\n\n"
            "class RMSNorm(nn.Module):\n"
            "    def __init__(self, emb_dim, eps=1e-6, bias=False):\n"
            "        super().__init__()\n        self.eps = eps\n"
            "        self.scale = nn.Parameter(torch.zeros(emb_dim))\n\n"
            "    def forward(self, x):\n"
            "        x_f = x.float()\n"
            "        x_norm = x_f * torch.rsqrt(x_f.pow(2).mean(dim=-1, keepdim=True) + self.eps)\n"
            "        return (x_norm * {}).to(x.dtype)\n")
    (tmp_path / "good.py").write_text(body.format("(1.0 + self.scale)"))
    (tmp_path / "bad.py").write_text(body.format("self.scale"))
    assert main(["check", f"{tmp_path / 'good.py'}:RMSNorm"]) == 0
    assert "RMSNorm (1 + weight) matches glassgpt's formula" in capsys.readouterr().out
    assert main(["check", f"{tmp_path / 'bad.py'}:RMSNorm"]) == 1
    assert "each column is scaled by the weight alone, not by (1 + weight)" in capsys.readouterr().out


def test_a_geglu_checked_as_swiglu_is_told_to_say_gemma3():
    result = glassgpt.check(FeedForward, args="qwen3")  # no family: Qwen3's SwiGLU is what it is held against
    assert result.kind == "SwiGLU FeedForward" and "say so: --args gemma3" in result.finding, result.to_text()


def test_the_docs_bonus_piece_example_is_what_check_prints():
    from pathlib import Path
    docs = (Path(__file__).resolve().parents[1] / "docs" / "check.md").read_text()
    printed = docs.split("## The bonus models' own pieces")[1].split("```\n$ glassgpt check my_olmo3.py:"
                                                                    "GroupedQueryAttention\n")[1].split("\n```")[0]
    assert printed == PLANTED["olmo3_attention_norm_per_head"][0]().to_text()


def test_transformers_chunked_gated_delta_net_equals_glassgpts_token_by_token_rule():
    """The class the notebook imports (qwen3_5_transformers.py is transformers' own), its chunked delta rule."""
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=48, vocab_size=97)
    torch.manual_seed(0)
    result = glassgpt.check(modeling.Qwen3_5GatedDeltaNet(cfg, 0))
    assert result.ok and result.kind == "GatedDeltaNet", result.to_text()


def test_a_norm_computed_in_bfloat16_is_told_to_compute_in_float32():
    finding = PLANTED["gemma3_rmsnorm_in_bfloat16"][0]().finding
    assert "fed bfloat16, 59 of 128 outputs differ" in finding and "x_f = x.float()" in finding
    assert "in bfloat16: as computed in float32, then rounded" in CORRECT["gemma3_rmsnorm"][0]().lines
