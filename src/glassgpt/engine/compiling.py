"""torch.compile for one command: its compiled code kept across processes, and run only where it pays.

    use_cache()                                   inductor's caches under glassgpt's cache root
    decision = decide(record, native, new_tokens)  whether `generate --compile` compiles, and why, in one line
    measure_steps(engine, max_len)                 a plain and a compiled decoding step, timed round-robin
    remember(choices, compile_s, steps)            what a compile that ran cost and saved here, kept

A compile costs seconds to minutes and speeds only the engine's PyTorch forward. Where the native
step decodes (step.py; autotune.py chose it on this machine) a token runs the same C++ call with
or without it, so compiling speeds only the prompt's one forward, by milliseconds: it cannot pay
for a `generate`. Where the PyTorch engine decodes, it pays beyond `compile_s / (plain - compiled)`
new tokens. Those three figures are measured the first time a compile runs for a model's shapes,
precision and thread count on a CPU, and kept beside autotune's choices (the same key, in
`native.cache_dir()/autotune.json`); every later compile measures them again (a warm inductor
cache makes the next compile cheaper). The compile's cost is the wait to the second token less two
compiled steps, so the prompt's forward counts against it (milliseconds, against seconds).
Nothing recorded yet: the compile runs, as asked, so that it is measured; the note says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from . import autotune, native
from .cache import KVCache

COMPILE = "compile"  # its name in Choices.ms: {"compiling": ms once, "plain": ms a token, "compiled": ms a token}


def use_cache() -> str:
    """Point inductor's on-disk caches (compiled FX graphs, AOT autograd's, the dynamic-shape decisions)
    at `native.cache_dir()/inductor`, so that a later process loads what this one compiles instead of
    compiling again; a TORCHINDUCTOR_CACHE_DIR the user set is kept. Returns the directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # torch writes its default (a folder in /tmp) into the variable the first time it looks: not the user's.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(native.cache_dir() / "inductor")
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


@dataclass(frozen=True)
class Decision:
    compile: bool
    note: str  # one line, for the start of `generate`: what was measured (or assumed) and what follows


def decide(record: dict | None, native_step: bool, new_tokens: int, step_ms: dict | None = None) -> Decision:
    """Whether compiling pays for `new_tokens` new tokens, from what a compile cost and saved here (`record`:
    Choices.ms["compile"]); `native_step`: the native step decodes here (autotune's "step", `step_ms`)."""
    if native_step:
        speed = (f" (measured {step_ms['engine'] / step_ms['native']:.2f}x the PyTorch engine's speed)"
                 if step_ms and step_ms.get("native") and step_ms.get("engine") else "")
        cost = f"the last compile here took {record['compiling'] / 1e3:.0f} s" if record else \
            "a first compile takes tens of seconds on a CPU (assumed: none measured here)"
        return Decision(False, f"--compile skipped: the native step decodes every token here with or without it"
                               f"{speed}, so compiling would speed only the prompt's one forward, and {cost}")
    if record is None:
        return Decision(True, "--compile: nothing measured yet for this model on this machine, so it compiles "
                              "(assumed to pay) and measures what compiling costs and saves, for the next command "
                              "to decide from")
    measured = (f"measured here: compiling took {record['compiling'] / 1e3:.1f} s, a step {record['compiled']:.2f} ms "
                f"compiled against {record['plain']:.2f} ms plain")
    beyond = pays_beyond(record, native_step)
    if beyond is None:
        return Decision(False, f"--compile skipped: a compiled step is no faster here ({measured})")
    if new_tokens > beyond:
        return Decision(True, f"--compile: it pays beyond {beyond:,} new tokens ({measured}); this command "
                              f"generates {new_tokens:,}")
    return Decision(False, f"--compile skipped: it pays only beyond {beyond:,} new tokens ({measured}); this "
                           f"command generates {new_tokens:,}")


def pays_beyond(record: dict | None, native_step: bool) -> int | None:
    """The new tokens beyond which compiling pays here; None where it never does or nothing is measured."""
    if native_step or record is None or record["compiled"] >= record["plain"]:
        return None
    return math.ceil(record["compiling"] / (record["plain"] - record["compiled"]))


def measure_steps(engine, max_len: int) -> dict[str, float]:
    """{"plain": ms, "compiled": ms}: one decoding step of a compiled Engine, through its PyTorch forward
    and its compiled one, at batch 1 over a scratch cache of the run's `max_len` (the compiled graphs'
    shapes, so nothing compiles again), round-robin, the least disturbed run of each."""
    cache = KVCache(engine.cfg, 1, max_len, dtype=engine.model.tok_emb.weight.dtype)
    token = torch.zeros(1, 1, dtype=torch.long)
    pos = min(max_len - 1, 2)  # not 0 or 1: dynamo specializes those, and would compile again

    def at(call):
        def run():
            cache.pos = pos
            call(token, cache, True)
        return run
    measured = autotune.Choices("", "")
    autotune.measure(measured, "step", {"plain": at(engine.run), "compiled": at(engine.compiled)},
                     autotune.STEP_BUDGET_S, autotune.STEP_REPEATS)
    return measured.ms["step"]


def remember(choices: autotune.Choices, compile_s: float, steps: dict[str, float]) -> None:
    """Keep what a compile cost (`compile_s`) and the steps it timed (measure_steps) with `choices`."""
    choices.ms[COMPILE] = {"compiling": max(compile_s, 0.0) * 1e3, **steps}
    autotune.save(choices)
