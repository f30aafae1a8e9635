// The matrix-vector products as C functions (ops.cpp makes them torch operators); their loops are in
// gemv.h.
#include "gemv.h"

extern "C" {

// Bit 0: AVX512-VNNI (vpdpwssd in q8, vpdpbusd in q4), bit 1: AVX512-BF16 (gg_gemv_bf16 exists).
int gg_features(void) {
    int f = 0;
#ifdef __AVX512VNNI__
    f |= 1;
#endif
#ifdef __AVX512BF16__
    f |= 2;
#endif
    return f;
}

// y [M, N] = x [M, K] @ W [N, K].T + b
void gg_gemv_f32(const float* W, const float* x, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                 int nt) {
#pragma omp parallel num_threads(nt)
    row_loop(N, M,
             [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
                 float_rows<F32, R.value, MB.value>(W + n * K, x + m0 * K, K, K, out);
             },
             [&](int64_t m, int64_t n, float v) { y[m * N + n] = v + (b ? b[n] : 0.f); });
}

#ifdef __AVX512BF16__
void gg_gemv_bf16(const bf16* W, const bf16* x, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K,
                  int nt) {
#pragma omp parallel num_threads(nt)
    row_loop(N, M,
             [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
                 float_rows<BF16, R.value, MB.value>(W + n * K, x + m0 * K, K, K, out);
             },
             [&](int64_t m, int64_t n, float v) { y[m * N + n] = f32_to_bf16(v + (b ? bf16_to_f32(b[n]) : 0.f)); });
}
#else
// Never called (ops.cpp asks gg_features() first); defined so that every build links alike.
void gg_gemv_bf16(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t, int) {}
#endif

// xf: a float32 scratch of M * K, filled here with x widened.
void gg_gemv_bf16_widen(const bf16* W, const bf16* x, const bf16* b, bf16* y, int64_t M, int64_t N, int64_t K,
                        float* xf, int nt) {
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
#pragma omp parallel num_threads(nt)
    row_loop(N, M,
             [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
                 float_rows<BF16Widened, R.value, MB.value>(W + n * K, xf + m0 * K, K, K, out);
             },
             [&](int64_t m, int64_t n, float v) { y[m * N + n] = f32_to_bf16(v + (b ? bf16_to_f32(b[n]) : 0.f)); });
}

}  // extern "C"

template <typename T>
static void q8_gemv(const int8_t* W, const T* scales, const T* x, const T* b, T* y, int64_t M, int64_t N,
                    int64_t K, int16_t* xq, float* xs, int nt) {
    quantize_rows(x, M, K, xq, xs);
#pragma omp parallel num_threads(nt)
    row_loop(N, M,
             [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
                 q8_rows<R.value, MB.value>(W + n * K, xq + m0 * K, K, K, out);
             },
             [&](int64_t m, int64_t n, float v) {
                 store1(y, m * N + n, v * xs[m] * load1(scales, n) + (b ? load1(b, n) : 0.f));
             });
}

extern "C" {

// int8 weights with per-row scales; x, b, y and scales in float32 (is_bf16 = 0) or bfloat16.
// xq: an int16 scratch of M * K; xs: a float scratch of M.
void gg_gemv_q8(const int8_t* W, const void* scales, const void* x, const void* b, void* y, int64_t M, int64_t N,
                int64_t K, int is_bf16, int16_t* xq, float* xs, int nt) {
    if (is_bf16)
        q8_gemv((const int8_t*)W, (const bf16*)scales, (const bf16*)x, (const bf16*)b, (bf16*)y, M, N, K, xq, xs, nt);
    else
        q8_gemv((const int8_t*)W, (const float*)scales, (const float*)x, (const float*)b, (float*)y, M, N, K, xq, xs, nt);
}

}  // extern "C"

#define Q4_MAXM 8

template <typename T>
static void q4_gemv(const uint8_t* P, const T* sm, const T* x, const T* b, T* y, int64_t M, int64_t N, int64_t K,
                    int64_t gs, int8_t* xq, float* xscale, float* xsum, int nt) {
    if (gs % 16 == 0)  // x rounded to int8 (16 columns an instruction: a few microseconds for a prompt)
        quantize_groups16(x, 0, M, K, gs, xq, xscale, xsum);
    else
        quantize_groups(x, M, K, gs, xq, xscale, xsum);
    const int64_t G = K / gs, NB = (N + 15) / 16;
#pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        share(NB, &lo, &hi);
        for (int64_t nb = lo; nb < hi; nb++) {
            const uint8_t* P_nb = P + nb * (K / 8) * 64;
            const T* sm_nb = sm + nb * G * 32;
            for (int64_t m0 = 0; m0 < M; m0 += Q4_MAXM) {
                int64_t mb = M - m0 < Q4_MAXM ? M - m0 : Q4_MAXM;
                __m512 out[Q4_MAXM];
                const int8_t* xq0 = xq + m0 * K;
                const float *xs0 = xscale + m0 * G, *xsum0 = xsum + m0 * G;
                switch (mb) {
                    case 1: q4_block<T, 1>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                    case 2: q4_block<T, 2>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                    case 3: q4_block<T, 3>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                    case 4: q4_block<T, 4>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                    case 5: q4_block<T, 5>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                    case 6: q4_block<T, 6>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                    case 7: q4_block<T, 7>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                    default: q4_block<T, 8>(P_nb, sm_nb, xq0, xs0, xsum0, K, gs, out); break;
                }
                for (int64_t m = 0; m < mb; m++) {
                    float v[16];
                    _mm512_storeu_ps(v, out[m]);
                    for (int j = 0; j < 16 && nb * 16 + j < N; j++) {
                        int64_t n = nb * 16 + j;
                        store1(y, (m0 + m) * N + n, v[j] + (b ? load1(b, n) : 0.f));
                    }
                }
            }
        }
    }
}

extern "C" {

// xq: an int8 scratch of M * K; xscale, xsum: float scratches of M * K / gs.
void gg_gemv_q4(const uint8_t* P, const void* sm, const void* x, const void* b, void* y, int64_t M, int64_t N,
                int64_t K, int64_t gs, int is_bf16, int8_t* xq, float* xscale, float* xsum, int nt) {
    if (is_bf16)
        q4_gemv(P, (const bf16*)sm, (const bf16*)x, (const bf16*)b, (bf16*)y, M, N, K, gs, xq, xscale, xsum, nt);
    else
        q4_gemv(P, (const float*)sm, (const float*)x, (const float*)b, (float*)y, M, N, K, gs, xq, xscale, xsum, nt);
}

}  // extern "C"

// GELU (tanh form, gelu16) of n values, float32 or bfloat16 (computed in float32, rounded once).
template <typename T>
static void gelu_tanh(const T* x, T* y, int64_t n, int nt) {
#pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        share((n + 15) / 16, &lo, &hi);
        for (int64_t i = lo * 16; i < hi * 16 && i < n; i += 16) {
            const __mmask16 mask = tail16(n - i);
            if constexpr (std::is_same_v<T, float>) {
                _mm512_mask_storeu_ps(y + i, mask, gelu16(_mm512_maskz_loadu_ps(mask, x + i)));
            } else {
                const __m512 v = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x + i)), 16));
                _mm256_mask_storeu_epi16(y + i, mask, round16_bf16(gelu16(v)));
            }
        }
    }
}

extern "C" {

void gg_gelu_tanh(const void* x, void* y, int64_t n, int is_bf16, int nt) {
    if (is_bf16)
        gelu_tanh((const bf16*)x, (bf16*)y, n, nt);
    else
        gelu_tanh((const float*)x, (float*)y, n, nt);
}

}  // extern "C"
