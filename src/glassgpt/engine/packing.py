"""Positions no loss reads, left out: a padded batch's rows packed end to end, for training's fused twin.

Chapter 7's batches are padded to their longest record (custom_collate_fn), and every target after
a record's one end-of-text is -100: the loss never reads those positions. Causal attention means no
earlier position reads them either, so their whole column through the model (each Linear, the
head over 50,257 words) is work whose result is thrown away: 19% of the positions of chapter 7's
batches. Here each row keeps only its prefix up to its last counted target:

    ids [b, t], targets [b, t]           the padded batch, as the book's collate makes it
      -> keep[i, j] = j < L_i           L_i: one past row i's last target that is not ignore_index
      -> x = tok_emb(ids) + pos_emb(j)  GPTModel.forward's first lines, on the padded rows
      -> x[keep]: [1, N, d]             the kept positions end to end, N = sum L_i
      -> the blocks, final_norm, out_head on those N rows
         (attention alone scatters q, k, v back to [b, h, t, hd], attends causally per row as
          before, and gathers the kept queries: no row sees another's)
      -> logits [N, V] against targets[keep]

The mean over the counted targets is the padded batch's: the same targets, the same per-row sums
(the matrix products add each row's terms as before; tests/test_packing.py: the loss and every
gradient within 1e-5 of the padded forward's in float32). It runs only where nothing random runs
in the model (drop_rate 0: a dropout mask of another shape would draw another stream from the
generator the book's loaders share) and on the fused twin itself (not through torch.compile,
DistributedDataParallel or FSDP, which wrap the forward); elsewhere `packed_logits` returns None and the
caller runs the padded batch.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..model import GPTModel
from .fused import FusedAttention
from .loss import IGNORE_INDEX, cross_entropy

# Below this share of positions left out, packing is not worth its scatters and gathers (where nothing is
# left out they cost 0-3% of a step: 8 x 72 tokens at GPT-2's size in bf16, AMD EPYC, 1.70-1.96 s a step
# against 1.64-1.93 s padded).
MIN_SAVED = 0.05


def kept_positions(targets: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """[b, t] bool: each row's prefix up to and including its last target that is not `ignore_index`."""
    t = targets.shape[1]
    counted = targets != ignore_index
    last = torch.where(counted, torch.arange(1, t + 1, device=targets.device), 0).amax(dim=1)  # L_i
    return torch.arange(t, device=targets.device) < last[:, None]


def packs(model: nn.Module) -> bool:
    """Whether `packed_logits` can run `model`: the fused twin itself (no hooks on its forward, which this
    does not call, and not sharded by FSDP, whose hooks gather the weights), with nothing random in it."""
    return (isinstance(model, GPTModel) and model.cfg.drop_rate == 0.0 and model.cfg.num_classes is None
            and not hasattr(model, "unshard") and not model._forward_hooks and not model._forward_pre_hooks
            and all(type(block.att) is FusedAttention for block in model.trf_blocks))


def packed_logits(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                  ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits [N, V], targets [N]) over the kept positions (module docstring); None where packing does not
    run here (`packs`) or would save under MIN_SAVED of the positions."""
    if not packs(model):
        return None
    b, t = ids.shape
    keep = kept_positions(targets, ignore_index)
    n = int(keep.sum())
    if n == 0 or n > (1.0 - MIN_SAVED) * b * t:
        return None
    index = keep.flatten().nonzero().squeeze(1)  # [N]: where each kept position sits in the [b * t] rows
    x = model.tok_emb(ids)  # GPTModel.forward's embedding lines, on the padded batch
    x = model.drop_emb(x + model.pos_emb(torch.arange(t, device=ids.device)))
    x = x.flatten(0, 1).index_select(0, index).unsqueeze(0)  # [1, N, d]
    with _packed(model, index, b, t):
        for block in model.trf_blocks:
            x = block(x)
    return model.out_head(model.final_norm(x))[0], targets.flatten().index_select(0, index)


def packed_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor | None:
    """The mean cross-entropy over the counted targets, from the kept positions alone; None where
    `packed_logits` is (the caller then runs the padded batch)."""
    packed = packed_logits(model, ids, targets, ignore_index)
    return None if packed is None else cross_entropy(*packed, ignore_index=ignore_index)


@contextlib.contextmanager
def _packed(model: GPTModel, index: torch.Tensor, b: int, t: int):
    """Each block's attention scatters its packed q, k, v to [b, h, t, hd] and gathers the kept context."""
    modules = [block.att for block in model.trf_blocks]
    for att in modules:
        att.packing = (index, b, t)
    try:
        yield
    finally:
        for att in modules:
            del att.packing

