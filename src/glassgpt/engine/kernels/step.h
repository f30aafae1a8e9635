#pragma once
// What the decoding steps share (step.cpp: GPT-2, family_step.cpp: Qwen3 and Llama 3): a product's
// input prepared as its kernel reads it, this thread's share of a Linear's output rows for every
// kind of weight, and attention over the KV cache. gemv.h has the inner loops; these are the
// pieces a step is built from. Everything here runs inside the step's one OpenMP parallel region.
#include "gemv.h"

namespace step_parts {

enum Kind { KIND_F32 = 0, KIND_BF16 = 1, KIND_Q8 = 2, KIND_Q4 = 3 };

template <typename P> const P* ptr(const int64_t* plan, int i) { return reinterpret_cast<const P*>(plan[i]); }

static inline __m512 loadf(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(tail16(left), p); }
static inline __m512 loadf(const bf16* p, int64_t left) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail16(left), p)), 16));
}


#ifdef __AVX512VNNI__
// int8 weights x int8 activations, for the step's int8 products: x rounded to int8 per group of
// Q8_GROUP columns (one scale each, as llama.cpp's q8_0 activations), 64 products per vpdpbusd.
// vpdpbusd multiplies unsigned by signed bytes, so each weight's sign moves onto x (|w| x +-x);
// its int32 lanes 0-7 sum one group and 8-15 the next, scaled into float32 by their own scales.
// R rows of W, `rs` bytes apart, against MB rows of x.
#define Q8_GROUP 32
template <int R, int MB>
static void q8x8_rows(const int8_t* W, int64_t rs, const int8_t* x, const float* xs, int64_t K, float (*out)[4]) {
    __m512 acc[MB][R];
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
        __m512i w[R];
        __mmask64 neg[R];
        for (int r = 0; r < R; r++) {
            const __m512i v = _mm512_loadu_si512(W + r * rs + k);
            neg[r] = _mm512_movepi8_mask(v);
            w[r] = _mm512_abs_epi8(v);
        }
        for (int m = 0; m < MB; m++) {
            const __m512i xv = _mm512_loadu_si512(x + m * K + k);
            const float* g = xs + m * (K / Q8_GROUP) + k / Q8_GROUP;
            const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(g[0]), _mm256_set1_ps(g[1]), 1);
            for (int r = 0; r < R; r++) {
                const __m512i i = _mm512_dpbusd_epi32(zero, w[r], _mm512_mask_sub_epi8(xv, neg[r], zero, xv));
                acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), s, acc[m][r]);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int r = 0; r < R; r++) out[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}
#endif

// One row of W against one x, four accumulators over consecutive steps: for a batch of one, a
// thread streams one row at a time (gemv.h's 4-row loop streams four at once, for x rows > 1).
template <class D>
static inline float dot_row(const typename D::WT* w, const typename D::XT* x, int64_t K) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 4 * D::STEP <= K; k += 4 * D::STEP)
        for (int u = 0; u < 4; u++)
            acc[u] = D::mac(acc[u], D::load_w(w + k + u * D::STEP, D::STEP), D::load_x(x + k + u * D::STEP, D::STEP));
    for (; k < K; k += D::STEP) acc[0] = D::mac(acc[0], D::load_w(w + k, K - k), D::load_x(x + k, K - k));
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// S rows `rs` elements apart, each summed exactly as dot_row sums it (its four accumulators, its
// order), so that S streams come from memory at once. One thread reading one row after another is
// one stream, and on the AMD EPYC (Zen 5) one stream a core leaves read bandwidth unused: four rows
// from four quarters of a thread's share read 1.16-1.22x faster than row after row, four adjacent
// rows no faster (benchmarks/RESULTS.md, "four streams a thread").
template <class D, int S>
static inline void dot_rows(const typename D::WT* w, int64_t rs, const typename D::XT* x, int64_t K, float* out) {
    __m512 acc[S][4];
    for (int s = 0; s < S; s++)
        for (int u = 0; u < 4; u++) acc[s][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 4 * D::STEP <= K; k += 4 * D::STEP)
        for (int u = 0; u < 4; u++) {
            const typename D::V xv = D::load_x(x + k + u * D::STEP, D::STEP);
            for (int s = 0; s < S; s++) acc[s][u] = D::mac(acc[s][u], D::load_w(w + s * rs + k + u * D::STEP, D::STEP), xv);
        }
    for (; k < K; k += D::STEP) {
        const typename D::V xv = D::load_x(x + k, K - k);
        for (int s = 0; s < S; s++) acc[s][0] = D::mac(acc[s][0], D::load_w(w + s * rs + k, K - k), xv);
    }
    for (int s = 0; s < S; s++)
        out[s] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[s][0], acc[s][1]), _mm512_add_ps(acc[s][2], acc[s][3])));
}

#define STREAMS 4

template <class D, class Finish>
static inline void dense(const typename D::WT* W, const typename D::XT* x, int64_t M, int64_t lo, int64_t hi,
                         int64_t K, Finish finish) {
    if (M == 1) {  // rows lo + i, lo + q + i, ... together (dot_rows), then the few left over
        const int64_t q = (hi - lo) / STREAMS;
        float out[STREAMS];
        for (int64_t i = 0; i < q; i++) {
            dot_rows<D, STREAMS>(W + (lo + i) * K, q * K, x, K, out);
            for (int s = 0; s < STREAMS; s++) finish(0, lo + s * q + i, out[s]);
        }
        for (int64_t n = lo + STREAMS * q; n < hi; n++) finish(0, n, dot_row<D>(W + n * K, x, K));
        return;
    }
    row_range(lo, hi, M, [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
        float_rows<D, R.value, MB.value>(W + n * K, x + m0 * K, K, K, out);
    }, finish);
}

// The greedy pick of each row of logits [B, V], as torch.max(dim=-1) picks it: the first largest, and the
// largest itself; NaN (and the first NaN's index) where a row holds one, so that the caller refuses it.
// Rows are shared between the threads; the caller reads them after the parallel region.
static void greedy_rows(const float* logits, int64_t B, int64_t V, int64_t* best, float* best_value) {
    int64_t lo, hi;
    share(B, &lo, &hi);
    for (int64_t m = lo; m < hi; m++) {
        const float* v = logits + m * V;
        __m512 top = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t k = 0; k < V; k += 16) {
            const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail16(V - k), v + k);
            nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            top = _mm512_max_ps(top, x);
        }
        const float t = nan ? NAN : _mm512_reduce_max_ps(top);
        int64_t at = 0;
        for (int64_t k = 0; k < V; k += 16) {
            const __m512 x = _mm512_maskz_loadu_ps(tail16(V - k), v + k);
            const __mmask16 hit = (nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(x, _mm512_set1_ps(t), _CMP_EQ_OQ))
                                  & tail16(V - k);
            if (hit) {
                at = k + __builtin_ctz(hit);
                break;
            }
        }
        best[m] = at;
        best_value[m] = t;
    }
}

// A product's input as its kernel reads it, in this thread's scratch.
struct Input {
    const float* f;          // float32 [M, K]
    bf16* b;                 // bfloat16 [M, K]
    int16_t* i16;            // q8: int16 [M, K] and one scale per row
    float* s16;
    int8_t* i8;              // q4: int8 [M, K], a scale and a sum per group
    float *s8, *sum8;
};

static void prepare(int kind, Input& in, int64_t M, int64_t K, int64_t gs) {
    if (kind == KIND_BF16) {
#ifdef __AVX512BF16__
        for (int64_t i = 0; i < M * K; i++) in.b[i] = f32_to_bf16(in.f[i]);
#endif
    } else if (kind == KIND_Q8) {
#ifdef __AVX512VNNI__
        if (K % 64 == 0) {
            quantize_groups16(in.f, 0, M, K, Q8_GROUP, in.i8, in.s8, in.sum8);
            return;
        }
#endif
        quantize_rows(in.f, M, K, in.i16, in.s16);
    } else if (kind == KIND_Q4) {
        if (gs % 16 == 0)
            quantize_groups16(in.f, 0, M, K, gs, in.i8, in.s8, in.sum8);
        else
            quantize_groups(in.f, M, K, gs, in.i8, in.s8, in.sum8);
    }
}

// Rows [lo, hi) of y = x W^T * scales + bias for a Linear at plan[at..at+2] (weight, scales, bias) of
// N x K (for 4-bit weights lo is a multiple of 16, and so is hi unless it is N); `store(m, n, v)`
// takes each result. `linear` below: this thread's share of the N rows.
template <typename T, class Store>
static void linear_rows(const int64_t* plan, int at, int kind, const Input& in, int64_t M, int64_t N, int64_t K,
                        int64_t gs, int64_t lo, int64_t hi, Store store) {
    const T* bias = ptr<T>(plan, at + 2);
    const T* scales = ptr<T>(plan, at + 1);
    auto finish = [&](int64_t m, int64_t n, float v) { store(m, n, v + (bias ? load1(bias, n) : 0.f)); };
    if (kind == KIND_F32) {
        dense<F32>(ptr<float>(plan, at), in.f, M, lo, hi, K, finish);
    } else if (kind == KIND_BF16) {
#ifdef __AVX512BF16__
        dense<BF16>(ptr<bf16>(plan, at), in.b, M, lo, hi, K, finish);
#else
        dense<BF16Widened>(ptr<bf16>(plan, at), in.f, M, lo, hi, K, finish);
#endif
    } else if (kind == KIND_Q8) {
        const int8_t* W = ptr<int8_t>(plan, at);
#ifdef __AVX512VNNI__
        if (K % 64 == 0) {
            auto scaled = [&](int64_t m, int64_t n, float v) { finish(m, n, v * load1(scales, n)); };
            if (M == 1) {  // four streams, as dense's
                const int64_t q = (hi - lo) / STREAMS;
                float out[MAXM][4];
                for (int64_t i = 0; i < q; i++) {
                    q8x8_rows<STREAMS, 1>(W + (lo + i) * K, q * K, in.i8, in.s8, K, out);
                    for (int s = 0; s < STREAMS; s++) scaled(0, lo + s * q + i, out[0][s]);
                }
                lo += STREAMS * q;
            }
            row_range(lo, hi, M, [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
                q8x8_rows<R.value, MB.value>(W + n * K, K, in.i8 + m0 * K, in.s8 + m0 * (K / Q8_GROUP), K, out);
            }, scaled);
            return;
        }
#endif
        row_range(lo, hi, M, [&](auto R, auto MB, int64_t n, int64_t m0, float (*out)[4]) {
            q8_rows<R.value, MB.value>(W + n * K, in.i16 + m0 * K, K, K, out);
        }, [&](int64_t m, int64_t n, float v) { finish(m, n, v * in.s16[m] * load1(scales, n)); });
    } else {
        const uint8_t* P = ptr<uint8_t>(plan, at);
        const int64_t G = K / gs;
        int64_t nb0 = lo / 16;
        if (M == 1) {  // four streams: blocks nb0 + i, nb0 + q + i, ... together
            const int64_t q = ((hi + 15) / 16 - nb0) / STREAMS;
            for (int64_t i = 0; i < q; i++) {
                __m512 out[STREAMS];
                q4_blocks<T, STREAMS>(P + (nb0 + i) * (K / 8) * 64, q * (K / 8) * 64, scales + (nb0 + i) * G * 32,
                                      q * G * 32, in.i8, in.s8, in.sum8, K, gs, out);
                for (int s = 0; s < STREAMS; s++) {
                    float v[16];
                    _mm512_storeu_ps(v, out[s]);
                    const int64_t nb = nb0 + s * q + i;
                    for (int j = 0; j < 16 && nb * 16 + j < N; j++) finish(0, nb * 16 + j, v[j]);
                }
            }
            nb0 += STREAMS * q;
        }
        for (int64_t nb = nb0; nb < (hi + 15) / 16; nb++)
            for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
                const int64_t mb = M - m0 < MAXM ? M - m0 : MAXM;
                __m512 out[MAXM];
                const uint8_t* P_nb = P + nb * (K / 8) * 64;
                const T* sm = scales + nb * G * 32;
                const int8_t* xq = in.i8 + m0 * K;
                const float *xs = in.s8 + m0 * G, *xsum = in.sum8 + m0 * G;
                switch (mb) {
                    case 1: q4_block<T, 1>(P_nb, sm, xq, xs, xsum, K, gs, out); break;
                    case 2: q4_block<T, 2>(P_nb, sm, xq, xs, xsum, K, gs, out); break;
                    case 3: q4_block<T, 3>(P_nb, sm, xq, xs, xsum, K, gs, out); break;
                    default: q4_block<T, 4>(P_nb, sm, xq, xs, xsum, K, gs, out); break;
                }
                for (int64_t m = 0; m < mb; m++) {
                    float v[16];
                    _mm512_storeu_ps(v, out[m]);
                    for (int j = 0; j < 16 && nb * 16 + j < N; j++) finish(m0 + m, nb * 16 + j, v[j]);
                }
            }
    }
}

// This thread's share of linear_rows: rows for dense weights, blocks of 16 rows for 4-bit ones.
template <typename T, class Store>
static void linear(const int64_t* plan, int at, int kind, const Input& in, int64_t M, int64_t N, int64_t K,
                   int64_t gs, Store store) {
    int64_t lo, hi;
    if (kind == KIND_Q4) {
        share((N + 15) / 16, &lo, &hi);
        lo *= 16;
        hi = hi * 16 < N ? hi * 16 : N;
    } else {
        share(N, &lo, &hi);
    }
    linear_rows<T>(plan, at, kind, in, M, N, K, gs, lo, hi, store);
}

// Query heads [h0, h1) of every sequence: q [B, H * hd] against the cache's positions 0..pos of
// [B, G, L, hd], softmax in float32, the context into att [B, H * hd]. Query head h reads key/value
// head h / (H / G): G = H for GPT-2, fewer groups for grouped-query attention (repeat_interleave's order).
template <typename T>
static void attention(const float* q, const T* kc, const T* vc, float* att, float* scores, int64_t B, int64_t H,
                      int64_t G, int64_t L, int64_t hd, int64_t pos, int64_t h0, int64_t h1) {
    const float scale = 1.f / sqrtf((float)hd);
    for (int64_t b = 0; b < B; b++)
    for (int64_t h = h0; h < h1; h++) {
        const int64_t bg = b * G + h / (H / G);
        const float* qv = q + b * H * hd + h * hd;
        const T* k = kc + bg * L * hd;
        const T* v = vc + bg * L * hd;
        float best = -INFINITY;
        for (int64_t j = 0; j <= pos; j++) {
            __m512 s = _mm512_setzero_ps();
            for (int64_t i = 0; i < hd; i += 16) s = _mm512_fmadd_ps(loadf(qv + i, hd - i), loadf(k + j * hd + i, hd - i), s);
            scores[j] = _mm512_reduce_add_ps(s) * scale;
            best = fmaxf(best, scores[j]);
        }
        __m512 total = _mm512_setzero_ps();
        const __m512 top = _mm512_set1_ps(best);
        for (int64_t j = 0; j <= pos; j += 16) {
            const __mmask16 mask = tail16(pos + 1 - j);
            __m512 e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + j), top)));
            _mm512_mask_storeu_ps(scores + j, mask, e);
            total = _mm512_add_ps(total, e);
        }
        const float inv = 1.f / _mm512_reduce_add_ps(total);
        float* out = att + b * H * hd + h * hd;
        for (int64_t i = 0; i < hd; i += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j <= pos; j++) acc = _mm512_fmadd_ps(_mm512_set1_ps(scores[j]), loadf(v + j * hd + i, hd - i), acc);
            _mm512_mask_storeu_ps(out + i, tail16(hd - i), _mm512_mul_ps(acc, _mm512_set1_ps(inv)));
        }
    }
}


}  // namespace step_parts
