// A whole decoding step of GPT-2 in one call: one new token for each of B <= 8 sequences.
//
//   gg_step(plan, ids, pos, nt)   ids [B] int64 at position `pos` -> plan's logits [B, V] float32
//   (and, where the plan asks, each row's greedy pick: step.h's greedy_rows)
//
// What GPTModel.forward does for one token, over the model's own tensors (engine/step.py hands
// their addresses over in `plan`, and the KV cache's): the embedding rows; in each block
// LayerNorm, the q/k/v products, the keys and values written into the cache at `pos`, attention
// over positions 0..pos, the output projection and its residual, LayerNorm, the feed-forward
// with GELU and its residual; final_norm and the head. The residual stream, LayerNorm, attention
// and GELU run in float32 whatever the weights; the products are gemv.h's loops (float32,
// bfloat16, int8 or 4-bit weights), with the input prepared as each kernel reads it.
//
// One OpenMP parallel region per step (torch's own pool): every thread computes its share of each
// product's output rows (and of the (sequence, head) pairs in attention), with a barrier wherever
// the next phase reads what other threads wrote. LayerNorm, and the rounding of a product's input
// to bfloat16/int16/int8, are redone by each thread into its own scratch: B x 4d values, cheaper
// than another barrier. Nothing is allocated here: every buffer is in the plan.
#include "step.h"

namespace {

using namespace step_parts;


// plan[]: a header, then LAYER_FIELDS entries per block (the layout engine/step.py writes).
enum Header {
    H_KIND, H_PARAMS_BF16, H_LAYERS, H_D, H_HEADS, H_VOCAB, H_MAXLEN, H_BATCH, H_GROUP, H_TOK_EMB, H_POS_EMB,
    H_FN_SCALE, H_FN_SHIFT, H_HEAD_W, H_HEAD_S, H_HEAD_B, H_X, H_Q, H_ATT, H_FF, H_LOGITS, H_SCRATCH,
    H_SCRATCH_BYTES, H_EPS_BITS, H_PROFILE, H_BEST, H_BEST_VALUE, HEADER = 32
};

// Where thread 0's time goes, when plan[H_PROFILE] points at PHASES doubles (seconds, added up;
// benchmarks/decode_profile.py reads them): its own share of each phase, and its waits for the others.
enum Phase { P_EMBED, P_NORM, P_QKV, P_ATTENTION, P_OUT, P_FF1, P_FF2, P_HEAD, P_WAIT, PHASES };

struct Clock {
    double* total;  // null: not profiling
    double last;
    Clock(const int64_t* plan) : total(omp_get_thread_num() == 0 ? (double*)plan[H_PROFILE] : nullptr),
                                 last(total ? omp_get_wtime() : 0) {}
    void tick(int phase) {
        if (!total) return;
        const double now = omp_get_wtime();
        total[phase] += now - last;
        last = now;
    }
};
enum Layer {
    L_LN1_SCALE, L_LN1_SHIFT, L_LN2_SCALE, L_LN2_SHIFT, L_Q, L_K = L_Q + 3, L_V = L_K + 3, L_O = L_V + 3,
    L_FF1 = L_O + 3, L_FF2 = L_FF1 + 3, L_KCACHE = L_FF2 + 3, L_VCACHE, LAYER_FIELDS
};

// y [M, d] = LayerNorm(x [M, d]) * scale + shift (biased variance, eps inside the root: F.layer_norm).
template <typename T>
static void layer_norm(const float* x, const T* scale, const T* shift, float* y, int64_t M, int64_t d, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * d;
        __m512 s = _mm512_setzero_ps();
        for (int64_t k = 0; k < d; k += 16) s = _mm512_add_ps(s, loadf(xm + k, d - k));
        const float mean = _mm512_reduce_add_ps(s) / d;
        __m512 v = _mm512_setzero_ps(), mv = _mm512_set1_ps(mean);
        for (int64_t k = 0; k < d; k += 16) {
            __m512 c = _mm512_maskz_sub_ps(tail16(d - k), loadf(xm + k, d - k), mv);
            v = _mm512_fmadd_ps(c, c, v);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(v) / d + eps));
        for (int64_t k = 0; k < d; k += 16) {
            __m512 c = _mm512_mul_ps(_mm512_sub_ps(loadf(xm + k, d - k), mv), inv);
            c = _mm512_fmadd_ps(c, loadf(scale + k, d - k), loadf(shift + k, d - k));
            _mm512_mask_storeu_ps(y + m * d + k, tail16(d - k), c);
        }
    }
}

// GELU (tanh form, the book's: gemv.h's gelu16) in place on this thread's rows [lo, hi) of y [M, N].
static void gelu_rows(float* y, int64_t M, int64_t N, int64_t lo, int64_t hi) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = lo; n < hi; n += 16) {
            const __mmask16 mask = tail16(hi - n);
            _mm512_mask_storeu_ps(y + m * N + n, mask, gelu16(_mm512_maskz_loadu_ps(mask, y + m * N + n)));
        }
}

template <typename T>
static void step(const int64_t* plan, const int64_t* ids, int64_t pos) {
    const int kind = (int)plan[H_KIND];
    const int64_t nl = plan[H_LAYERS], d = plan[H_D], H = plan[H_HEADS], V = plan[H_VOCAB], L = plan[H_MAXLEN],
                  B = plan[H_BATCH], gs = plan[H_GROUP], hd = d / H, f = 4 * d;
    float eps;
    const int32_t eps_bits = (int32_t)plan[H_EPS_BITS];
    memcpy(&eps, &eps_bits, 4);
    float *x = (float*)plan[H_X], *q = (float*)plan[H_Q], *att = (float*)plan[H_ATT], *ff = (float*)plan[H_FF];
    float* logits = (float*)plan[H_LOGITS];

    // This thread's scratch: h (float32 B x 4d), its bfloat16/int16/int8 forms and scales, the scores.
    char* mine = (char*)plan[H_SCRATCH] + omp_get_thread_num() * plan[H_SCRATCH_BYTES];
    float* h = (float*)mine;
    Input in{h, (bf16*)(h + B * f), (int16_t*)(h + B * f), (float*)(h + 2 * B * f), (int8_t*)(h + B * f),
             (float*)(h + 2 * B * f), (float*)(h + 2 * B * f) + B * f};
    float* scores = (float*)(h + 3 * B * f) + B * f;
    Clock clock(plan);
    auto barrier = [&] {
#pragma omp barrier
        clock.tick(P_WAIT);
    };
    Input attin = in, ffin = in;  // the same scratch, prepared from the shared att and ff
    attin.f = att;
    ffin.f = ff;

    {  // the embedding rows (each thread its share of the columns)
        const T* te = ptr<T>(plan, H_TOK_EMB);
        const T* pe = ptr<T>(plan, H_POS_EMB);
        int64_t lo, hi;
        share(d, &lo, &hi);
        for (int64_t b = 0; b < B; b++)
            for (int64_t k = lo; k < hi; k++) x[b * d + k] = load1(te, ids[b] * d + k) + load1(pe, pos * d + k);
    }
    clock.tick(P_EMBED);
    barrier();
    int64_t h0, h1;  // this thread's heads
    share(H, &h0, &h1);
    const bool by_head = kind != KIND_Q4 || hd % 16 == 0;
    for (int64_t l = 0; l < nl; l++) {
        const int64_t* lp = plan + HEADER + l * LAYER_FIELDS;
        T* kc = (T*)lp[L_KCACHE];
        T* vc = (T*)lp[L_VCACHE];
        layer_norm(x, ptr<T>(lp, L_LN1_SCALE), ptr<T>(lp, L_LN1_SHIFT), h, B, d, eps);
        prepare(kind, in, B, d, gs);
        clock.tick(P_NORM);
        // Each thread its own heads: their rows of q, k and v, then their attention, with no barrier
        // between (4-bit weights come in blocks of 16 rows, so heads must be whole blocks).
        auto cache_at = [&](int64_t m, int64_t n) { return ((m * H + n / hd) * L + pos) * hd + n % hd; };
        auto q_at = [&](int64_t m, int64_t n, float v) { q[m * d + n] = v; };
        auto k_at = [&](int64_t m, int64_t n, float v) { store1(kc, cache_at(m, n), v); };
        auto v_at = [&](int64_t m, int64_t n, float v) { store1(vc, cache_at(m, n), v); };
        if (by_head) {
            linear_rows<T>(lp, L_Q, kind, in, B, d, d, gs, h0 * hd, h1 * hd, q_at);
            linear_rows<T>(lp, L_K, kind, in, B, d, d, gs, h0 * hd, h1 * hd, k_at);
            linear_rows<T>(lp, L_V, kind, in, B, d, d, gs, h0 * hd, h1 * hd, v_at);
            clock.tick(P_QKV);
        } else {
            linear<T>(lp, L_Q, kind, in, B, d, d, gs, q_at);
            linear<T>(lp, L_K, kind, in, B, d, d, gs, k_at);
            linear<T>(lp, L_V, kind, in, B, d, d, gs, v_at);
            clock.tick(P_QKV);
            barrier();
        }
        attention(q, (const T*)kc, (const T*)vc, att, scores, B, H, H, L, hd, pos, h0, h1);
        clock.tick(P_ATTENTION);
        barrier();
        prepare(kind, attin, B, d, gs);
        clock.tick(P_NORM);
        linear<T>(lp, L_O, kind, attin, B, d, d, gs, [&](int64_t m, int64_t n, float v) { x[m * d + n] += v; });
        clock.tick(P_OUT);
        barrier();
        layer_norm(x, ptr<T>(lp, L_LN2_SCALE), ptr<T>(lp, L_LN2_SHIFT), h, B, d, eps);
        prepare(kind, in, B, d, gs);
        clock.tick(P_NORM);
        linear<T>(lp, L_FF1, kind, in, B, f, d, gs, [&](int64_t m, int64_t n, float v) { ff[m * f + n] = v; });
        {  // GELU on the rows this thread wrote (the dense kernels share rows, the 4-bit one blocks of 16)
            int64_t lo, hi;
            if (kind == KIND_Q4) {
                share((f + 15) / 16, &lo, &hi);
                lo *= 16;
                hi = hi * 16 < f ? hi * 16 : f;
            } else {
                share(f, &lo, &hi);
            }
            gelu_rows(ff, B, f, lo, hi);
        }
        clock.tick(P_FF1);
        barrier();
        prepare(kind, ffin, B, f, gs);
        clock.tick(P_NORM);
        linear<T>(lp, L_FF2, kind, ffin, B, d, f, gs, [&](int64_t m, int64_t n, float v) { x[m * d + n] += v; });
        clock.tick(P_FF2);
        barrier();
    }
    layer_norm(x, ptr<T>(plan, H_FN_SCALE), ptr<T>(plan, H_FN_SHIFT), h, B, d, eps);
    prepare(kind, in, B, d, gs);
    clock.tick(P_NORM);
    linear<T>(plan, H_HEAD_W, kind, in, B, V, d, gs, [&](int64_t m, int64_t n, float v) { logits[m * V + n] = v; });
    clock.tick(P_HEAD);
    if (plan[H_BEST]) {  // the greedy pick too (its time the head's): every row of logits first
        barrier();
        greedy_rows(logits, B, V, (int64_t*)plan[H_BEST], (float*)plan[H_BEST_VALUE]);
        clock.tick(P_HEAD);
    }
    barrier();  // thread 0's clock then covers the whole step
}

}  // namespace

extern "C" {

// One decoding step (file comment); `nt` threads. The caller checks every shape when it writes the plan.
void gg_step(const int64_t* plan, const int64_t* ids, int64_t pos, int nt) {
#pragma omp parallel num_threads(nt)
    {
        if (plan[H_PARAMS_BF16])
            step<bf16>(plan, ids, pos);
        else
            step<float>(plan, ids, pos);
    }
}

// Bytes of scratch each thread needs (step's `mine`): h, the prepared input, its scales, the scores.
int64_t gg_step_scratch_bytes(int64_t B, int64_t d, int64_t L) {
    const int64_t f = 4 * d;
    const int64_t bytes = (int64_t)sizeof(float) * (4 * B * f + L + 16);
    return (bytes + 63) / 64 * 64;  // each thread's scratch on its own cache lines
}

}  // extern "C"
