"""What every benchmark shares: the machine, timing, the same weights in both models, the table.

Each benchmark builds glassgpt's model and Hugging Face's GPT2LMHeadModel in one
process from the same random weights (ours exported through `weights.hf_state_dict`,
the mapping users run), times both on the same inputs, and prints medians and the
ratio to the reference. Nothing here is imported by the package.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch

from glassgpt.config import PRESETS, GPTConfig
from glassgpt.device import cpu_flags
from glassgpt.formats import random_model
from glassgpt.formats.hf import config_to_hf, hf_state_dict

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def common_args(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="gpt2", choices=list(PRESETS), help="preset shape (random weights)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per row (the median is reported)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face reference rows")
    p.add_argument("--compile", action="store_true", help="also time torch.compile'd glassgpt rows")
    return p


def setup(args: argparse.Namespace) -> torch.device:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    print(machine_info(device))
    return device


def machine_info(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni") if f in flags)
    load = f"; load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    lines = [f"machine: {cpu}, {os.cpu_count()} logical cores ({isa}); torch {torch.__version__} "
             f"with {torch.get_num_threads()} threads; python {platform.python_version()}"]
    try:
        import transformers
        lines[0] += f"; transformers {transformers.__version__}"
    except ImportError:
        pass
    lines[0] += load
    if device.type == "cuda":
        lines.append(f"device: {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}")
    return "\n".join(lines)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` over `repeats` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_rows(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int = 5,
              warmup: int = 1, copy: CopyMeter | None = None) -> dict[str, float]:
    """Median seconds of each configuration, timed round-robin (A, B, C, A, B, C, ...), so
    that other work on a shared machine slows every row alike instead of one row. With `copy`,
    the memory's copy rate is measured right before and right after every timed run (untimed)."""
    for name, fn in fns.items():
        start = time.perf_counter()
        for _ in range(warmup):
            fn()
        sync(device)
        if warmup and time.perf_counter() - start > 20:
            print(f"  (warm-up of {name!r} took {time.perf_counter() - start:.0f} s: compilation)")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in fns if copy else ():
        copy.runs.pop(name, None)  # a row's share is that of its latest timing
    for _ in range(repeats):
        for name, fn in fns.items():
            before = copy.rate() if copy else 0.0
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
            if copy:
                copy.beside(name, times[name][-1], (before + copy.rate()) / 2)
    return {name: statistics.median(ts) for name, ts in times.items()}


class CopyMeter:
    """The memory's copy rate, measured beside each timed run rather than once at a script's start.

    On a shared host the rate moves: 24-45 GB/s within one hour on the AMD EPYC (RESULTS.md), so a share
    taken against a single snapshot can read 61% or 101% for the same kernel. Passed to `time_rows`, it
    times a 256 MB copy (read plus write, as STREAM's copy counts them) right before and right after every
    run; a row's share is then the median over its runs of the rate it read its weights at over the mean
    of the two copies around that run, and the copies' range is printed with it."""

    def __init__(self, device: torch.device, mb: int = 256):
        self.device = device
        self.src = torch.ones(mb * 2**20 // 4, device=device)
        self.dst = torch.empty_like(self.src)
        self.runs: dict[str, list[tuple[float, float]]] = {}  # row -> (its seconds, copy bytes/s beside it)
        self.rate()  # first touch: the pages are faulted in here, not inside the first measurement

    def rate(self) -> float:
        """Bytes per second of the faster of two copies now."""
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            self.dst.copy_(self.src)
            sync(self.device)
            best = min(best, time.perf_counter() - start)
        return 2 * self.src.nbytes / best

    def beside(self, name: str, seconds: float, rate: float) -> None:
        self.runs.setdefault(name, []).append((seconds, rate))

    def note(self, name: str, bytes_per_token: float, tokens: int) -> str:
        """How fast row `name`'s runs read their weights (`bytes_per_token` for each of `tokens` decoding
        steps a run, e.g. `weight_bytes_per_token(model)`), as a share of the copy rate beside each run."""
        runs = self.runs[name]
        per_run = bytes_per_token * tokens
        moved = per_run / statistics.median(s for s, _ in runs)
        share = statistics.median(per_run / s / rate for s, rate in runs)
        rates = [rate for _, rate in runs]
        return (f"weights {moved / 1e9:.1f} GB/s = {share:.0%} of the copy rate beside it "
                f"({min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f} GB/s)")


def matmul_peak(dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """Measured FLOP/s of an n x n @ n x n matmul: the peak that MFU is measured against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if device.type == "cuda":
        n, a, b = 8192, torch.randn(8192, 8192, device=device, dtype=dtype), torch.randn(8192, 8192, device=device, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats=repeats, warmup=2)
    return 2 * n ** 3 / seconds


# --- the same weights in both models -----------------------------------------------

def glass_model(cfg: GPTConfig, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    return random_model(cfg, device, dtype, seed)


def hf_model(ours, dtype: torch.dtype = torch.float32):
    """transformers' GPT2LMHeadModel holding exactly `ours`'s weights, in its best setup (SDPA, KV cache)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(**{k: v for k, v in config_to_hf(ours.cfg).items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        hf = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
    state = {k: v.to(dtype) for k, v in hf_state_dict(ours).items()}
    hf.load_state_dict(state, strict=False, assign=True)
    hf.tie_weights()
    hf = hf.to(device=ours.tok_emb.weight.device, dtype=dtype).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    return hf


def hf_int8(fp32_model):
    """transformers' int8 weight-only route on a CPU (torchao), or None when torchao is absent.

    torchao's `quantize_` (what transformers' TorchAoConfig applies) converts nn.Linear layers
    only, and GPT-2's blocks are transformers' Conv1D (the transposed layout), so as a user
    would run it only the head becomes int8. To give the reference its best, each Conv1D is
    first swapped for the nn.Linear it equals, so that every block matrix is int8 too.
    """
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    model = hf_model(fp32_model, torch.bfloat16)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):  # y = x @ W + b with W [in, out]: nn.Linear holds W.T
                linear = torch.nn.Linear(child.weight.shape[0], child.nf, dtype=child.weight.dtype)
                linear.weight = torch.nn.Parameter(child.weight.detach().t().contiguous(), requires_grad=False)
                linear.bias = torch.nn.Parameter(child.bias.detach(), requires_grad=False)
                setattr(module, name, linear)
    quantize_(model, Int8WeightOnlyConfig())
    return model



def models_at_each_precision(cfg: GPTConfig, device: torch.device, reference: bool = True, int4: bool = False):
    """({(name, precision): model} for glassgpt, the same for transformers), from one set of
    random weights: float32, bfloat16 and (on a CPU) int8 weight-only on each side, and with
    `int4` glassgpt's 4-bit groups (transformers has no CPU int4 route to compare); the
    transformers side is empty without `reference`. The first glassgpt model is float32."""
    fp32 = glass_model(cfg, device, torch.float32)
    ours = {("glassgpt float32", "float32"): fp32,
            ("glassgpt bfloat16", "bfloat16"): glass_model(cfg, device, torch.bfloat16)}
    if device.type == "cpu":
        from glassgpt.engine import quantize_int4, quantize_int8
        ours[("glassgpt int8", "int8")] = quantize_int8(glass_model(cfg, device, torch.float32))
        if int4:
            ours[("glassgpt int4", "int4")] = quantize_int4(glass_model(cfg, device, torch.float32))
    theirs = {}
    if reference:
        theirs = {("HF float32", "float32"): hf_model(fp32, torch.float32),
                  ("HF bfloat16", "bfloat16"): hf_model(fp32, torch.bfloat16)}
        int8 = hf_int8(fp32) if device.type == "cpu" else None
        if int8 is None:
            print("(no transformers int8 row: pip install torchao for its int8 weight-only route)")
        else:
            theirs[("HF int8 (torchao)", "int8")] = int8
    return ours, theirs


# --- the memory-bandwidth limit of decoding -------------------------------------------------

def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """The bytes a batch-1 decoding step must read: every matrix of the blocks and the head (with its
    scales), once; embeddings contribute one row (left out), a tied head counts once as the head."""
    from glassgpt.engine import Int4Linear, Int8Linear
    total = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.weight.nbytes + (m.bias.nbytes if m.bias is not None else 0)
        elif isinstance(m, (Int8Linear, Int4Linear)):
            total += sum(b.nbytes for b in m.buffers(recurse=False)) + (m.bias.nbytes if m.bias is not None else 0)
    return total


# --- the table: two views of the same measurements -------------------------------------

@dataclass
class Row:
    """One measured configuration. `value` is a rate: higher is better."""
    name: str
    value: float
    precision: str            # float32, bfloat16, int8, ...: what the weights and matmuls run in
    compiled: bool = False    # torch.compile
    reference: bool = False   # transformers' (or another reference's) row, not glassgpt's
    note: str = ""


def partner(row: Row, rows: list[Row]) -> Row | None:
    """The like-for-like reference row: same precision, same compile setting."""
    for other in rows:
        if other.reference and other.precision == row.precision and other.compiled == row.compiled:
            return other
    return None


def print_views(title: str, unit: str, rows: list[Row]) -> dict[str, float]:
    """The table with both views, then the summary ratios; returns the summary as numbers.

    Like for like: each glassgpt row against the reference row of the same precision and
    compile setting. Best against best: each side's fastest row, overall and per precision.
    """
    width = max(len(r.name) for r in rows)
    refs = [r for r in rows if r.reference]
    ours = [r for r in rows if not r.reference]
    best_ref = max(refs, key=lambda r: r.value) if refs else None
    print(f"\n{title}")
    print(f"| {'configuration':<{width}} | {unit:>14} | like for like (same precision, same compile) | vs reference's best |")
    print(f"|{'-' * (width + 2)}|{'-' * 15}:|{'-' * 46}|{'-' * 20}:|")
    for r in rows:
        mate = None if r.reference else partner(r, rows)
        same = f"{r.value / mate.value:.2f}x {mate.name}" if mate else ("" if r.reference else "no such reference row")
        vs_best = f"{r.value / best_ref.value:.2f}x" if best_ref else ""
        note = f"  {r.note}" if r.note else ""
        print(f"| {r.name:<{width}} | {r.value:>14,.1f} | {same:<44} | {vs_best:>18} |{note}")
    summary: dict[str, float] = {}
    if best_ref and ours:
        best = max(ours, key=lambda r: r.value)
        summary["best_vs_best"] = best.value / best_ref.value
        print(f"best against best: {best.name} / {best_ref.name} = {summary['best_vs_best']:.2f}x")
        for precision in dict.fromkeys(r.precision for r in ours):
            mine = [r for r in ours if r.precision == precision]
            theirs = [r for r in refs if r.precision == precision]
            if theirs:
                a, b = max(mine, key=lambda r: r.value), max(theirs, key=lambda r: r.value)
                summary[f"{precision}_best_vs_best"] = a.value / b.value
                print(f"  {precision}, each side's best: {a.name} / {b.name} = {a.value / b.value:.2f}x")
    return summary
