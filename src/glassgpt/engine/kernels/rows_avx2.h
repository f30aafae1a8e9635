#pragma once
// The AVX2 inner loops of the float matrix-vector products (gemv.h has the AVX-512 ones): R rows of W against MB
// rows of x, summed in float32, for float32 weights and for bfloat16 weights read two to a 32-bit lane. Shared by
// gemv_avx2.cpp (the products as PyTorch operators) and described_step.cpp (a whole decoding step).
#include <immintrin.h>

#include "rows.h"

namespace avx2 {

// The first `left` of 8 lanes (all 8 when left >= 8), for the masked loads of a row's last columns.
inline __m256i tail8(int64_t left) {
    const int n = left >= 8 ? 8 : (int)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R rows of float32 W against MB rows of x (row stride ldx): out[m][r] = W[r] . x[m].
template <int R, int MB>
void f32_rows(const float* W, const float* x, int64_t K, int64_t ldx, float (*out)[4]) {
    __m256 acc[MB][R];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) w[r] = _mm256_loadu_ps(W + r * K + k);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(w[r], xv, acc[m][r]);
        }
    }
    if (k < K) {  // the last K % 8 columns, masked
        const __m256i mask = tail8(K - k);
        __m256 w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) w[r] = _mm256_maskload_ps(W + r * K + k, mask);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            const __m256 xv = _mm256_maskload_ps(x + m * ldx + k, mask);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(w[r], xv, acc[m][r]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) out[m][r] = hsum(acc[m][r]);
}

// bfloat16 weights: a 256-bit load holds 16 of them, two to a 32-bit lane, and the lane's two halves are each
// a float32 in its own right once moved to the top (a shift for the even column, a mask for the odd one): no
// widening shuffle. x is widened once and laid out to match (`widen_pairs`): in each block of 16 columns, its
// 8 even columns, then its 8 odd ones. The last K % 16 columns are summed one at a time.
template <typename T>
inline void widen_pairs(const T* x, float* xf, int64_t K) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 8; j++) {
            xf[k + j] = load1(x, k + 2 * j);
            xf[k + 8 + j] = load1(x, k + 2 * j + 1);
        }
    for (; k < K; k++) xf[k] = load1(x, k);
}

// How far ahead of each row the bfloat16 loop asks for its weights: a core streaming half as many bytes per FMA as
// float32's does not keep enough reads in flight on its own (benchmarks/RESULTS.md: 8.5 -> 11.5 GB/s on one core
// of a Zen 3 EPYC; float32's loop gained nothing from it).
#define BF16_PREFETCH 4096

template <int R, int MB>
void bf16_rows(const bf16* W, const float* x, int64_t K, int64_t ldx, float (*out)[4]) {
    __m256 acc[MB][R];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[m][r] = _mm256_setzero_ps();
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 even_w[R], odd_w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char*)(W + r * K + k) + BF16_PREFETCH, _MM_HINT_T0);
            const __m256i w = _mm256_loadu_si256((const __m256i*)(W + r * K + k));
            even_w[r] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
            odd_w[r] = _mm256_castsi256_ps(_mm256_and_si256(w, odd));
        }
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            const __m256 xe = _mm256_loadu_ps(x + m * ldx + k), xo = _mm256_loadu_ps(x + m * ldx + k + 8);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[m][r] = _mm256_fmadd_ps(odd_w[r], xo, _mm256_fmadd_ps(even_w[r], xe, acc[m][r]));
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            float v = hsum(acc[m][r]);
            for (int64_t j = k; j < K; j++) v += bf16_to_f32(W[r * K + j]) * x[m * ldx + j];
            out[m][r] = v;
        }
}

}  // namespace avx2
