"""The AVX2 build of glassgpt's float matrix-vector products (engine/kernels/gemv_avx2.cpp, native.gemv_ops).

On a CPU with AVX2 and FMA but no AVX-512 the whole kernels cannot run; this build, `gemv` alone, is what
decoding there is made of. Its products are checked against F.linear in a child process that takes the CPU for
an AVX2-only one, so that an AVX-512 host (CI's) builds and tests it too; then the decoding twin that runs it.
Tolerances: float32 within 1e-5 of each row's largest |output|; bfloat16 within one rounding to bfloat16 of the
float32 sum (2^-8 relative) plus that.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from glassgpt.engine import autotune, native

from conftest import needs_gemv

CHILD = r"""
import json, sys, warnings
import torch
import torch.nn.functional as F
from glassgpt.engine import native
warnings.simplefilter("ignore")
ops = native.gemv_ops(flags=frozenset({"avx2", "fma", "sse4_2"}))
out = {"status": native.gemv_status(), "whole": native.status(), "rows": []}
if ops is not None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    for M, N, K, bias in json.loads(sys.argv[1]):
        for dtype in (torch.float32, torch.bfloat16):
            x, W = torch.randn(M, K).to(dtype), torch.randn(N, K).to(dtype)
            b = torch.randn(N).to(dtype) if bias else None
            y = ops.gemv(x, W, b).double()
            ref = F.linear(x.double(), W.double(), None if b is None else b.double())
            scale = ref.abs().amax(dim=1, keepdim=True)
            room = 1e-5 * scale + (2 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)
            out["rows"].append([M, N, K, bias, str(dtype), float(((y - ref).abs() / room).max())])
print(json.dumps(out))
"""

# Shapes with every tail: K not a multiple of 8 or 16, N not a multiple of 4, M from 1 to GEMV_MAX_ROWS (8),
# past MAXM (4), and the widths of the book's models (GPT-2's 768, Gemma 3's 640 and its 262,144-wide head cut).
SHAPES = [(1, 7, 13, True), (1, 5, 9, False), (2, 5, 17, True), (1, 6, 31, False), (3, 1000, 640, True),
          (4, 33, 48, False), (5, 4, 9, True), (8, 33, 2048, True), (1, 4096, 768, False), (1, 8192, 640, False)]


@pytest.fixture(scope="module")
def child():
    needs_gemv()  # (skips, or fails under GLASSGPT_REQUIRE_GEMV=1, where no build can be had here at all)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(SHAPES)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_avx2_build_loads_where_the_cpu_lacks_avx512(child):
    assert child["whole"].startswith("this CPU lacks avx512f"), child["whole"]
    assert "glassgpt's AVX2 gemv" in child["whole"]  # the note says which products still run glassgpt's
    assert child["status"].startswith("the AVX2 build of the float products"), child["status"]
    assert "glassgpt_gemv_avx2-" in child["status"]


@pytest.mark.parametrize("i", range(2 * len(SHAPES)))
def test_the_avx2_products_equal_f_linear(child, i):
    M, N, K, bias, dtype, worst = child["rows"][i]
    assert worst <= 1.0, f"{dtype} [{M}x{K}] @ [{N}x{K}].T (bias {bias}): {worst:.2f}x the tolerance"


def test_a_cpu_without_avx2_has_no_gemv_and_says_why(tmp_path):
    assert native.avx2_flags(frozenset({"sse4_2", "fma"})) is None
    assert native.avx2_flags(frozenset({"avx2", "fma"})) == ["-mavx2", "-mfma"]
    code = ("import warnings; warnings.simplefilter('ignore'); from glassgpt.engine import native; "
            "print(native.gemv_ops(flags=frozenset({'sse4_2'})) is None); print(native.gemv_status())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    none, status = done.stdout.strip().splitlines()
    assert none == "True" and status == "this CPU lacks avx2, fma; PyTorch's own operators run instead", status


def test_float_precisions_offer_the_gemv_and_the_quantized_ones_only_the_whole_kernels():
    ops = needs_gemv()
    for precision in ("float32", "bfloat16"):
        assert autotune.kernels_for(precision) is ops
        assert set(autotune.linear_candidates((64, 32), precision, ops)) == {"torch", "glassgpt"}
    if native.load() is None:  # an AVX2 host: int8 and int4 have no AVX2 kernel
        assert autotune.kernels_for("int8") is None and autotune.kernels_for("int4") is None


def test_a_missing_compiler_is_said_once_not_once_per_build(monkeypatch):
    monkeypatch.setattr(native, "_load", lambda flags, directory: None)
    monkeypatch.setattr(native, "_status", "no C++ compiler (g++) found: install one; PyTorch's own operators run instead")

    def no_compiler(flags, directory):
        native._gemv_status = native._status
        return None
    monkeypatch.setattr(native, "_load_gemv", no_compiler)
    native._load_once.cache_clear()
    native._gemv_once.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert native.gemv_ops() is None
        assert [str(w.message) for w in said] == [
            "glassgpt's CPU kernels are not used: no C++ compiler (g++) found: install one; PyTorch's own "
            "operators run instead"]
    finally:
        native._load_once.cache_clear()
        native._gemv_once.cache_clear()
