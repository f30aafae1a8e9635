"""Which kernel and which attention path run on this machine: timed once for the model's shapes, kept per CPU.

    choices = choose(cfg, "int8")     # measured the first time (about a second), then read back
    apply(twin, choices)              # each layer of the fused twin gets the winner
    describe(choices)                 # one line, for `glassgpt info` and the start of `generate`

The same code ran at a third of the memory's bandwidth on one CPU and at all of it on the
next, and the attention written out in blocks won on one and lost on another
(benchmarks/RESULTS.md), so no rule is written down here: each candidate is timed.

    linear OUTxIN    per distinct weight shape (a block's four, the head), one row of input:
                     "glassgpt" (kernels/gemv.cpp, through native.py) or "torch" (F.linear for
                     float32/bfloat16, torch._weight_int8pack_mm for int8, dequantize + F.linear
                     for int4)
    linear prompt    the widest block layer at PROMPT_ROWS rows (32 float, 512 int4): "glassgpt" lets a
                     prompt's products of up to that many rows (int4: any number) run the kernel
    gelu             GELU's tanh form over [min(512, context), 4 x emb_dim]: "glassgpt" (gelu_tanh, the
                     native step's formula) or "torch" (F.gelu); inference only
    attention decode one query over min(256, context) cached keys: "blocks" or "sdpa"
    attention prompt min(512, context) queries, no cache: "blocks" or "sdpa"
    attention train  training's: forward and backward of 8 sequences of min(128, context) tokens,
                     for the sequences of up to 128 tokens (longer ones keep SDPA): "blocks" or "sdpa"
                     (`tune_training`, on the fused twin a training run steps with)
    step             a decoding step of the model itself, batch 1: "native" (step.py, one C++ call)
                     or "engine" (the forward in PyTorch, on the winners above); timed at the
                     first decoding step, where the native step covers the model
    compile          what a torch.compile cost and saved, measured where one ran (compiling.py): not a
                     choice between candidates, but the figures `generate --compile` decides from

The choice is saved in `native.cache_dir()/autotune.json` under a key that names the CPU
(model name and instruction-set flags), torch's version, the thread count, the precision,
the shapes and whether glassgpt's kernels could be built, so another CPU, another torch,
another thread count or a newly installed compiler measures again. A decision whose winner led by
less than 10%, or whose runs were unsteady (another process held a core), is measured again by the
next process, up to three times, each candidate keeping its least disturbed time (SETTLED_LEAD).
Off the CPU nothing is chosen: PyTorch's operators run; in training, only the attention's path.

The cache is written whole (a temporary file renamed over it) and read warily: a file that is not
the JSON glassgpt writes (cut short, garbage, over MAX_CACHE_BYTES), or an entry whose winners and
times are not (a winner that is no candidate, a time that is no number), is measured again, with
one `CacheWarning` naming the file; a cache that cannot be written is measured again by each
process, with one `CacheWarning` too. Nothing read from it is run: it only picks among candidates.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GPTConfig
from ..device import cpu_flags
from ..errors import CacheWarning
from . import native
from .attention import ATTENTION_BLOCK, PATHS, attend
from .cache import KVCache
from .hybrid_cache import cache_for
from .fused import FusedAttention, FusedGELU
from .int4 import Int4Linear, is_int4
from .int8 import Int8Linear, is_quantized
from .linear import GEMV_MAX_ROWS, QUANTIZED_GEMV_MAX_ROWS, GemvLinear
from ..kinds import describe as describe_model
from . import step as plans

PRECISIONS = ("float32", "bfloat16", "int8", "int4")
ISA = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
BUDGET_S = 0.05  # timing per candidate and shape: a handful of calls
# A prompt's products past GEMV_MAX_ROWS rows (float) or QUANTIZED_GEMV_MAX_ROWS (int4) run glassgpt's kernel
# instead of PyTorch's only where, timed on the widest block layer at PROMPT_ROWS[precision] rows, it was faster:
# float32 and bfloat16 up to 32 rows (on the AMD EPYC PyTorch's float32 matmul ran 16 rows at 58-73 GFLOP/s, the
# kernel at 160-185), int4 at any length (there the int4 kernel ran 512 rows 1.75-6.3x faster than dequantizing
# the weight and multiplying; where a bf16 matmul runs on AMX, the measurement decides).
PROMPT = "linear prompt"
# GELU's tanh form over a prompt's feed-forward activations ([min(512, context), 4 x emb_dim]): glassgpt's kernel
# (gemv.h's gelu16, the native step's) or F.gelu; torch 2.13's CPU gelu(approximate="tanh") ran 512 x 3072 in
# 1.5-1.6 ms on the AMD EPYC, where its erf form takes 0.35.
GELU_DECISION = "gelu"
PROMPT_ROWS = {"float32": 32, "bfloat16": 32, "int4": 512}
UNLIMITED = 2**62  # (int4: every prompt length, once measured faster at 512 rows)
# A decoding step: at least STEP_REPEATS calls of each path, up to STEP_BUDGET_S. The native step
# meets the other thread at ~5 barriers per block, so a run during which another process holds a
# core is several times slower; the least disturbed of more runs is what the machine gives.
STEP_BUDGET_S, STEP_REPEATS = 0.5, 7
# A measurement taken while another process held a core can crown the wrong candidate (on the AMD EPYC the
# float32 head once timed torch 13.7 ms and glassgpt 14.1, where a quiet machine gives 11.5 and 6.3). So a
# decision is settled only where its winner led by SETTLED_LEAD and every candidate's runs were steady (their
# median within STEADY of their least disturbed); any other is measured again at the next process's first use,
# up to TRIES measurements in all, each candidate keeping its least disturbed time across them.
SETTLED_LEAD, STEADY, TRIES = 1.10, 1.5, 3
# What a cache entry's winners may name (measure's candidates), and the most a cache file may hold (a machine's
# entries are a few kB each): anything else in the file is not what glassgpt wrote.
CANDIDATES = frozenset({"torch", "glassgpt", *PATHS, "native", "engine"})
MAX_CACHE_BYTES = 16 * 2**20


@dataclass
class Choices:
    """What runs, by decision ("linear 768x768", "attention decode", ...), and the times behind it."""
    machine: str
    precision: str
    winners: dict[str, str] = field(default_factory=dict)
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # decision -> candidate -> ms per call
    cached: bool = False
    key: str = ""  # where in `path` it is kept
    path: Path | None = None
    unsettled: dict[str, int] = field(default_factory=dict)  # decision -> measurements so far (SETTLED_LEAD)
    measured: set[str] = field(default_factory=set)  # the decisions this process measured (not saved)

    def due(self, decision: str) -> bool:
        """Whether `decision` is to be measured now: never measured, or unsettled and not yet measured by this process."""
        return decision not in self.winners or (decision in self.unsettled and decision not in self.measured)


def precision_of(model: nn.Module) -> str:
    if is_int4(model):
        return "int4"
    if is_quantized(model):
        return "int8"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def kernels_for(precision: str):
    """The operators that can multiply at `precision` here (None: PyTorch's alone): the whole kernels, or, for
    float32 and bfloat16 on a CPU without AVX-512, the AVX2 build of `gemv` (native.gemv_ops)."""
    return native.gemv_ops() if precision in ("float32", "bfloat16") else native.load()


def _kernel_words(precision: str) -> str:
    """How a cache key names the kernels `kernels_for(precision)` offers, so that another build measures again."""
    if native.load() is not None:
        return "with glassgpt's kernels"
    return "with glassgpt's AVX2 gemv and described step" if kernels_for(precision) is not None else \
        "without glassgpt's kernels"


def machine_key() -> str:
    flags = cpu_flags()
    return f"{native.cpu_name()} [{' '.join(f for f in ISA if f in flags)}], torch {torch.__version__}, " \
           f"{torch.get_num_threads()} threads"


def tune(twin: nn.Module) -> Choices | None:
    """Choose (measuring if needed) and apply the kernels for the fused twin of a model; None off the CPU."""
    params = next(twin.parameters(), None)
    if params is None or params.device.type != "cpu" or twin.training or precision_of(twin) not in PRECISIONS:
        return None  # (float16 on a CPU: PyTorch's operators)
    choices = choose(twin.cfg, precision_of(twin))
    rows, ops = PROMPT_ROWS.get(choices.precision), kernels_for(choices.precision)
    # (measured apart from choose, so that a machine's earlier choices gain them without measuring the rest again)
    later = {}
    if choices.due(PROMPT) and rows and ops is not None \
            and choices.winners.get(f"linear {4 * twin.cfg.emb_dim}x{twin.cfg.emb_dim}") == "glassgpt":
        later[PROMPT] = lambda: linear_candidates((4 * twin.cfg.emb_dim, twin.cfg.emb_dim), choices.precision, ops,
                                                  rows=rows)
    if choices.due(GELU_DECISION) and ops is not None and hasattr(ops, "gelu_tanh"):
        later[GELU_DECISION] = lambda: gelu_candidates(twin.cfg, choices.precision, ops)
    if later:
        with torch.random.fork_rng(devices=[]):
            for decision, candidates in later.items():
                measure(choices, decision, candidates())
        save(choices)
    apply(twin, choices)
    return choices


_memo: dict[str, Choices] = {}
_training_memo: dict[str, str] = {}  # tune_training's key -> the winning path


def choose(cfg: GPTConfig, precision: str, cache: Path | None = None) -> Choices:
    """The winners for a model of `cfg`'s shapes at `precision` on this machine (timed once, then cached)."""
    cache = cache or native.cache_dir() / "autotune.json"
    key = _key(cfg, precision)
    if key in _memo:
        return _memo[key]
    choices = recorded(cfg, precision, cache)
    fresh = choices is None
    if fresh:
        choices = Choices(machine_key(), precision, key=key, path=cache)
    ops, attention = kernels_for(precision), None
    again = [d for d in choices.unsettled if d.startswith(("linear ", "attention ")) and choices.due(d)]
    with torch.random.fork_rng(devices=[]):  # the inputs are random: a seeded run draws the same with or without a measurement
        for shape in linear_shapes(cfg):
            decision = f"linear {shape[0]}x{shape[1]}"
            if fresh or decision in again:
                measure(choices, decision, linear_candidates(shape, precision, ops))
        for kind in ("decode", "prompt"):
            if fresh or f"attention {kind}" in again:
                attention = attention or attention_candidates(cfg, precision)
                measure(choices, f"attention {kind}", attention[kind])
    if fresh or again:
        save(choices)
    _memo[key] = choices
    return choices


def recorded(cfg: GPTConfig, precision: str, cache: Path | None = None) -> Choices | None:
    """What was measured on this machine for a model of `cfg`'s shapes at `precision`, without measuring; None if nothing."""
    cache = cache or native.cache_dir() / "autotune.json"
    key = _key(cfg, precision)
    if key in _memo:
        return _memo[key]
    saved = _read(cache).get(key)
    if saved is None:
        return None
    return Choices(machine_key(), precision, saved["winners"], saved["ms"], cached=True, key=key, path=cache,
                   unsettled=saved.get("unsettled", {}))


def _key(cfg: GPTConfig, precision: str) -> str:
    return (f"{machine_key()} | {precision} | d {cfg.emb_dim}, h {cfg.n_heads}, out {cfg.out_dim}, "
            f"ctx {cfg.context_length} | {_kernel_words(precision)}")


def tune_training(twin: nn.Module) -> str | None:
    """The attention path a training run's fused twin takes for short sequences with gradients (timed
    once per machine, thread count, precision and head shape, then kept); None off the CPU."""
    params = next(twin.parameters(), None)
    if params is None or params.device.type != "cpu" or precision_of(twin) not in ("float32", "bfloat16"):
        return None
    cfg, precision = twin.cfg, precision_of(twin)
    t = min(ATTENTION_BLOCK, cfg.context_length)
    key = f"{machine_key()} | {precision} | training | h {cfg.n_heads}, hd {cfg.head_dim}, t {t}"
    cache = native.cache_dir() / "autotune.json"
    if key not in _training_memo:
        saved = _read(cache).get(key) or {"winners": {}, "ms": {}}
        choices = Choices(machine_key(), precision, saved["winners"], saved["ms"], key=key, path=cache,
                          unsettled=saved.get("unsettled", {}))
        if choices.due("attention train"):
            with torch.random.fork_rng(devices=[]):
                measure(choices, "attention train", training_attention_candidates(cfg, precision, t))
            save(choices)
        _training_memo[key] = choices.winners.get("attention train", FusedAttention.train_path)
    path = _training_memo[key]
    for module in twin.modules():
        if isinstance(module, FusedAttention):
            module.train_path = path
    return path


def training_attention_candidates(cfg: GPTConfig, precision: str, t: int) -> dict:
    """{path: forward and backward of the attention of 8 sequences of t tokens} with the model's head shape."""
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    q, k, v = (torch.randn(8, cfg.n_heads, t, cfg.head_dim).to(dtype).requires_grad_() for _ in range(3))

    def run(path: str):
        def call():
            with torch.inference_mode(False), torch.enable_grad():  # (measure times under inference mode)
                attend(q, k, v, 0.0, "blocks", "sdpa", path).sum().backward()
        return call
    return {path: run(path) for path in PATHS}


def apply(twin: nn.Module, choices: Choices) -> None:
    """Give each layer of `twin` the winner for its shape (layers of other shapes keep PyTorch's path)."""
    ops = kernels_for(choices.precision) if "glassgpt" in choices.winners.values() else None
    kernel = {GemvLinear: "gemv", Int8Linear: "gemv_q8", Int4Linear: "gemv_q4"}
    for module in twin.modules():
        if type(module) in kernel:
            won = choices.winners.get(f"linear {module.out_features}x{module.in_features}") == "glassgpt"
            # The kernel reads a contiguous [out, in] matrix; a transposed view (transformers' Conv1D
            # weights, read in place by adopt.py) runs F.linear. The native step says so, once (decode.py).
            covered = all(t is None or t.is_contiguous() for t in (getattr(module, "weight", None), module.bias))
            module.gemv = getattr(ops, kernel[type(module)]) if won and ops is not None and covered else None
            prompt = choices.winners.get(PROMPT) == "glassgpt"
            if type(module) is GemvLinear:
                module.max_rows = PROMPT_ROWS[choices.precision] if prompt else GEMV_MAX_ROWS
            elif type(module) is Int4Linear:
                module.max_rows = UNLIMITED if prompt else QUANTIZED_GEMV_MAX_ROWS
        elif isinstance(module, FusedGELU):
            module.kernel = getattr(ops, "gelu_tanh", None) if choices.winners.get(GELU_DECISION) == "glassgpt" else None
        elif isinstance(module, FusedAttention):
            module.decode_path = choices.winners.get("attention decode", FusedAttention.decode_path)
            module.prompt_path = choices.winners.get("attention prompt", FusedAttention.prompt_path)


def twin_choices(model: nn.Module) -> Choices | None:
    """The kernels of a model the Engine does not fuse (decode.py's TwinSteps: Qwen3, Llama 3): for each
    distinct Linear shape, "glassgpt" or "torch", whichever multiplied one row faster here; measured once per
    machine, precision and shape, kept in the cache file like `choose`'s (its "step" decision joins them at
    the first decoding step). None off the CPU, or in a precision nothing is measured for."""
    weight = next(model.parameters(), None)
    precision = None if weight is None else str(weight.dtype).removeprefix("torch.")
    if weight is None or weight.device.type != "cpu" or precision not in ("float32", "bfloat16"):
        return None
    anatomy = describe_model(model)
    shapes = sorted({(m.out_features, m.in_features) for m in model.modules() if type(m) is nn.Linear})
    first = anatomy.blocks[0]
    ops = kernels_for(precision)
    key = (f"{machine_key()} | {precision} | {anatomy.name}: d {anatomy.embedding.emb_dim}, layers {anatomy.n_layers}, "
           f"h {first.attention.n_heads}, g {first.attention.n_kv_groups}, hd {first.attention.head_dim}, "
           f"ff {first.ff.hidden_dim}, V {anatomy.head.out_features}, ctx {anatomy.positions.context_length}, "
           f"linears {' '.join(f'{o}x{i}' for o, i in shapes)} | "
           f"{_kernel_words(precision)}")
    if key in _memo:
        return _memo[key]
    cache = native.cache_dir() / "autotune.json"
    saved = _read(cache).get(key)
    choices = Choices(machine_key(), precision, key=key, path=cache) if saved is None else \
        Choices(machine_key(), precision, saved["winners"], saved["ms"], cached=True, key=key, path=cache,
                unsettled=saved.get("unsettled", {}))
    due = [shape for shape in shapes if choices.due(f"linear {shape[0]}x{shape[1]}")]
    if ops is not None and due:
        with torch.random.fork_rng(devices=[]):  # random inputs: a seeded run draws the same with or without this
            for out, inp in due:
                measure(choices, f"linear {out}x{inp}", linear_candidates((out, inp), precision, ops))
        save(choices)
    # A short prompt's products on the kernel too, where it beat PyTorch's on the widest block layer at PROMPT_ROWS
    # rows (PyTorch's bfloat16 matmul on a CPU without AVX512-BF16 ran a 16-token Gemma 3 prompt at ~15 GFLOP/s).
    widest = max((s for s in shapes if s[0] != anatomy.head.out_features), key=lambda s: s[0] * s[1], default=None)
    if ops is not None and widest is not None and choices.due(PROMPT) \
            and choices.winners.get(f"linear {widest[0]}x{widest[1]}") == "glassgpt":
        with torch.random.fork_rng(devices=[]):
            measure(choices, PROMPT, linear_candidates(widest, precision, ops, rows=PROMPT_ROWS[precision]))
        save(choices)
    _memo[key] = choices
    return choices


def native_step_chosen(engine: nn.Module, cache: KVCache) -> bool:
    """Whether `engine` (decode.py's Engine, or TwinSteps) decodes with the native step here: the step and the
    engine's own forward each decode position 1 of a scratch cache, timed once per machine and shapes on its
    own weights, then kept in the cache file, so that a later process plans the step without timing it."""
    choices = engine.choices
    if choices.due("step"):
        if plans.why_not(engine.model, cache) is not None:
            return False
        scratch = cache_for(engine.cfg, 1, 4, dtype=cache.k[0].dtype)  # (a HybridCache for Qwen3.5's linear layers)
        native, token = plans.native_step(engine.model, scratch), torch.zeros(1, dtype=torch.long)
        if native is None:
            return False

        def at(pos: int, call):
            def run():
                scratch.pos = pos
                call()
            return run
        with torch.inference_mode():
            engine.run(token[:, None], scratch, True)  # position 0 filled: each candidate decodes position 1
            measure(choices, "step", {"native": at(1, lambda: native(token)),
                                      "engine": at(1, lambda: engine.run(token[:, None], scratch, True))},
                    STEP_BUDGET_S, STEP_REPEATS)
        save(choices)
    return choices.winners["step"] == "native"


def save(choices: Choices) -> None:
    """Keep `choices` (a decision measured after `choose`: the step, compile's cost) in its cache file."""
    if choices.path is not None:
        _write(choices.path, choices.key, {"winners": choices.winners, "ms": choices.ms, "unsettled": choices.unsettled})


def describe(choices: Choices, cfg: GPTConfig) -> str:
    """One line: the kernels chosen for this precision, with the chosen layers' speed against PyTorch's per token."""
    shapes = linear_shapes(cfg)
    chosen = torch_ms = 0.0
    won = 0
    for (out, inp), count in shapes.items():
        ms = choices.ms.get(f"linear {out}x{inp}", {})
        winner = choices.winners.get(f"linear {out}x{inp}", "torch")
        won += winner == "glassgpt"
        chosen += count * ms.get(winner, 0.0)
        torch_ms += count * ms.get("torch", 0.0)
    if won:
        linear = (f"glassgpt's for {won} of {len(shapes)} weight shapes "
                  f"({torch_ms / chosen:.2f}x PyTorch's per token)" if chosen else f"glassgpt's for {won} shapes")
    elif kernels_for(choices.precision) is None:
        linear = f"PyTorch's ({native.gemv_status() if choices.precision in ('float32', 'bfloat16') else native.status()})"
    else:
        linear = "PyTorch's (measured faster than glassgpt's)"
    paths = {"blocks": "written out", "sdpa": "SDPA"}
    attention = ", ".join(f"{kind} {paths[choices.winners.get(f'attention {kind}', 'sdpa')]}"
                          for kind in ("decode", "prompt"))
    where = "cached" if choices.cached else "measured now"
    if choices.unsettled:  # (SETTLED_LEAD)
        where += f"; {len(choices.unsettled)} close or disturbed to be measured again at the next start"
    ms = choices.ms.get("step", {})
    speed = f"{ms['engine'] / ms['native']:.2f}x" if ms.get("native") and ms.get("engine") else None
    step = {"native": f"the native step, one C++ call per token ({speed} the PyTorch engine's speed)",
            "engine": f"the PyTorch engine (the native step measured {speed} its speed)"}.get(
        choices.winners.get("step", ""), "timed at the first decoding step")
    return (f"kernels: {choices.precision} matrix-vector products {linear}; attention: {attention}; "
            f"decoding: {step} ({where} for {choices.machine})")


def training_note() -> str:
    """What training runs (the start of `glassgpt train` says it): forward and backward need gradients,
    which glassgpt's kernels do not compute."""
    kernels = "glassgpt's kernels where they measured faster" if native.load() is not None else \
        f"PyTorch's ({native.status()})"
    return (f"kernels: training runs PyTorch's matmuls, and SDPA or the attention written out, whichever "
            f"measured faster forward and backward for sequences of up to {ATTENTION_BLOCK} tokens; its text "
            f"samples decode with {kernels}")


def linear_shapes(cfg: GPTConfig) -> dict[tuple[int, int], int]:
    """(out, in) of every Linear the model runs per token, and how many of each: a block's, x n_layers, and the head."""
    d = cfg.emb_dim
    shapes: dict[tuple[int, int], int] = {}
    for shape, count in (((d, d), 4), ((4 * d, d), 1), ((d, 4 * d), 1)):
        shapes[shape] = shapes.get(shape, 0) + count * cfg.n_layers
    head = (cfg.out_dim, d)
    shapes[head] = shapes.get(head, 0) + 1
    return shapes


def linear_candidates(shape: tuple[int, int], precision: str, ops, rows: int = 1) -> dict:
    """{candidate: a call of one layer of `shape` on `rows` rows}; zero weights (the time does not depend on them)."""
    out, inp = shape
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    linear = GemvLinear(inp, out, dtype=dtype, device="meta")  # (no initial values drawn; nor to_empty, which imports sympy)
    linear.weight = nn.Parameter(torch.zeros(out, inp, dtype=dtype), requires_grad=False)
    linear.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False)
    if precision == "int8":
        layer, kernel = Int8Linear(linear, dtype), None if ops is None else ops.gemv_q8
    elif precision == "int4":
        layer, kernel = Int4Linear(linear, dtype=dtype), None if ops is None else ops.gemv_q4
    else:
        layer, kernel = linear, None if ops is None else ops.gemv
    if precision == "int4" and inp % layer.group_size:
        return {}
    x = torch.randn(rows, inp).to(dtype)

    def run(gemv):
        def call():
            layer.gemv = gemv
            if isinstance(layer, (GemvLinear, Int4Linear)):
                layer.max_rows = rows
            layer(x)
        return call

    candidates = {"torch": run(None)}
    if kernel is not None:
        candidates["glassgpt"] = run(kernel)
    return candidates


def gelu_candidates(cfg: GPTConfig, precision: str, ops) -> dict:
    """{candidate: GELU's tanh form over a prompt's feed-forward activations, [min(512, context), 4 x emb_dim]}."""
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    x = torch.randn(min(512, cfg.context_length), 4 * cfg.emb_dim).to(dtype)
    return {"torch": lambda: F.gelu(x, approximate="tanh"), "glassgpt": lambda: ops.gelu_tanh(x)}


def attention_candidates(cfg: GPTConfig, precision: str) -> dict:
    """{"decode": {path: call}, "prompt": {path: call}} on random queries and keys of the model's head shape."""
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    h, hd = cfg.n_heads, cfg.head_dim
    out = {}
    for kind, t, s in (("decode", 1, min(256, cfg.context_length)), ("prompt", min(512, cfg.context_length), None)):
        q = torch.randn(1, h, t, hd).to(dtype)
        k, v = torch.randn(1, h, s or t, hd).to(dtype), torch.randn(1, h, s or t, hd).to(dtype)
        out[kind] = {path: (lambda p=path, q=q, k=k, v=v: attend(q, k, v, 0.0, p, p)) for path in PATHS}
    return out


@torch.inference_mode()
def measure(choices: Choices, decision: str, candidates: dict, budget_s: float = BUDGET_S,
            min_repeats: int = 3) -> None:
    """Time the candidates round-robin (a busy machine slows each alike); keep the fastest. A decision measured
    before and left unsettled keeps each candidate's least disturbed time of all its measurements (SETTLED_LEAD)."""
    if not candidates:
        return
    for call in candidates.values():
        call()  # first calls: page faults, the kernel's one-time set-up
    start = time.perf_counter()
    next(iter(candidates.values()))()
    once = max(time.perf_counter() - start, 1e-6)
    repeats = max(min_repeats, min(50, int(budget_s / once)))
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, call in candidates.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    ms = {name: min(ts) * 1e3 for name, ts in times.items()}  # the least disturbed run
    choices.measured.add(decision)
    tries = choices.unsettled.pop(decision, 0) + 1
    if tries > 1:
        earlier = choices.ms.get(decision, {})
        ms = {name: min(t, earlier.get(name, t)) for name, t in ms.items()}
    choices.ms[decision] = ms
    choices.winners[decision] = winner = min(ms, key=ms.get)
    runner_up = min((t for name, t in ms.items() if name != winner), default=float("inf"))
    steady = all(statistics.median(ts) <= STEADY * min(ts) for ts in times.values())
    if tries < TRIES and not (steady and runner_up >= SETTLED_LEAD * ms[winner]):
        choices.unsettled[decision] = tries


def _read(path: Path) -> dict:
    """The cache file's entries that are what glassgpt writes; the rest is left out, with one CacheWarning
    naming the file (per process and file), so that its decisions are measured again."""
    try:
        if path.stat().st_size > MAX_CACHE_BYTES:
            return _untrusted(path, f"is {path.stat().st_size:,} bytes, more than the {MAX_CACHE_BYTES:,} a cache holds")
        data = json.loads(path.read_bytes())
    except (FileNotFoundError, NotADirectoryError):  # (nothing kept yet; _write says it if it cannot keep it)
        return {}
    except OSError as e:
        return _untrusted(path, f"cannot be read ({e.strerror or e})")
    except ValueError:  # (UnicodeDecodeError too)
        return _untrusted(path, "is not JSON (cut short?)")
    if not isinstance(data, dict):
        return _untrusted(path, f"holds a JSON {type(data).__name__}, not the object of entries glassgpt writes")
    entries = {key: value for key, value in data.items() if _entry_problem(value) is None}
    if len(entries) < len(data):
        bad = next(key for key in data if key not in entries)
        _untrusted(path, f"has {len(data) - len(entries)} entries that are not what glassgpt writes "
                         f"({_entry_problem(data[bad])} in {bad!r})")
    return entries


def _entry_problem(entry) -> str | None:
    """None where `entry` is as `save` writes it: winners among CANDIDATES, each with its time in ms, times that
    are non-negative numbers, counts of measurements that are whole numbers."""
    if not isinstance(entry, dict) or not isinstance(entry.get("winners"), dict) or not isinstance(entry.get("ms"), dict):
        return "no winners and times"
    ms, unsettled = entry["ms"], entry.get("unsettled", {})
    for decision, times in ms.items():
        if not isinstance(times, dict) or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                                  and math.isfinite(t) and t >= 0 for t in times.values()):
            return f"a time of {decision!r} that is not a number of milliseconds"
    for decision, winner in entry["winners"].items():
        if winner not in CANDIDATES or winner not in ms.get(decision, {}):
            return f"a winner of {decision!r} that was not measured"
    if not isinstance(unsettled, dict) or not all(type(n) is int for n in unsettled.values()):
        return "counts of measurements that are not whole numbers"
    return None


_noted: set[tuple[str, str]] = set()  # (file, what): each note once per process


def _untrusted(path: Path, problem: str, then: str = "measuring again what it held") -> dict:
    if (str(path), problem) not in _noted:
        _noted.add((str(path), problem))
        warnings.warn(f"{path} {problem}: {then}", CacheWarning, stacklevel=3)
    return {}


def _write(path: Path, key: str, value: dict) -> None:
    """Add one entry to the cache file, atomically (another process may be reading it); a cache that cannot be
    written is no error, but one CacheWarning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = value
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            try:
                json.dump(data, f, indent=1)
            except BaseException:
                f.close()
                os.unlink(f.name)
                raise
        os.replace(f.name, path)
    except OSError as e:
        _untrusted(path, f"cannot be written ({e.strerror or e})",
                   "each process measures the kernels again; set XDG_CACHE_HOME to a folder that can be")
