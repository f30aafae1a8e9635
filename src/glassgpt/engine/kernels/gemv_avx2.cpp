// The float matrix-vector products for a CPU with AVX2 and FMA but no AVX-512 (an AMD EPYC of the Zen 3
// generation, most laptops): gemv.cpp's float32 and bfloat16 kernels, 8 lanes wide instead of 16. native.py
// builds this file alone, with ops.cpp's gemv operator (GG_GEMV_ONLY), where the AVX-512 kernels cannot
// run; the int8 and 4-bit kernels and the native step have no AVX2 build.
//
// Why it exists: on such a CPU PyTorch's one-row product (MKL's sgemv) streams a float32 weight on one
// core, at about half of what the memory gives two (benchmarks/RESULTS.md), and decoding is that product.
// The loops are gemv.h's: each OpenMP thread streams its contiguous share of W's rows, 4 rows at a time,
// against up to 4 rows of x held in L1, summed in float32; then one horizontal sum per row.
#include "rows_avx2.h"

using namespace avx2;

extern "C" {

// Bit 2: this is the AVX2 build (gemv alone); ops.cpp then widens bfloat16 weights (no vdpbf16ps).
int gg_features(void) { return 4; }

// y [M, N] = x [M, K] @ W [N, K].T + b
void gg_gemv_f32(const float* W, const float* x, const float* b, float* y, int64_t M, int64_t N, int64_t K, int nt) {
#pragma omp parallel num_threads(nt)
    row_loop(N, M,
             [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
                 f32_rows<R.value, MB.value>(W + n * K, x + m0 * K, K, K, out);
             },
             [&](int64_t m, int64_t n, float v) { y[m * N + n] = v + (b ? b[n] : 0.f); });
}

// Never called (gg_features() has no bit 1); defined so that ops.cpp links alike in both builds.
void gg_gemv_bf16(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t, int) {}

// xf: a float32 scratch of M * K, filled here with x widened (widen_pairs' order).
void gg_gemv_bf16_widen(const bf16* W, const bf16* x, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K,
                        float* xf, int nt) {
    for (int64_t m = 0; m < M; m++) widen_pairs(x + m * K, xf + m * K, K);
#pragma omp parallel num_threads(nt)
    row_loop(N, M,
             [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
                 bf16_rows<R.value, MB.value>(W + n * K, xf + m0 * K, K, K, out);
             },
             [&](int64_t m, int64_t n, float v) { y[m * N + n] = f32_to_bf16(v + (b ? bf16_to_f32(b[n]) : 0.f)); });
}

}  // extern "C"
