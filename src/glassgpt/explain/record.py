"""Recording: taps on the model's modules that hand their tensors to the current trace.

The first trace of a model puts small forward hooks ("taps") on its modules, once and for
good. A tap does nothing unless the current thread (strictly: the current `contextvars`
context) has a recorder, which only `record` sets, around its one forward pass. So traces
of one shared model can run side by side in threads, each recording its own tensors, and
every other use of the model (generation, training, torch.compile) passes through taps
that return at once. A recorder can be cancelled from another thread: the next tap raises
`TraceCancelled`, which ends the forward pass early.

Taps are named by the stage names the views use (`trf_blocks.3.att.W_query`, `.att.out_proj`,
`.ff.layers.2`, ...). Taps only read: analyses that run the model again with a change (why.py's
removals and patching) do it on a twin of their own (engine/fused.py), never on the shared model.
"""

from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import TraceCancelled
from ..kinds import describe


Progress = Callable[[str, int, int], None]  # (the step just done, steps done, steps in all)


@dataclass
class Recorder:
    """One trace's state: the tensors it keeps (named in `keep`), its progress, its cancel flag."""

    keep: frozenset[str]
    total_steps: int
    cancel: threading.Event | None = None
    progress: Progress | None = None
    done_steps: int = 0
    seen: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise TraceCancelled("the trace was cancelled")

    def step(self, name: str) -> None:
        """A step of the trace is done: report it, and stop here if the trace was cancelled."""
        self.check()
        self.done_steps += 1
        if self.progress is not None:
            self.progress(name, self.done_steps, self.total_steps)


_RECORDER: ContextVar[Recorder | None] = ContextVar("glassgpt_explain_recorder", default=None)


_TAPS_LOCK = threading.Lock()


class _Tap:
    """A forward hook that hands a module's output (and input) to the current trace's recorder."""

    def __init__(self, name: str, inputs: bool = False, step: bool = False) -> None:
        self.name, self.inputs, self.step = name, inputs, step

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            return  # compiled code never records; reading a ContextVar there would break the graph
        rec = _RECORDER.get()
        if rec is None:
            return
        if self.name in rec.keep:
            rec.seen[self.name] = (args[0], output) if self.inputs else output
        if self.step:
            rec.step(self.name)
        else:
            rec.check()


def _tap_points(model: nn.Module) -> list[tuple[nn.Module, _Tap]]:
    """Every part the model's description names, tapped under its path (in glassgpt's models, the stage names)."""
    anatomy, part = describe(model), model.get_submodule
    e = anatomy.embedding
    points = [(part(e.path), _Tap(e.path))]
    if anatomy.positions.kind == "learned":
        points.append((part(anatomy.positions.path), _Tap(anatomy.positions.path)))
    if e.dropout is not None:
        points.append((part(e.dropout), _Tap("embeddings")))
    for block in anatomy.blocks:
        att, ff = block.attention, block.ff
        points += [(part(block.path), _Tap(block.path, inputs=True, step=True))]
        points += [(part(lin.path), _Tap(lin.path)) for lin in (att.query, att.key, att.value)]
        points.append((part(att.out.path), _Tap(att.out.path, inputs=True)))
        points += [(part(lin.path), _Tap(lin.path)) for lin in (att.latent, ff.experts and ff.experts.router) if lin]
        points += [(part(ff.path), _Tap(ff.path, inputs=True))] if ff.experts else []
        inside = [n.path for n in block.norms] + [lin.path for lin in (ff.gate, ff.up) if lin is not None]
        inside += [ff.activation_path] if ff.activation_path else []
        points += [(part(path), _Tap(path, inputs=True)) for path in inside + [ff.down.path]]
    return points + [(part(anatomy.final_norm.path), _Tap(anatomy.final_norm.path)),
                     (part(anatomy.head.path), _Tap(anatomy.head.path))]


def _install_taps(model: nn.Module) -> None:
    """Tap every module that has no tap yet: once per model, and again for a module swapped in later."""
    with _TAPS_LOCK:
        for module, tap in _tap_points(model):
            if not any(isinstance(hook, _Tap) for hook in module._forward_hooks.values()):
                module.register_forward_hook(tap)


def record(model: nn.Module, ids: torch.Tensor, rec: Recorder, last_only: bool = False, cache: Any = None
           ) -> torch.Tensor:
    """model(ids) with `rec` as this context's recorder: logits [b, t, V] (last_only: [b, 1, V]). cache: handed
    to a model whose attention gives its cache the rotated keys and values (the rotary trace's RecordingCache)."""
    _install_taps(model)
    rec.check()
    token = _RECORDER.set(rec)
    try:
        if cache is not None:  # the rotary trace's RecordingCache, handed the rotated keys and values
            return model(ids, cache, last_only=True) if last_only else model(ids, cache)
        return model(ids, last_only=True) if last_only else model(ids)  # [b, t] -> [b, t, V]
    finally:
        _RECORDER.reset(token)
