"""nn.Embedding is nn.Linear on one-hot vectors: shown on the live weights, with what each way costs."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ..model import GPTModel


@torch.inference_mode()
def check_embedding_is_linear(model: GPTModel, ids: torch.Tensor, repeats: int = 5, timing: bool = True,
                              budget_ms: float = 250.0) -> dict[str, Any]:
    """Show on the live weights that an embedding lookup is a matmul with one-hot vectors.

    tok_emb(ids) == one_hot(ids, V) @ W == nn.Linear(V, d, bias=False) with weight W.T,
    exactly (each output sums one weight and V - 1 zeros). The lookup skips the zeros.
    ids: [b, t] int64. timing: also time both ways, up to `repeats` runs each (fewer when
    they would take over `budget_ms`: a long prompt's one-hot matmul is timed once).
    """
    W = model.tok_emb.weight  # [V, d]
    V, d = W.shape
    lookup = model.tok_emb(ids)  # [b, t, d]
    one_hot = F.one_hot(ids, V).to(W.dtype)  # [b, t] -> [b, t, V]
    via_matmul = one_hot @ W  # [b, t, V] @ [V, d] -> [b, t, d]
    linear = nn.Linear(V, d, bias=False, device=W.device, dtype=W.dtype)
    linear.weight = nn.Parameter(W.t(), requires_grad=False)  # a view of the same numbers, [d, V]
    via_linear = linear(one_hot)
    del one_hot, linear

    n = ids.numel()
    check = {
        "equal_one_hot_matmul": bool(torch.equal(lookup, via_matmul)),
        "equal_linear": bool(torch.equal(lookup, via_linear)),
        "max_abs_diff": float((lookup - via_matmul).abs().max()),
        "weight_shape": [V, d],
        "linear": f"nn.Linear({V}, {d}, bias=False), weight = tok_emb.weight.T [{d}, {V}]",
        "lookup_bytes": n * d * W.element_size(),
        "one_hot_bytes": n * V * W.element_size(),
        "matmul_flops": 2 * n * V * d,
        "useful_fraction": 1 / V,
    }
    if timing:  # the check above warmed both paths up
        check["lookup_ms"] = _median_ms(lambda: model.tok_emb(ids), repeats, budget_ms)
        check["matmul_ms"] = _median_ms(lambda: F.one_hot(ids, V).to(W.dtype) @ W, repeats, budget_ms)
    return check


def _median_ms(fn: Callable[[], Any], repeats: int, budget_ms: float) -> float:
    """Median milliseconds of fn() over `repeats` runs, stopping early once they add up to `budget_ms`."""
    times: list[float] = []
    while not times or (len(times) < repeats and sum(times) < budget_ms):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
