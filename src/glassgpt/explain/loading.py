"""Loading a state dict into a reader's port: what goes wrong, named.

    errors, notes = check_state_dict(model, state)   # sentences; load_state_dict(model, state) raises the first

The book's code and the readers' ports fail most often here, and torch's own error lists keys. Each
cause is named instead, with what to do: another convention's names (nn.LayerNorm's weight/bias for
the book's scale/shift; transformers' model.layers.N or transformer.h.N for the book's trf_blocks.N),
with glassgpt's map that converts them and one name mapped as an example; a matrix stored transposed
(GPT-2's Conv1D layout, [in, out]); a missing or unexpected key; a shape the config does not make. A
head that loads but is a copy of the embedding (equal values, separate storage) is a note.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..errors import GlassError
from ..formats import families as family_formats, hf as gpt2_formats
from .causes import HEAD_COPY
from .debugger import port_side


CONVENTIONS = (  # (a name pattern of another convention, what it is, the map that converts it)
    (r"^model\.layers\.\d+\.|^model\.embed_tokens\.", "transformers' Qwen3/Llama names (model.layers.N, "
     "model.embed_tokens)", "formats/families.py's hf_names (glassgpt.load_model(folder) reads them)"),
    (r"^(transformer\.)?h\.\d+\.|^(transformer\.)?wte\.", "transformers' GPT-2 names (transformer.h.N, wte; "
     "Conv1D matrices stored [in, out])", "formats/hf.py's hf_to_glassgpt, which also transposes the Conv1D "
     "matrices (glassgpt.load_model(folder) reads them)"),
)


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """(errors, notes) of loading `state` into `model`: each error a sentence naming its cause (another
    convention's names and the map, a transposed matrix, missing or unexpected keys, a shape), each
    note something that loads but is not what it seems (a head that is a copy of the embedding)."""
    own = model.state_dict()
    optional = {k for k in own if k.endswith((".mask", ".cos", ".sin"))}  # buffers the book rebuilds
    missing = sorted(set(own) - set(state) - optional)
    unexpected = sorted(set(state) - set(own))
    errors = []
    for pattern, what, how in CONVENTIONS:
        theirs = [k for k in unexpected if re.search(pattern, k)]
        if theirs and missing:
            example = next((f"; e.g. {k} is {book}" for k in theirs if (book := _book_name(k, state[k], model))), "")
            errors.append(f"the state dict has {what} where your model has the book's ({missing[0]}, ...): "
                          f"convert them with {how}{example}")
            return errors, []
    renamed = _renamed(missing, unexpected)
    if renamed:
        errors.append(renamed)
    elif missing or unexpected:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} key(s) your model has ({', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"holds {len(unexpected)} your model has not ({', '.join(unexpected[:3])})")
        errors.append(f"the state dict {' and '.join(parts)}: it was saved from another model or config")
    for name in sorted(set(own) & set(state)):
        mine, theirs = own[name], state[name]
        if tuple(mine.shape) == tuple(theirs.shape):
            continue
        if theirs.dim() == 2 and tuple(theirs.shape) == tuple(mine.shape)[::-1]:
            errors.append(f"{name} is {list(theirs.shape)}, the transpose of your nn.Linear's {list(mine.shape)} "
                          "([out, in]): it is stored as GPT-2's Conv1D stores it ([in, out]): transpose it "
                          "(w.t()), as formats/hf.py's map does")
        else:
            errors.append(f"{name} is {list(theirs.shape)} in the state dict but {list(mine.shape)} in your model: "
                          "the config does not describe these weights")
    notes = []
    emb, head = state.get("tok_emb.weight"), state.get("out_head.weight")
    if emb is not None and head is not None and emb.shape == head.shape and torch.equal(emb, head) \
            and emb.untyped_storage().data_ptr() != head.untyped_storage().data_ptr():
        notes.append(HEAD_COPY.format(where="the state dict's out_head.weight"))
    return errors, notes


def _renamed(missing: list[str], unexpected: list[str]) -> str | None:
    """nn.LayerNorm's weight/bias where the book's LayerNorm has scale/shift, or the other way round."""
    maps = ((".weight", ".scale"), (".bias", ".shift"))
    for theirs_end, ours_end in maps + tuple((b, a) for a, b in maps):
        pairs = [k for k in unexpected if k.endswith(theirs_end) and k[: -len(theirs_end)] + ours_end in missing]
        if pairs:
            example = pairs[0]
            fix = example[: -len(theirs_end)] + ours_end
            return (f"the state dict names a norm's parameters {theirs_end.lstrip('.')} where your model has "
                    f"{ours_end.lstrip('.')} ({example} -> {fix}): nn.LayerNorm says weight/bias, the book's "
                    "LayerNorm scale/shift; rename .weight -> .scale and .bias -> .shift (or the reverse) before "
                    "load_state_dict")
    return None


def _book_name(name: str, tensor: torch.Tensor, model: nn.Module) -> str | None:
    """The book's name of one of transformers' tensors, by glassgpt's own maps (None: they have none)."""
    try:
        port = port_side(model)
        family, cfg = port.key, port.cfg
        if family == "gpt2":
            mapped = [ours for ours, _ in gpt2_formats.hf_to_glassgpt(iter([(name, tensor)]), cfg)]
            return " + ".join(mapped) + (" (transposed from Conv1D)" if tensor.dim() == 2 else "") if mapped else None
    except GlassError:  # the model is no kind glassgpt reads, or the tensor not of its config
        return None
    return {theirs: book for book, theirs in family_formats.hf_names(cfg)}.get(name)


def load_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str = "the state dict") -> list[str]:
    """Load `state` into `model` after check_state_dict: a one-line GlassError naming the first cause, or
    the notes (a copied head) once it has loaded."""
    errors, notes = check_state_dict(model, state)
    if errors:
        raise GlassError(f"{source} does not load into {type(model).__name__}: {errors[0]}")
    try:
        model.load_state_dict(state, strict=False)
    except Exception as err:  # what the checks above do not foresee: torch's own first line
        raise GlassError(f"{source} does not load into {type(model).__name__}: {type(err).__name__}: "
                         f"{str(err).splitlines()[0]}") from None
    return notes
