// A whole decoding step of Qwen3 or Llama 3 in one call: one new token for each of B <= 8 sequences.
//
//   gg_family_step(plan, ids, pos, nt)   ids [B] int64 at position `pos` -> plan's logits [B, V] float32
//   (and, where the plan asks, each row's greedy pick: step.h's greedy_rows)
//
// What families/qwen3.py and llama3.py do for one token, over the model's own tensors (engine/
// family.py hands their addresses over in `plan`, and the KV cache's): the embedding row (no
// pos_emb); in each block RMSNorm, the q/k/v products, QK-norm (Qwen3), RoPE on q and k at `pos`,
// the keys and values written into the cache's G groups, grouped-query attention over 0..pos, the
// output projection and its residual, RMSNorm, SwiGLU (silu(fc1) * fc2, then fc3) and its residual;
// final_norm and the head. The residual stream, the norms, RoPE, attention and SwiGLU run in float32
// whatever the weights (float32 or bfloat16); the products are step.h's.
//
// One OpenMP parallel region per step. Each thread owns whole key/value groups: their query heads'
// rows of W_query, the groups' rows of W_key and W_value, the norm and rotation of those heads, and
// their attention, with no barrier in between (a thread only reads the keys it wrote). Then three
// barriers per block, as GPT-2's step: after attention, after the output projection's residual, and
// after the feed-forward's up products (each thread gates the rows of fc1 and fc2 it computed).
#include "step.h"

namespace {

using namespace step_parts;

// plan[]: a header, then LAYER_FIELDS entries per block (the layout engine/step.py's RopeStep writes).
enum Header {
    F_PARAMS_BF16, F_LAYERS, F_D, F_HEADS, F_GROUPS, F_HEAD_DIM, F_HIDDEN, F_VOCAB, F_MAXLEN, F_BATCH, F_TOK_EMB,
    F_ROPE_COS, F_ROPE_SIN, F_FN_SCALE, F_HEAD_W, F_HEAD_S, F_HEAD_B, F_X, F_Q, F_KEYS, F_ATT, F_FF, F_LOGITS,
    F_SCRATCH, F_SCRATCH_BYTES, F_EPS_BITS, F_QK_NORM, F_BEST, F_BEST_VALUE, HEADER = 32
};
// Each Linear is three entries (weight, scales, bias) as step.h's linear_rows reads them; the
// families' have neither scales nor biases (0).
enum Layer {
    L_NORM1, L_NORM2, L_QNORM, L_KNORM, L_Q, L_K = L_Q + 3, L_V = L_K + 3, L_O = L_V + 3, L_FC1 = L_O + 3,
    L_FC2 = L_FC1 + 3, L_FC3 = L_FC2 + 3, L_KCACHE = L_FC3 + 3, L_VCACHE, LAYER_FIELDS
};

// y [M, n] = x / sqrt(mean(x^2) + eps) * scale, each row in float32 (families/layers.py rms_norm).
template <typename T>
static void rms_norm(const float* x, const T* scale, float* y, int64_t M, int64_t n, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * n;
        __m512 s = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k += 16) {
            const __m512 v = loadf(xm + k, n - k);
            s = _mm512_fmadd_ps(v, v, s);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(s) / n + eps));
        for (int64_t k = 0; k < n; k += 16)
            _mm512_mask_storeu_ps(y + m * n + k, tail16(n - k),
                                  _mm512_mul_ps(_mm512_mul_ps(loadf(xm + k, n - k), inv), loadf(scale + k, n - k)));
    }
}

// One head's hd values, in place: QK-norm (where `norm` is given), then the rotation of each pair
// (v[i], v[i + hd/2]) by this position's angle: cos, sin are its row of the tables, [hd] each.
template <typename T>
static void norm_and_rotate(float* v, const T* norm, const float* cos, const float* sin, int64_t hd, float eps) {
    if (norm) rms_norm(v, norm, v, 1, hd, eps);
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * cos[i] - x2 * sin[i];
        v[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
}

// silu(a) * b = a / (1 + exp(-a)) * b, in place on a: this thread's rows [lo, hi) of [M, N].
static void swiglu_rows(float* a, const float* b, int64_t M, int64_t N, int64_t lo, int64_t hi) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = lo; n < hi; n += 16) {
            const __mmask16 mask = tail16(hi - n);
            const __m512 x = _mm512_maskz_loadu_ps(mask, a + m * N + n);
            const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
            _mm512_mask_storeu_ps(a + m * N + n, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, b + m * N + n)));
        }
}

template <typename T>
static void step(const int64_t* plan, const int64_t* ids, int64_t pos) {
    const int kind = plan[F_PARAMS_BF16] ? KIND_BF16 : KIND_F32;
    const int64_t nl = plan[F_LAYERS], d = plan[F_D], H = plan[F_HEADS], G = plan[F_GROUPS], hd = plan[F_HEAD_DIM],
                  f = plan[F_HIDDEN], V = plan[F_VOCAB], L = plan[F_MAXLEN], B = plan[F_BATCH];
    const int64_t dq = H * hd, dkv = G * hd, per_group = H / G, wide = d > dq ? (d > f ? d : f) : (dq > f ? dq : f);
    float eps;
    const int32_t eps_bits = (int32_t)plan[F_EPS_BITS];
    memcpy(&eps, &eps_bits, 4);
    float *x = (float*)plan[F_X], *q = (float*)plan[F_Q], *keys = (float*)plan[F_KEYS], *att = (float*)plan[F_ATT];
    float *ff = (float*)plan[F_FF], *logits = (float*)plan[F_LOGITS];
    const float* cos = (const float*)plan[F_ROPE_COS] + pos * hd;
    const float* sin = (const float*)plan[F_ROPE_SIN] + pos * hd;

    // This thread's scratch: h (float32 B x wide), its bfloat16 form, fc2's rows, the scores.
    char* mine = (char*)plan[F_SCRATCH] + omp_get_thread_num() * plan[F_SCRATCH_BYTES];
    float* h = (float*)mine;
    Input in{h, (bf16*)(h + B * wide), nullptr, nullptr, nullptr, nullptr, nullptr};
    float* up = h + 2 * B * wide;
    float* scores = up + B * f;
    Input attin = in, ffin = in;  // the same scratch, prepared from the shared att and ff
    attin.f = att;
    ffin.f = ff;
    auto barrier = [] {
#pragma omp barrier
    };

    {  // the embedding rows (each thread its share of the columns)
        const T* te = ptr<T>(plan, F_TOK_EMB);
        int64_t lo, hi;
        share(d, &lo, &hi);
        for (int64_t b = 0; b < B; b++)
            for (int64_t k = lo; k < hi; k++) x[b * d + k] = load1(te, ids[b] * d + k);
    }
    barrier();
    int64_t g0, g1;  // this thread's key/value groups, and so its query heads [g0, g1) x per_group
    share(G, &g0, &g1);
    const int64_t h0 = g0 * per_group, h1 = g1 * per_group;
    int64_t f0, f1;  // this thread's rows of fc1 and fc2 (linear's share of f)
    share(f, &f0, &f1);
    for (int64_t l = 0; l < nl; l++) {
        const int64_t* lp = plan + HEADER + l * LAYER_FIELDS;
        T* kc = (T*)lp[L_KCACHE];
        T* vc = (T*)lp[L_VCACHE];
        const T* qnorm = plan[F_QK_NORM] ? ptr<T>(lp, L_QNORM) : nullptr;
        const T* knorm = plan[F_QK_NORM] ? ptr<T>(lp, L_KNORM) : nullptr;
        rms_norm(x, ptr<T>(lp, L_NORM1), h, B, d, eps);
        prepare(kind, in, B, d, 0);
        auto cache_at = [&](int64_t m, int64_t n) { return ((m * G + n / hd) * L + pos) * hd + n % hd; };
        linear_rows<T>(lp, L_Q, kind, in, B, dq, d, 0, h0 * hd, h1 * hd, [&](int64_t m, int64_t n, float v) { q[m * dq + n] = v; });
        linear_rows<T>(lp, L_K, kind, in, B, dkv, d, 0, g0 * hd, g1 * hd, [&](int64_t m, int64_t n, float v) { keys[m * dkv + n] = v; });
        linear_rows<T>(lp, L_V, kind, in, B, dkv, d, 0, g0 * hd, g1 * hd, [&](int64_t m, int64_t n, float v) { store1(vc, cache_at(m, n), v); });
        for (int64_t b = 0; b < B; b++) {
            for (int64_t hh = h0; hh < h1; hh++) norm_and_rotate(q + b * dq + hh * hd, qnorm, cos, sin, hd, eps);
            for (int64_t g = g0; g < g1; g++) {
                float* k = keys + b * dkv + g * hd;
                norm_and_rotate(k, knorm, cos, sin, hd, eps);
                for (int64_t i = 0; i < hd; i++) store1(kc, cache_at(b, g * hd + i), k[i]);
            }
        }
        attention(q, (const T*)kc, (const T*)vc, att, scores, B, H, G, L, hd, pos, h0, h1);
        barrier();
        prepare(kind, attin, B, dq, 0);
        linear<T>(lp, L_O, kind, attin, B, d, dq, 0, [&](int64_t m, int64_t n, float v) { x[m * d + n] += v; });
        barrier();
        rms_norm(x, ptr<T>(lp, L_NORM2), h, B, d, eps);
        prepare(kind, in, B, d, 0);
        linear_rows<T>(lp, L_FC1, kind, in, B, f, d, 0, f0, f1, [&](int64_t m, int64_t n, float v) { ff[m * f + n] = v; });
        linear_rows<T>(lp, L_FC2, kind, in, B, f, d, 0, f0, f1, [&](int64_t m, int64_t n, float v) { up[m * f + n] = v; });
        swiglu_rows(ff, up, B, f, f0, f1);
        barrier();
        prepare(kind, ffin, B, f, 0);
        linear<T>(lp, L_FC3, kind, ffin, B, d, f, 0, [&](int64_t m, int64_t n, float v) { x[m * d + n] += v; });
        barrier();
    }
    rms_norm(x, ptr<T>(plan, F_FN_SCALE), h, B, d, eps);
    prepare(kind, in, B, d, 0);
    linear<T>(plan, F_HEAD_W, kind, in, B, V, d, 0, [&](int64_t m, int64_t n, float v) { logits[m * V + n] = v; });
    barrier();
    if (plan[F_BEST]) greedy_rows(logits, B, V, (int64_t*)plan[F_BEST], (float*)plan[F_BEST_VALUE]);
}

}  // namespace

extern "C" {

// One decoding step (file comment); `nt` threads. The caller checks every shape when it writes the plan.
void gg_family_step(const int64_t* plan, const int64_t* ids, int64_t pos, int nt) {
#pragma omp parallel num_threads(nt)
    {
        if (plan[F_PARAMS_BF16])
            step<bf16>(plan, ids, pos);
        else
            step<float>(plan, ids, pos);
    }
}

// Bytes of scratch each thread needs (step's `mine`): h and its bfloat16 form ([B, wide] each, wide
// the largest of d, the query width and f), fc2's rows [B, f], the scores [L].
int64_t gg_family_step_scratch_bytes(int64_t B, int64_t wide, int64_t f, int64_t L) {
    const int64_t bytes = (int64_t)sizeof(float) * (2 * B * wide + B * f + L + 16);
    return (bytes + 63) / 64 * 64;
}

}  // extern "C"
