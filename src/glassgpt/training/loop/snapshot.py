"""A snapshot of what a model predicts for one prompt: small enough to take at every evaluation.

    snapshot(model, tokenizer, prompt_ids) -> {
        "prompt": str, "prompt_ids": [int],
        "top":  [{"id", "text", "prob"}, ...top_k],       softmax of the last position's logits (temperature 1)
        "greedy": str,                                      the greedy continuation (the new tokens' text)
        "lens": [{"layer", "id", "text", "prob"}, ...],    one per block: the logit lens
    }

The logit lens (nostalgebraist, 2020) reads the residual stream after block i as if it were
the last one: out_head(final_norm(output of block i)) at the last prompt position, and keeps
its top token. After the last block that is the model's own prediction, so `lens[-1]` is
`top[0]`. Training records one snapshot per evaluation in metrics.jsonl (`glassgpt plot`
draws them; the web page slides over them), so this is a contract: keep the keys.

The block outputs are caught by forward hooks that live only during the one forward pass,
and the lens is computed inside it (in a hook on out_head), so a model sharded by FSDP,
whose weights are whole only during its forward, is read the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ...device import evaluating
from ...generate import generate, glass_model
from ...tokenizer import Tokenizer


@torch.no_grad()
def snapshot(model: nn.Module, tokenizer: Tokenizer, prompt_ids: Sequence[int], top_k: int = 5,
             new_tokens: int = 40) -> dict[str, Any]:
    """The snapshot of `model` (a language model) for `prompt_ids` (see the module docstring)."""
    glass = glass_model(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=glass.tok_emb.weight.device)  # [1, t]
    with evaluating(glass):
        logits, lens_logits = _logits_and_lens(glass, ids)
        greedy = generate(model, ids, new_tokens)[0, ids.shape[1]:].tolist() if new_tokens else []
    probs = logits.float().softmax(-1)  # [V]
    top = probs.topk(min(top_k, probs.numel()))
    return {
        "prompt": tokenizer.decode(list(prompt_ids)),
        "prompt_ids": [int(i) for i in prompt_ids],
        "top": [_token(tokenizer, int(i), float(p)) for p, i in zip(top.values, top.indices)],
        "greedy": tokenizer.decode(greedy),
        "lens": [{"layer": layer, **_token(tokenizer, int(p.argmax()), float(p.max()))}
                 for layer, p in enumerate(x.float().softmax(-1) for x in lens_logits)],
    }


def _logits_and_lens(glass: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the last position's logits [V], out_head(final_norm(block i's output)) there, [V] per block)."""
    outputs: list[torch.Tensor] = []
    lens: list[torch.Tensor] = []

    def keep(module, args, output):
        outputs.append(output)  # [1, t, d]

    def read_lens(module, args, output):
        # final_norm over every position, then the last one, exactly as GPTModel.forward does, so
        # that the last block's lens equals the model's own logits bit for bit.
        lens.extend(module.forward(glass.final_norm(h)[:, -1:])[0, -1] for h in outputs)  # [1, t, d] -> [V]

    hooks = [block.register_forward_hook(keep) for block in glass.trf_blocks]
    hooks.append(glass.out_head.register_forward_hook(read_lens))
    try:
        logits = glass(ids, last_only=True)[0, -1]  # [1, 1, V] -> [V]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, lens


def _token(tokenizer: Tokenizer, token_id: int, prob: float) -> dict[str, Any]:
    return {"id": token_id, "text": tokenizer.decode([token_id]), "prob": prob}
