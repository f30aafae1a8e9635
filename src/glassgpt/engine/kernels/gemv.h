#pragma once
// The inner loops of glassgpt's matrix-vector products, shared by gemv.cpp (one product per call,
// torch.ops.glassgpt.gemv*) and step.cpp (a whole decoding step per call). Header only: each .cpp
// that includes it is compiled for the CPU's AVX-512 flags by engine/native.py.
//
// Matrix-vector products for decoding on an AVX-512 CPU: y[m] = W x[m] (+ b) for a few rows x[m].
//
// Generating one token reads every weight once and does two flops with it, so a step's time
// is the time to stream the weights from memory. These loops do only that: each thread
// streams its own contiguous slice of W's rows, 4 rows at a time, against the few input rows
// held in L1. No torch headers here: ops.cpp makes these functions torch operators
// (torch.ops.glassgpt.*), and engine/native.py compiles both with the system's g++ at first use.
//
//   f32   W float32 [N, K]                      x, b, y float32
//   bf16  W bfloat16 [N, K]                     x, b, y bfloat16; vdpbf16ps (AVX512-BF16),
//                                               or widened to float32 (AVX-512F only)
//   q8    W int8 [N, K], one scale per row      x, b, y, scales float32 or bfloat16; x rounded
//                                               to int16 (one scale per row of x), int16 x int8
//                                               products summed in int32 (VNNI vpdpwssd, or
//                                               vpmaddwd + vpaddd)
//   q4    W 4-bit in blocks of 16 rows (int4.py's layout), a scale and a minimum per row and
//         group of `gs` columns; x rounded to int8 per group, u4 x int8 products summed in int32
//         (VNNI vpdpbusd, or vpmaddubsw + vpmaddwd)
//
// Each kernel takes `nt`, the number of OpenMP threads (torch's own pool: the process has one
// libgomp), and splits W's rows evenly between them.
#include <immintrin.h>
#include <math.h>

#include "rows.h"

// native.py compiles this file for AVX-512F/BW/VL/DQ, and for AVX512-VNNI and AVX512-BF16 where the
// CPU has them (-mavx512vnni, -mavx512bf16): one build per instruction set, nothing chosen at run
// time in here. gg_features() says what a build holds.

// exp on 16 lanes: 2^n * p(f), x = n ln2 + f, |f| <= ln2 / 2, p of degree 7 (relative error ~1e-7).
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// GELU, tanh form (the book's), on 16 lanes: 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)),
// u = sqrt(2/pi) (x + 0.044715 x^3). The native step's feed-forward and gg_gelu_tanh both use it.
static inline __m512 gelu16(__m512 x) {
    const __m512 c = _mm512_set1_ps(-2.f * 0.7978845608028654f), c3 = _mm512_set1_ps(0.044715f);
    __m512 u = _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(c3, x), _mm512_mul_ps(x, x), x));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(u)));
}

// 16 floats rounded to bfloat16 (to nearest even, NaN kept a NaN), as f32_to_bf16 one at a time.
static inline __m256i round16_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                    _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}



static inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1); }
static inline __mmask32 tail32(int64_t left) { return left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1); }

// ---------------------------------------------------------------------------------------------
// Float products: R rows of W against MB rows of x, STEP columns at a time, summed in float32.
// A kind says how a step's weights and inputs are loaded (masked past the end) and multiplied.

struct F32 {  // float32 weights and inputs: one FMA per 16 products
    static constexpr int STEP = 16;
    using WT = float;
    using XT = float;
    using V = __m512;
    static V load_w(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(tail16(left), p); }
    static V load_x(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(tail16(left), p); }
    static __m512 mac(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};

#ifdef __AVX512BF16__
struct BF16 {  // bfloat16 weights and inputs: vdpbf16ps, 32 products per instruction
    static constexpr int STEP = 32;
    using WT = bf16;
    using XT = bf16;
    using V = __m512i;
    static V load_w(const bf16* p, int64_t left) { return _mm512_maskz_loadu_epi16(tail32(left), p); }
    static V load_x(const bf16* p, int64_t left) { return _mm512_maskz_loadu_epi16(tail32(left), p); }
    static __m512 mac(__m512 acc, V w, V x) {
        // (inline assembly: GCC 12's intrinsic copies the accumulator to another register and back)
        asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
        return acc;
    }
};
#endif

struct BF16Widened {  // bfloat16 weights on AVX-512F alone: each widened to float32 (a shift), x widened once
    static constexpr int STEP = 16;
    using WT = bf16;
    using XT = float;
    using V = __m512;
    static V load_w(const bf16* p, int64_t left) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail16(left), p)), 16));
    }
    static V load_x(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(tail16(left), p); }
    static __m512 mac(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};

template <class D, int R, int MB>
static void float_rows(const typename D::WT* W, const typename D::XT* x, int64_t K, int64_t ldx, float (*out)[4]) {
    __m512 acc[MB][R];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    // Whole steps, then the masked tail in a loop of its own: one loop for both kept the sums on the stack
    // (GCC stored all MB x R of them at every step: a third of the FMA rate, in cache).
    int64_t k = 0;
    for (; k + D::STEP <= K; k += D::STEP) {
        typename D::V w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) w[r] = D::load_w(W + r * K + k, D::STEP);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            typename D::V xv = D::load_x(x + m * ldx + k, D::STEP);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[m][r] = D::mac(acc[m][r], w[r], xv);
        }
    }
    for (; k < K; k += D::STEP) {
        typename D::V w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) w[r] = D::load_w(W + r * K + k, K - k);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            typename D::V xv = D::load_x(x + m * ldx + k, K - k);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[m][r] = D::mac(acc[m][r], w[r], xv);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

// ---------------------------------------------------------------------------------------------
// int8 weights x int16 activations. vpdpwssd adds two int16 x int16 products into each int32
// lane; |w| <= 127 and |x16| <= 32767, so a lane holds 2 * 127 * 32767 * 64 < 2^31 after 64
// steps: the int32 sums are moved into float32 every FLUSH steps.

#define FLUSH 64

// (vpdpwssd as inline assembly, as vdpbf16ps above.)
static inline __m512i dot16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// Columns [k0, k1) of R rows, at most FLUSH steps of 32: int32 sums, then added into acc. (A
// chunk per call, with no flush test inside the loop, keeps every sum in a register.)
template <int R, int MB>
static inline void q8_chunk(const int8_t* W, const int16_t* x, int64_t K, int64_t ldx, int64_t k0, int64_t k1,
                            __m512 (&acc)[MB][R]) {
    __m512i iacc[MB][R];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) iacc[m][r] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 32) {
        __mmask32 mask = tail32(k1 - k);
        __m512i w[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) w[r] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, W + r * K + k));
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) iacc[m][r] = dot16(iacc[m][r], w[r], xv);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_add_ps(acc[m][r], _mm512_cvtepi32_ps(iacc[m][r]));
}

template <int R, int MB>
static void q8_rows(const int8_t* W, const int16_t* x, int64_t K, int64_t ldx, float (*out)[4]) {
    __m512 acc[MB][R];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += FLUSH * 32)
        q8_chunk<R, MB>(W, x, K, ldx, k0, k0 + FLUSH * 32 < K ? k0 + FLUSH * 32 : K, acc);
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

// x [M, K] in T -> int16 [M, K] with one scale per row (|x16| <= 32767); returns via xs.
template <typename T>
static void quantize_rows(const T* x, int64_t M, int64_t K, int16_t* xq, float* xs) {
    for (int64_t m = 0; m < M; m++) {
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(load1(x, m * K + k)));
        float s = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / s;
        for (int64_t k = 0; k < K; k++) xq[m * K + k] = (int16_t)lrintf(load1(x, m * K + k) * inv);
        xs[m] = s;
    }
}


// ---------------------------------------------------------------------------------------------
// 4-bit weights, blocks of 16 rows. Block `nb` holds K/8 units of 64 bytes; unit u, byte 4j + i
// (j < 16 the row in the block, i < 4): low nibble = q[16 nb + j, 8u + i], high nibble =
// q[16 nb + j, 8u + 4 + i]. Masked to bytes, the low nibbles of a unit are, lane by lane, the
// four columns k..k+3 that vpdpbusd multiplies (unsigned q x signed x) with one broadcast
// quadruple of x, so each int32 lane sums one row; the high nibbles take k+4..k+7. The value of a
// weight is q * scale + min, per row and group of gs columns: sm [NB, K/gs, 2, 16] holds the 16
// rows' scales, then their minimums. x is rounded to int8 per group of gs columns (llama.cpp's
// q8_0 does the same per 32), so that a group's sum is sum_k q x8 * scale * xscale + min * sum_k x.

static inline __m512i dot8(__m512i acc, __m512i q, __m512i x) {
#ifdef __AVX512VNNI__
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(q), "v"(x));
    return acc;
#else  // q <= 15 and |x| <= 127: vpmaddubsw's int16 pair sums cannot saturate
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(q, x), _mm512_set1_epi16(1)));
#endif
}

// x [M, K] in T -> int8 per group of gs columns: xq, xscale [M, K/gs], xsum [M, K/gs] (sum of x as rounded).
template <typename T>
static void quantize_groups(const T* x, int64_t M, int64_t K, int64_t gs, int8_t* xq, float* xscale, float* xsum) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / gs; g++) {
            const int64_t k0 = m * K + g * gs;
            float amax = 0.f;
            for (int64_t k = 0; k < gs; k++) amax = fmaxf(amax, fabsf(load1(x, k0 + k)));
            float s = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / s;
            int32_t sum = 0;
            for (int64_t k = 0; k < gs; k++) {
                int32_t v = (int32_t)lrintf(load1(x, k0 + k) * inv);
                xq[k0 + k] = (int8_t)v;
                sum += v;
            }
            xscale[m * (K / gs) + g] = s;
            xsum[m * (K / gs) + g] = s * (float)sum;
        }
}

static inline __m512 widen16(const bf16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

// quantize_groups for groups of a multiple of 16 columns, 16 per instruction, the same rounding (to
// nearest even, as lrintf; 1 / scale as above): rows m of [m0, m1) only, so that threads can share it.
template <typename T>
static void quantize_groups16(const T* x, int64_t m0, int64_t m1, int64_t K, int64_t gs, int8_t* xq, float* xscale,
                              float* xsum) {
    for (int64_t m = m0; m < m1; m++)
        for (int64_t g = 0; g < K / gs; g++) {
            const int64_t k0 = m * K + g * gs;
            __m512 amax = _mm512_setzero_ps();
            for (int64_t k = 0; k < gs; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(widen16(x + k0 + k)));
            const float a = _mm512_reduce_max_ps(amax);
            const float s = a > 0.f ? a / 127.f : 1.f;
            const __m512 inv = _mm512_set1_ps(1.f / s);
            __m512i sum = _mm512_setzero_si512();
            for (int64_t k = 0; k < gs; k += 16) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(widen16(x + k0 + k), inv));
                _mm_storeu_si128((__m128i*)(xq + k0 + k), _mm512_cvtsepi32_epi8(v));
                sum = _mm512_add_epi32(sum, v);
            }
            xscale[m * (K / gs) + g] = s;
            xsum[m * (K / gs) + g] = s * (float)_mm512_reduce_add_epi32(sum);
        }
}

// vpdpbusd with x's quadruple broadcast from memory (its {1to16} operand): no broadcast instruction.
static inline __m512i dot8_from(__m512i acc, __m512i q, const int8_t* x4) {
#ifdef __AVX512VNNI__
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const int32_t*)x4));
    return acc;
#else
    int32_t v;
    memcpy(&v, x4, 4);
    return dot8(acc, q, _mm512_set1_epi32(v));
#endif
}

// S blocks of 16 rows, `ps` bytes (and `ss` scale entries) apart, against MB rows of x: out[s][m]. S > 1
// streams from memory at once (the step's batch of one); MB > 1 reads each block once for several rows (a
// prompt: up to 8), x's quadruples taken by vpdpbusd itself from memory, so that the products are nearly all
// of the instructions.
template <typename T, int S, int MB>
static void q4_tile(const uint8_t* P, int64_t ps, const T* sm, int64_t ss, const int8_t* xq, const float* xscale,
                    const float* xsum, int64_t K, int64_t gs, __m512 (&out)[S][MB]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int64_t G = K / gs, units = gs / 8;
    __m512 acc[S][MB];
    for (int s = 0; s < S; s++)
        for (int m = 0; m < MB; m++) acc[s][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i iacc[S][MB];
        for (int s = 0; s < S; s++)
            for (int m = 0; m < MB; m++) iacc[s][m] = _mm512_setzero_si512();
        for (int64_t u = 0; u < units; u++) {
            const int64_t k = g * gs + 8 * u;
            for (int s = 0; s < S; s++) {
                const __m512i v = _mm512_loadu_si512((const void*)(P + s * ps + (k / 8) * 64));
                const __m512i qlo = _mm512_and_si512(v, low), qhi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int m = 0; m < MB; m++) {
                    iacc[s][m] = dot8_from(iacc[s][m], qlo, xq + m * K + k);
                    iacc[s][m] = dot8_from(iacc[s][m], qhi, xq + m * K + k + 4);
                }
            }
        }
        for (int s = 0; s < S; s++) {
            const __m512 scale = widen16(sm + s * ss + g * 32), mins = widen16(sm + s * ss + g * 32 + 16);
            for (int m = 0; m < MB; m++) {
                acc[s][m] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(xscale[m * G + g])),
                                            _mm512_cvtepi32_ps(iacc[s][m]), acc[s][m]);
                acc[s][m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(xsum[m * G + g]), acc[s][m]);
            }
        }
    }
    for (int s = 0; s < S; s++)
        for (int m = 0; m < MB; m++) out[s][m] = acc[s][m];
}

// One block of 16 rows against MB rows of x.
template <typename T, int MB>
static void q4_block(const uint8_t* P, const T* sm, const int8_t* xq, const float* xscale, const float* xsum,
                     int64_t K, int64_t gs, __m512 out[MB]) {
    __m512 tile[1][MB];
    q4_tile<T, 1, MB>(P, 0, sm, 0, xq, xscale, xsum, K, gs, tile);
    for (int m = 0; m < MB; m++) out[m] = tile[0][m];
}

// S blocks against one row of x: S streams from memory at once.
template <typename T, int S>
static void q4_blocks(const uint8_t* P, int64_t ps, const T* sm, int64_t ss, const int8_t* xq, const float* xscale,
                      const float* xsum, int64_t K, int64_t gs, __m512 out[S]) {
    __m512 tile[S][1];
    q4_tile<T, S, 1>(P, ps, sm, ss, xq, xscale, xsum, K, gs, tile);
    for (int s = 0; s < S; s++) out[s] = tile[s][0];
}
