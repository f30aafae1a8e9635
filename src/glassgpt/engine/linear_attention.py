"""One token's linear attention (Qwen3.5's Gated DeltaNet) over its cache: the twin's decoding step.

    one_token_linear_attention(twin, anatomy)   every linear attention of a twin (decode.py's gemv_twin) decodes
                                                one token through OneTokenDeltaNet

The glass Qwen3_5GatedDeltaNet (families/qwen3_5.py) serves a whole prompt: conv1d over the cached inputs and
the new ones, then gated_delta_rule's loop, each token's state update written as the maths reads (a new
[hv, dk, dv] tensor for the decay, the prediction, the correction and the readout). For one token that costs
a convolution library call for a kernel of 4 (~0.3 ms in float32 on an AVX2 CPU; in bfloat16, 6,144 slow
per-channel convolutions, ~1 s a token for Qwen3.5 0.8B) and eight passes over each layer's 1 MB state.
OneTokenDeltaNet computes the same token:
  - the convolution as one multiply-sum over the kernel's window (the cached inputs and the new one), in
    float32 and rounded once, as the convolution library does; the window is kept tokens first, and the
    cache's `[b, c, kernel - 1]` is a view of it;
  - the delta rule on the cache's float32 state, in place: S <- exp(g) S (one pass), q and k read the
    decayed state in one matmul (S^T q, S^T k), S += k delta^T (one pass). The output is S^T q + (q . k) delta,
    the corrected state's S^T q without a third pass;
  - the rest (projections, gating, l2norm, the gated output norm) as the glass module writes it.
Its outputs equal the glass module's within float32's rounding, in bfloat16 bit for bit but where a float32
difference meets a rounding boundary (tests/test_linear_attention_twin.py). The cache's state tensor changes in
place: a state that read() gave earlier changes with it. A prompt, a first token without a cached state, or
gradients on run the glass forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..families.qwen3_5 import l2norm
from .experts import mix_in


class OneTokenDeltaNet:
    """Mixed into the twin's copy of a Qwen3_5GatedDeltaNet (its own class first in the order): its forward for
    one token over a cache that holds a state, the glass forward otherwise. Reads the glass module's
    projections, conv1d weight, A_log, dt_bias and gated norm."""

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        b, t, _ = x.shape
        conv_before, state = (None, None) if cache is None or t != 1 else cache.read()
        if state is None or conv_before is None or not self.updates_in_place(state):
            return super().forward(x, cache)
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim

        # The short convolution: the kernel's window is the cached inputs and the new one, kept tokens first
        # ([b, K, c], so joining and summing run along whole rows); the cache reads it as its [b, c, K - 1].
        c, kernel = self.conv_dim, self.conv_kernel_size
        window = torch.cat([conv_before.transpose(1, 2).to(x.dtype), self.in_proj_qkv(x)], 1)  # [b, K, c]
        taps = self.conv1d.weight.reshape(c, kernel).t()  # [c, 1, K] -> [K, c]
        mixed = F.silu((window.float() * taps.float()).sum(1).to(x.dtype))  # [b, c]

        qk = l2norm(mixed[:, :2 * self.key_dim].float().view(b, 2, hk, dk))  # queries then keys
        qk[:, 0] *= dk ** -0.5
        if hv > hk:  # each key head serves hv // hk neighbouring value heads
            qk = qk.repeat_interleave(hv // hk, dim=2)
        qk = qk.transpose(1, 2)  # [b, 2, hv, dk] -> [b, hv, 2, dk]
        q, k = qk[:, :, 0], qk[:, :, 1]  # [b, hv, dk] each
        v = mixed[:, 2 * self.key_dim:].float().view(b, hv, dv)
        beta = self.in_proj_b(x).sigmoid().float().view(b, hv, 1)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)  # [b, 1, hv], <= 0

        # The gated delta rule for one token, on the cache's state.
        state.mul_(g.exp().view(b, hv, 1, 1))                 # forget a little: [b, hv, dk, dv]
        read = torch.matmul(qk, state)                        # S^T q and S^T k: [b, hv, 2, dv]
        delta = (v - read[:, :, 1]) * beta                    # how far off, times the step size: [b, hv, dv]
        state.addcmul_(k[..., None], delta[..., None, :])     # the rank-one correction
        out = torch.addcmul(read[:, :, 0], torch.linalg.vecdot(q, k)[..., None], delta)  # the corrected S^T q
        cache.write(window[:, 1:].transpose(1, 2), state)     # [b, c, K - 1]

        z = self.in_proj_z(x).view(b, 1, hv, dv)
        out = self.norm(out.view(b, 1, hv, dv).to(x.dtype), z).view(b, 1, self.value_dim)
        return self.out_proj(out)

    @staticmethod
    def updates_in_place(state: torch.Tensor) -> bool:
        """Whether the cache's state may be updated in place: float32 (what the glass forward writes), no
        gradients recorded, and not an inference tensor outside inference mode."""
        return state.dtype == torch.float32 and not torch.is_grad_enabled() and \
            (torch.is_inference_mode_enabled() or not state.is_inference())


def one_token_linear_attention(twin: nn.Module, anatomy) -> int:
    """Give every linear attention of `twin` (its description `anatomy`) OneTokenDeltaNet's forward; returns
    how many."""
    return sum(mix_in(twin.get_submodule(b.attention.path), OneTokenDeltaNet) for b in anatomy.blocks
               if b.attention.kind == "linear" and b.attention.state is not None
               and b.attention.state.rule == "gated_delta")
