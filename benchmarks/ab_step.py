"""Two builds of the native decoding step, or the same weights on 4 KB and on 2 MB pages, in one process.

This host's memory speed moves by 20-40% within minutes, so two fresh processes timed one after the
other cannot tell a 5% change from the weather. Here both sides run in one process, step by step in
alternation (A B B A ...), and the figure is the median of the paired ratios; both sides' logits are
compared with torch.equal (an old kernel and a new one that sums the same way give the same bits).

    # kernels: the step as it is in another checkout (or a copy of engine/kernels) against this one
    flock /tmp/glassgpt-bench.lock python benchmarks/ab_step.py kernels OLD_KERNELS_DIR [--precisions f32 bf16 int8 int4]
    # pages: this checkout's step on the weights as loaded, and on a copy moved by engine/pages.py
    flock /tmp/glassgpt-bench.lock python benchmarks/ab_step.py pages [--precisions ...]
    # prompt: gemv.cpp's products of a short prompt's rows (the prefill before the first step), two builds
    flock /tmp/glassgpt-bench.lock python benchmarks/ab_step.py prompt OLD_KERNELS_DIR [--rows 16] [--precisions int8 f32]

`kernels` compiles step.cpp and family_step.cpp of each directory into a library of its own (no torch
operators: the step is a plain C function) and points a NativeStep at each in turn.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from glassgpt.config import PRESETS  # noqa: E402
from glassgpt.engine import KVCache, native, pages, quantize_int4, quantize_int8  # noqa: E402
from glassgpt.engine.step import NativeStep  # noqa: E402
from glassgpt.formats import random_model  # noqa: E402


def build(kernels: Path, out: Path) -> ctypes.CDLL:
    """step.cpp and family_step.cpp of `kernels`, built as native.py builds them, into `out`."""
    isa = native.isa_flags(native.cpu_flags())
    flags = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", *isa]
    objects = []
    for name in ("step", "family_step"):
        objects.append(str(out / f"{name}.o"))
        subprocess.run(["g++", *flags, "-c", str(kernels / f"{name}.cpp"), "-o", objects[-1]], check=True)
    subprocess.run(["g++", "-shared", "-fopenmp", *objects, "-o", str(out / "step.so")], check=True)
    lib = ctypes.CDLL(str(out / "step.so"))
    lib.gg_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.gg_step.restype = None
    return lib


def build_gemv(kernels: Path, out: Path) -> ctypes.CDLL:
    """gemv.cpp of `kernels` alone (its C functions, no torch operators), built as native.py builds it."""
    isa = native.isa_flags(native.cpu_flags())
    subprocess.run(["g++", "-O3", "-std=c++17", "-fPIC", "-fopenmp", *isa, "-shared", str(kernels / "gemv.cpp"),
                    "-o", str(out / "gemv.so")], check=True)
    return ctypes.CDLL(str(out / "gemv.so"))


def prompt_products(libs: dict[str, ctypes.CDLL], rows: int, rounds: int, kind: str = "int4") -> None:
    """gpt2's four product shapes (q/k/v, output, up, down) of `kind` (int4, int8 or f32 weights) on `rows` rows
    of x, each library in turn."""
    from glassgpt.engine import Int4Linear, Int8Linear
    torch.manual_seed(0)
    shapes = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]
    make = {"int4": lambda k, n: Int4Linear(torch.nn.Linear(k, n), dtype=torch.float32),
            "int8": lambda k, n: Int8Linear(torch.nn.Linear(k, n), torch.float32),
            "f32": lambda k, n: torch.nn.Linear(k, n).requires_grad_(False)}[kind]
    layers = [make(k, n) for k, n in shapes]
    xs = [torch.randn(rows, k) for k, _ in shapes]
    threads = torch.get_num_threads()

    def ptr(*ts):
        return [ctypes.c_void_p(t.data_ptr()) for t in ts]

    def product(lib, layer, x, y, k, n):
        ints = [ctypes.c_int64(v) for v in (rows, n, k)]
        if kind == "int4":
            xq, xscale, xsum = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, k // 32), torch.empty(rows, k // 32)
            lib.gg_gemv_q4(*ptr(layer.packed, layer.scales_mins, x, layer.bias, y), *ints, ctypes.c_int64(32),
                           ctypes.c_int(0), *ptr(xq, xscale, xsum), ctypes.c_int(threads))
        elif kind == "int8":
            xq, xs = torch.empty(rows, k, dtype=torch.int16), torch.empty(rows)
            lib.gg_gemv_q8(*ptr(layer.weight, layer.scales, x, layer.bias, y), *ints, ctypes.c_int(0), *ptr(xq, xs),
                           ctypes.c_int(threads))
        else:
            lib.gg_gemv_f32(*ptr(layer.weight, x, layer.bias, y), *ints, ctypes.c_int(threads))

    def block(lib) -> tuple[float, list[torch.Tensor]]:
        outs, start = [], time.perf_counter()
        for (k, n), layer, x in zip(shapes, layers, xs):
            y = torch.empty(rows, n)
            product(lib, layer, x, y, k, n)
            outs.append(y)
        return time.perf_counter() - start, outs

    times: dict[str, list[float]] = {n: [] for n in libs}
    last = {}
    for r in range(rounds):
        for name in list(libs) if r % 2 else list(libs)[::-1]:
            t, last[name] = block(libs[name])
            times[name].append(t)
    a, b = (times[n][rounds // 10:] for n in libs)
    ratio = statistics.median(x / y for x, y in zip(a, b))
    equal = all(torch.equal(x, y) for x, y in zip(*last.values()))
    print(f"gpt2 {kind}, one block's products on {rows} rows: old {statistics.median(a) * 1e3:.3f} ms, new "
          f"{statistics.median(b) * 1e3:.3f} ms; old / new paired median {ratio:.3f}; outputs equal: {equal}")


PRECISIONS = ["f32", "bf16", "int8", "int4"]


def model_at(precision: str) -> torch.nn.Module:
    dtype = torch.float32 if precision == "f32" else torch.bfloat16
    model = random_model(PRESETS["gpt2"], torch.device("cpu"), torch.float32).to(dtype).eval()
    return {"int8": quantize_int8, "int4": quantize_int4}.get(precision, lambda m: m)(model)


def alternate(steps: dict[str, tuple[NativeStep, KVCache]], rounds: int,
              batch: int = 1) -> tuple[dict[str, float], float, bool]:
    """Median seconds of each side, the median of the paired ratios A/B, and whether the logits are equal."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    last: dict[str, torch.Tensor] = {}
    token = torch.zeros(batch, dtype=torch.long)
    for _, cache in steps.values():  # positions 0..99 hold zeros on both sides, not what each allocation held
        for t in (*cache.k, *cache.v):
            t.zero_()
    for r in range(rounds):
        for name in names if r % 2 else names[::-1]:
            step, cache = steps[name]
            cache.pos = 100  # the same position every time: the same work
            start = time.perf_counter()
            out = step(token)
            times[name].append(time.perf_counter() - start)
            last[name] = out.clone()
    warm = rounds // 10
    a, b = (times[n][warm:] for n in names)
    ratio = statistics.median(x / y for x, y in zip(a, b))
    equal = torch.equal(last[names[0]], last[names[1]])
    return {n: statistics.median(times[n][warm:]) for n in names}, ratio, equal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["kernels", "pages", "prompt"])
    p.add_argument("old", nargs="?", help="kernels: the directory of the kernels to compare against")
    p.add_argument("--precisions", nargs="+", default=PRECISIONS, help="prompt: int4 (the default), int8, f32")
    p.add_argument("--rounds", type=int, default=120)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=16, help="prompt: the rows of x (a prompt's tokens)")
    p.add_argument("--batch", type=int, default=1, help="kernels, pages: sequences decoded together (1 to 8)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if native.library() is None:
        sys.exit(f"the native step does not run here: {native.status()}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        if args.what in ("prompt", "kernels"):  # the other directory's build and this one's
            if not args.old:
                sys.exit(f"{args.what}: give the directory of the kernels to compare against")
            for side, src in (("old", Path(args.old)), ("new", Path(native.SOURCES))):
                (Path(tmp) / side).mkdir()
                libs[side] = (build_gemv if args.what == "prompt" else build)(src, Path(tmp) / side)
        if args.what == "prompt":
            for kind in args.precisions if args.precisions != PRECISIONS else ["int4"]:
                prompt_products(libs, args.rows, args.rounds, kind)
            return
        for precision in args.precisions:
            model = model_at(precision)
            dtype = model.tok_emb.weight.dtype
            if args.what == "kernels":
                steps = {}
                for side in ("old", "new"):
                    cache = KVCache(model.cfg, args.batch, 256, dtype=dtype)
                    step = NativeStep(model, cache)
                    step.lib = libs[side]
                    steps[side] = (step, cache)
            else:
                moved = copy.deepcopy(model)
                if pages.move_to_large_pages(moved) == 0:
                    sys.exit(f"no 2 MB pages here (transparent huge pages: {pages.mode()})")
                steps = {"4 KB": (NativeStep(model, c := KVCache(model.cfg, args.batch, 256, dtype=dtype)), c),
                         "2 MB": (NativeStep(moved, c2 := KVCache(model.cfg, args.batch, 256, dtype=dtype)), c2)}
            medians, ratio, equal = alternate(steps, args.rounds, args.batch)
            a, b = steps
            print(f"gpt2 {precision}, batch {args.batch}: {a} {medians[a] * 1e3:.2f} ms, {b} {medians[b] * 1e3:.2f} ms a step; "
                  f"{a} / {b} paired median {ratio:.3f}; logits equal: {equal}", flush=True)


if __name__ == "__main__":
    main()
