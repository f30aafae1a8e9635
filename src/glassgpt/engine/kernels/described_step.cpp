// A whole decoding step in one call for every model whose description lays it out as attention blocks (Qwen3,
// Llama 3, Gemma 3, OLMo 3, Tiny Aya, Qwen3.5, a Qwen3 mixture of experts): one new token of one sequence, on any
// CPU with AVX2 and FMA (AVX-512 ones too). Qwen3.5's linear layers: gated_delta below; its full layers' output
// gate and partial RoPE: L_GATED and L_ROTARY.
//
//   gg_described_step(plan, ids, pos, nt)   ids [1] int64 at position `pos` -> the plan's logits [V] float32,
//                                           and their greedy pick (best, best_value)
//
// engine/described_step.py writes the plan from the model's description (anatomy.py): per block what each part
// is, and the addresses of the model's own tensors and of the KV cache's. What a block computes is the glass
// files' (families/qwen3.py, gemma3.py, olmo3.py, tiny_aya.py), one token at a time:
//
//   x = tok_emb[id] (* sqrt(emb_dim), Gemma)
//   per block:  h = attn_in(x)                   a norm: w * x / rms, (1 + w) * x / rms, or w * (x - mean) / std;
//               q, k, v = W_query h, W_key h, W_value h        a norm the block lacks passes x on
//               q, k = RoPE(qk_norm(q), qk_norm(k)) at pos     the layer's own tables (Gemma's sliding and full bases),
//                                                              pairs of halves or of neighbours; none: no positions
//               the cache's slot for pos <- k, v               (a sliding layer's ring: slot pos % window)
//               a = attn_out(out_proj(softmax(q k^T * scale) v))   over the positions the layer sees
//               x = x + a; h = ff_in(x)                        (parallel, Tiny Aya: h stays attn_in(x))
//               x = x + ff_out(fc3(act(fc1 h) * fc2 h))        (parallel: x + a + ...); act: silu (SwiGLU) or tanh
//                                                              GELU (GeGLU); or the router's top k experts, a
//                                                              softmax over their k scores, summed
//   logits = out_head(final_norm(x)) (* logit_scale, Tiny Aya)
//
// The residual stream, norms, RoPE, attention and activations are float32 whatever the weights; a bfloat16 model's
// products read its bfloat16 weights against float32 inputs (rows_avx2.h), and its cache keeps keys and values
// rounded to bfloat16 as the glass model's does. Each product is one OpenMP region whose threads each stream a
// contiguous share of the rows; the q/k/v products share a region, and so do fc1 and fc2 with the activation.
#include <math.h>

#include "rows_avx2.h"

namespace {

using namespace avx2;

// plan[]: HEADER entries, then LAYER_FIELDS per block, in these orders (engine/described_step.py's HEADER_FIELDS
// and LAYER_FIELDS name them). Numbers that are not integers are stored as the bits of a double.
enum Header {
    H_BF16, H_LAYERS, H_D, H_VOCAB, H_TOK_EMB, H_EMB_SCALE, H_FINAL_NORM, H_FINAL_KIND, H_EPS, H_HEAD,
    H_X, H_H, H_Q, H_K, H_V, H_ATT, H_GATE, H_UP, H_OUT, H_LOGITS, H_PAIRS, H_SCORES, H_ROUTER, H_BEST,
    H_BEST_VALUE, H_MAX_LEN, H_LOGIT_SCALE, H_RESID, H_LINEAR_SCRATCH, HEADER = 32
};
enum Layer {
    L_HEADS, L_GROUPS, L_HEAD_DIM, L_HIDDEN, L_SLOTS, L_RING, L_SCALE, L_NORM_KINDS, L_QK_WHOLE, L_ROPE_COS,
    L_ROPE_SIN, L_ATTN_IN, L_ATTN_OUT, L_FF_IN, L_FF_OUT, L_Q_NORM, L_K_NORM, L_WQ, L_WK, L_WV, L_WO, L_FC1,
    L_FC2, L_FC3, L_ACT, L_ROUTER, L_EXPERTS, L_TOP_K, L_EXPERT_W, L_NEIGHBOURS, L_PARALLEL, L_ROTARY, L_GATED,
    L_LINEAR, L_IN_QKV, L_IN_Z, L_IN_B, L_IN_A, L_CONV_W, L_A_LOG, L_DT_BIAS, L_GATED_NORM, L_KEY_HEADS, L_VALUE_HEADS,
    L_KEY_DIM, L_VALUE_DIM, L_CONV_KERNEL, L_CONV, L_STATE, L_KCACHE, L_VCACHE, LAYER_FIELDS
};
// L_NORM_KINDS: two bits per norm, in this order, of its kind (and H_FINAL_KIND the final norm's).
enum Norms { P_ATTN_IN, P_ATTN_OUT, P_FF_IN, P_FF_OUT, P_Q, P_K };
enum NormKind { RMS, RMS_PLUS_ONE, LAYER_NORM };
enum Act { ACT_SILU, ACT_GELU_TANH };

template <typename P> P* at(const int64_t* plan, int i) { return reinterpret_cast<P*>(plan[i]); }

double number(const int64_t* plan, int i) {
    double v;
    memcpy(&v, plan + i, 8);
    return v;
}

// 8 values of a row as float32, from float32 or bfloat16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// sum(a[i] * b[i]) over n (a float32, b either).
template <typename T>
float dot(const float* a, const T* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * load1(b, i);
    return s;
}

// y = x / sqrt(mean(x^2) + eps) * w (RMS), * (1 + w) (RMS_PLUS_ONE), or (x - mean) / sqrt(var + eps) * w
// (LAYER_NORM, without a shift), over n (y may be x); w null: no weight.
template <typename T>
void norm_of(const float* x, const T* w, int64_t kind, float* y, int64_t n, float eps) {
    float mean = 0.f;
    if (kind == LAYER_NORM) {
        for (int64_t i = 0; i < n; i++) mean += x[i];
        mean /= (float)n;
    }
    float square = 0.f;
    for (int64_t i = 0; i < n; i++) square += (x[i] - mean) * (x[i] - mean);
    const float inv = 1.f / sqrtf(square / (float)n + eps);
    for (int64_t i = 0; i < n; i++) {
        const float scale = w == nullptr ? 1.f : kind == RMS_PLUS_ONE ? 1.f + load1(w, i) : load1(w, i);
        y[i] = (x[i] - mean) * inv * scale;
    }
}

// The rotation of each pair by this position's angle; cos, sin: its rows of the tables. The pairs are
// (v[i], v[i + hd/2]) (halves: the book's and transformers' layout) or (v[2i], v[2i + 1]) (neighbours: Cohere's).
void rotate(float* v, const float* cos, const float* sin, int64_t hd, bool neighbours) {
    const int64_t half = hd / 2, a = neighbours ? 2 : 1, b = neighbours ? 1 : half;  // pair i: v[a i], v[a i + b]
    for (int64_t i = 0; i < half; i++) {
        const int64_t j = a * i, k = a * i + b;
        const float x1 = v[j], x2 = v[k];
        v[j] = x1 * cos[j] - x2 * sin[j];
        v[k] = x2 * cos[k] + x1 * sin[k];
    }
}

float activation(float a, int64_t act) {
    if (act == ACT_SILU) return a / (1.f + expf(-a));
    const float inner = 0.7978845608028654f * (a + 0.044715f * a * a * a);  // sqrt(2 / pi) (a + 0.044715 a^3)
    return 0.5f * a * (1.f + tanhf(inner));
}

// x as the products read it: float32 as it is; for bfloat16 weights, in rows_avx2.h's pair order (into `pairs`).
const float* as_input(const float* x, int64_t K, bool bf16_weights, float* pairs) {
    if (!bf16_weights) return x;
    widen_pairs(x, pairs, K);
    return pairs;
}

// Rows [lo, hi) of y = W x, W [N, K] of the model's dtype; x from as_input. Runs on the calling thread.
void rows(const void* W, bool bf16_weights, const float* x, float* y, int64_t K, int64_t lo, int64_t hi) {
    auto finish = [&](int64_t, int64_t n, float v) { y[n] = v; };
    if (bf16_weights)
        row_range(lo, hi, 1, [&](auto R, auto MB, int64_t n, int64_t, float (*out)[4]) {
            bf16_rows<R.value, MB.value>((const bf16*)W + n * K, x, K, K, out);
        }, finish);
    else
        row_range(lo, hi, 1, [&](auto R, auto MB, int64_t n, int64_t, float (*out)[4]) {
            f32_rows<R.value, MB.value>((const float*)W + n * K, x, K, K, out);
        }, finish);
}

// This thread's share of y = W x (inside a parallel region; alone, the whole).
void product(const void* W, bool bf16_weights, const float* x, float* y, int64_t N, int64_t K) {
    int64_t lo, hi;
    share(N, &lo, &hi);
    rows(W, bf16_weights, x, y, K, lo, hi);
}

// gate <- act(W1 h) * (W2 h), both [F, d]; then out = W3 gate, W3 [d, F]. h already as_input'd.
void feed_forward(const void* w1, const void* w2, const void* w3, bool bf16, int64_t act, const float* h,
                  float* gate, float* up, float* out, float* pairs, int64_t d, int64_t F, int nt) {
#pragma omp parallel num_threads(nt)
    {
        int64_t lo, hi;
        share(F, &lo, &hi);
        rows(w1, bf16, h, gate, d, lo, hi);
        rows(w2, bf16, h, up, d, lo, hi);
        for (int64_t i = lo; i < hi; i++) gate[i] = activation(gate[i], act) * up[i];
    }
    const float* a = as_input(gate, F, bf16, pairs);
#pragma omp parallel num_threads(nt)
    product(w3, bf16, a, out, d, F);
}

// Qwen3.5's linear attention (Gated DeltaNet) for one token, from the normed stream `hin` (as_input'd) into `out`
// [d]: in_proj_qkv's c channels through the short causal convolution (its last kernel - 1 inputs kept in the plan's
// conv buffer [c, kernel - 1], in the weights' dtype, as the glass model's cache keeps them) and silu; q and k of
// each key head to unit length (q also times dk^-0.5); beta = sigmoid(in_proj_b), g = -exp(A_log) softplus(in_proj_a
// + dt_bias); then for each value head j (reading key head j / (hv / hk)) the delta rule on its float32 state S
// [dk, dv]: S <- exp(g) S, S += k (beta (v - S^T k))^T, out = S^T q; each head's output normed (weight x / rms)
// times silu(in_proj_z); then out_proj.
template <typename T>
void gated_delta(const int64_t* L, const float* hin, bool bf16, int64_t d, float* out, float* pairs, float* scratch,
                 float eps, int nt) {
    const int64_t hk = L[L_KEY_HEADS], hv = L[L_VALUE_HEADS], dk = L[L_KEY_DIM], dv = L[L_VALUE_DIM];
    const int64_t K = L[L_CONV_KERNEL], c = 2 * hk * dk + hv * dv;
    float *mixed = scratch, *z = mixed + c, *beta = z + hv * dv, *g = beta + hv, *core = g + hv;
#pragma omp parallel num_threads(nt)
    {
        product(at<const void>(L, L_IN_QKV), bf16, hin, mixed, c, d);
        product(at<const void>(L, L_IN_Z), bf16, hin, z, hv * dv, d);
        product(at<const void>(L, L_IN_B), bf16, hin, beta, hv, d);
        product(at<const void>(L, L_IN_A), bf16, hin, g, hv, d);
    }
    T* conv = at<T>(L, L_CONV);  // [c, K - 1]: the inputs of the last K - 1 tokens, oldest first
    const T* w = at<const T>(L, L_CONV_W);  // [c, 1, K]
    for (int64_t ch = 0; ch < c; ch++) {
        T* kept = conv + ch * (K - 1);
        T now;
        store1(&now, 0, mixed[ch]);  // the input as the glass model's cache keeps it (rounded in bfloat16)
        float s = load1(&now, 0) * load1(w, ch * K + K - 1);
        for (int64_t j = 0; j < K - 1; j++) s += load1(kept, j) * load1(w, ch * K + j);
        for (int64_t j = 0; j + 1 < K - 1; j++) kept[j] = kept[j + 1];
        if (K > 1) kept[K - 2] = now;
        mixed[ch] = s / (1.f + expf(-s));  // silu
    }
    float *q = mixed, *k = mixed + hk * dk, *v = mixed + 2 * hk * dk;
    for (int64_t i = 0; i < 2 * hk; i++) {  // l2norm, eps inside the root
        float* u = mixed + i * dk;
        const float inv = 1.f / sqrtf(dot(u, u, dk) + 1e-6f) * (i < hk ? 1.f / sqrtf((float)dk) : 1.f);
        for (int64_t j = 0; j < dk; j++) u[j] *= inv;
    }
    const T *a_log = at<const T>(L, L_A_LOG), *dt_bias = at<const T>(L, L_DT_BIAS);
    for (int64_t j = 0; j < hv; j++) {
        const float a = g[j] + load1(dt_bias, j);
        const float softplus = a > 20.f ? a : log1pf(expf(a));
        g[j] = -expf(load1(a_log, j)) * softplus;
        beta[j] = 1.f / (1.f + expf(-beta[j]));
    }
    float* state = at<float>(L, L_STATE);  // [hv, dk, dv]
    const T* gnorm = at<const T>(L, L_GATED_NORM);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t j = 0; j < hv; j++) {
        const float *qj = q + (j / (hv / hk)) * dk, *kj = k + (j / (hv / hk)) * dk, *vj = v + j * dv;
        float* S = state + j * dk * dv;
        float* o = core + j * dv;
        float predicted[512];  // dv <= 512 (described_step.py)
        const float decay = expf(g[j]);
        for (int64_t e = 0; e < dv; e++) predicted[e] = 0.f;
        for (int64_t i = 0; i < dk; i++)
            for (int64_t e = 0; e < dv; e++) predicted[e] += kj[i] * (S[i * dv + e] *= decay);
        for (int64_t e = 0; e < dv; e++) predicted[e] = (vj[e] - predicted[e]) * beta[j];  // delta
        for (int64_t e = 0; e < dv; e++) o[e] = 0.f;
        for (int64_t i = 0; i < dk; i++)
            for (int64_t e = 0; e < dv; e++) o[e] += qj[i] * (S[i * dv + e] += kj[i] * predicted[e]);
        const float inv = 1.f / sqrtf(dot(o, o, dv) / (float)dv + eps);
        for (int64_t e = 0; e < dv; e++) {
            const float gate = z[j * dv + e];
            o[e] = load1(gnorm, e) * (o[e] * inv) * (gate / (1.f + expf(-gate)));
        }
    }
    const float* cin = as_input(core, hv * dv, bf16, pairs);
#pragma omp parallel num_threads(nt)
    product(at<const void>(L, L_WO), bf16, cin, out, d, hv * dv);
}

template <typename T>
void step(const int64_t* plan, int64_t id, int64_t pos, int nt) {
    const bool bf16 = plan[H_BF16];
    const int64_t d = plan[H_D], V = plan[H_VOCAB];
    const float eps = (float)number(plan, H_EPS);
    float *x = at<float>(plan, H_X), *h = at<float>(plan, H_H), *q = at<float>(plan, H_Q), *k = at<float>(plan, H_K),
          *v = at<float>(plan, H_V), *att = at<float>(plan, H_ATT), *gate = at<float>(plan, H_GATE),
          *up = at<float>(plan, H_UP), *out = at<float>(plan, H_OUT), *pairs = at<float>(plan, H_PAIRS),
          *all_scores = at<float>(plan, H_SCORES), *logits = at<float>(plan, H_LOGITS);  // scores: max_len a thread

    const T* emb = at<const T>(plan, H_TOK_EMB) + id * d;
    const double emb_scale = number(plan, H_EMB_SCALE);  // 0: none
    for (int64_t i = 0; i < d; i++) x[i] = emb_scale ? load1(emb, i) * (float)emb_scale : load1(emb, i);

    for (int64_t layer = 0; layer < plan[H_LAYERS]; layer++) {
        const int64_t* L = plan + HEADER + layer * LAYER_FIELDS;
        const int64_t H = L[L_HEADS], G = L[L_GROUPS], hd = L[L_HEAD_DIM], F = L[L_HIDDEN], slots = L[L_SLOTS];
        const int64_t kinds = L[L_NORM_KINDS];
        auto norm = [&](const float* in, float* dst, int field, int which, int64_t n) {
            if (L[field]) norm_of(in, at<const T>(L, field), (kinds >> (2 * which)) & 3, dst, n, eps);
            else if (dst != in) memcpy(dst, in, n * sizeof(float));
        };

        // Attention: q, k, v of the normed stream (or, in a linear layer, its recurrent state).
        norm(x, h, L_ATTN_IN, P_ATTN_IN, d);
        const float* hin = as_input(h, d, bf16, pairs);
        if (L[L_LINEAR]) {
            gated_delta<T>(L, hin, bf16, d, out, pairs, at<float>(plan, H_LINEAR_SCRATCH), eps, nt);
        } else {
        // A gated layer's W_query (Qwen3.5's) holds, per head, hd query rows then hd gate rows: q's heads are 2 hd apart.
        const int64_t qs = L[L_GATED] ? 2 * hd : hd;
#pragma omp parallel num_threads(nt)
        {
            product(at<const void>(L, L_WQ), bf16, hin, q, H * qs, d);
            product(at<const void>(L, L_WK), bf16, hin, k, G * hd, d);
            product(at<const void>(L, L_WV), bf16, hin, v, G * hd, d);
        }
        if (L[L_QK_WHOLE]) {  // OLMo 3: one norm over the whole projection
            norm(q, q, L_Q_NORM, P_Q, H * hd);
            norm(k, k, L_K_NORM, P_K, G * hd);
        } else {
            for (int64_t i = 0; i < H; i++) norm(q + i * qs, q + i * qs, L_Q_NORM, P_Q, hd);
            for (int64_t i = 0; i < G; i++) norm(k + i * hd, k + i * hd, L_K_NORM, P_K, hd);
        }
        if (L[L_ROPE_COS]) {  // (a layer without positions, Tiny Aya's full layers: no tables)
            const int64_t rd = L[L_ROTARY];  // the dimensions turned (Qwen3.5: the first quarter), the tables' width
            const float *cos = at<const float>(L, L_ROPE_COS) + pos * rd, *sin = at<const float>(L, L_ROPE_SIN) + pos * rd;
            for (int64_t i = 0; i < H; i++) rotate(q + i * qs, cos, sin, rd, L[L_NEIGHBOURS]);
            for (int64_t i = 0; i < G; i++) rotate(k + i * hd, cos, sin, rd, L[L_NEIGHBOURS]);
        }
        T *keys = at<T>(L, L_KCACHE), *values = at<T>(L, L_VCACHE);  // [G, slots, hd]
        const int64_t slot = L[L_RING] ? pos % slots : pos, seen = L[L_RING] ? (pos + 1 < slots ? pos + 1 : slots) : pos + 1;
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < hd; i++) {
                store1(keys, (g * slots + slot) * hd + i, k[g * hd + i]);
                store1(values, (g * slots + slot) * hd + i, v[g * hd + i]);
            }
        const float scale = (float)number(L, L_SCALE);
        // Each head on a thread of its own once the window holds enough to pay for the threads' start.
#pragma omp parallel for num_threads(nt) schedule(static) if (seen * hd * H >= (1 << 16))
        for (int64_t head = 0; head < H; head++) {
            const int64_t g = head / (H / G);
            const T *kg = keys + g * slots * hd, *vg = values + g * slots * hd;
            float* scores = all_scores + omp_get_thread_num() * plan[H_MAX_LEN];
            float top = -INFINITY;
            for (int64_t j = 0; j < seen; j++) {
                scores[j] = dot(q + head * qs, kg + j * hd, hd) * scale;
                top = scores[j] > top ? scores[j] : top;
            }
            float total = 0.f;
            for (int64_t j = 0; j < seen; j++) total += scores[j] = expf(scores[j] - top);
            float* o = att + head * hd;
            for (int64_t i = 0; i < hd; i++) o[i] = 0.f;
            for (int64_t j = 0; j < seen; j++) {
                const float p = scores[j] / total;
                for (int64_t i = 0; i < hd; i++) o[i] += p * load1(vg + j * hd, i);
            }
            if (L[L_GATED])  // the output gate: each head's context times sigmoid(its gate rows)
                for (int64_t i = 0; i < hd; i++) o[i] /= 1.f + expf(-q[head * qs + hd + i]);
        }
        const float* ain = as_input(att, H * hd, bf16, pairs);
#pragma omp parallel num_threads(nt)
        product(at<const void>(L, L_WO), bf16, ain, out, d, H * hd);
        }
        norm(out, out, L_ATTN_OUT, P_ATTN_OUT, d);
        float* resid = at<float>(plan, H_RESID);
        if (L[L_PARALLEL]) memcpy(resid, out, d * sizeof(float));  // (added with the feed-forward's, to the same x)
        else for (int64_t i = 0; i < d; i++) x[i] += out[i];

        // Feed-forward, dense or the routed experts: of the normed stream after attention, or (a parallel block,
        // Tiny Aya's) of the same normed input attention read.
        if (!L[L_PARALLEL]) norm(x, h, L_FF_IN, P_FF_IN, d);
        const float* fin = as_input(h, d, bf16, pairs);
        if (!L[L_EXPERTS]) {
            feed_forward(at<const void>(L, L_FC1), at<const void>(L, L_FC2), at<const void>(L, L_FC3), bf16, L[L_ACT],
                         fin, gate, up, out, pairs + d, d, F, nt);
        } else {
            const int64_t E = L[L_EXPERTS], K = L[L_TOP_K];
            float* router = at<float>(plan, H_ROUTER);
#pragma omp parallel num_threads(nt)
            product(at<const void>(L, L_ROUTER), bf16, fin, router, E, d);
            // The k largest scores (the first of equals), then a softmax over those k alone.
            int64_t chosen[64];
            float weight[64];
            for (int64_t c = 0; c < K; c++) {
                int64_t best = -1;
                for (int64_t e = 0; e < E; e++) {
                    bool taken = false;
                    for (int64_t p = 0; p < c; p++) taken |= chosen[p] == e;
                    if (!taken && (best < 0 || router[e] > router[best])) best = e;
                }
                chosen[c] = best;
            }
            float total = 0.f;
            for (int64_t c = 0; c < K; c++) total += weight[c] = expf(router[chosen[c]] - router[chosen[0]]);
            for (int64_t c = 0; c < K; c++) weight[c] /= total;
            // Summed in ascending expert order, as the glass model's index_add_ sums them.
            for (int64_t a = 0; a < K; a++)
                for (int64_t b = a + 1; b < K; b++)
                    if (chosen[b] < chosen[a]) {
                        int64_t e = chosen[a]; chosen[a] = chosen[b]; chosen[b] = e;
                        float w = weight[a]; weight[a] = weight[b]; weight[b] = w;
                    }
            const int64_t* experts = at<const int64_t>(L, L_EXPERT_W);  // [E][fc1, fc2, fc3]
            float* sum = at<float>(plan, H_ROUTER) + E;
            for (int64_t i = 0; i < d; i++) sum[i] = 0.f;
            for (int64_t c = 0; c < K; c++) {
                const int64_t* w = experts + 3 * chosen[c];
                feed_forward((const void*)w[0], (const void*)w[1], (const void*)w[2], bf16, L[L_ACT], fin, gate, up,
                             out, pairs + d, d, F, nt);
                for (int64_t i = 0; i < d; i++) sum[i] += out[i] * weight[c];
            }
            memcpy(out, sum, d * sizeof(float));
        }
        norm(out, out, L_FF_OUT, P_FF_OUT, d);
        for (int64_t i = 0; i < d; i++) x[i] += L[L_PARALLEL] ? resid[i] + out[i] : out[i];
    }

    if (plan[H_FINAL_NORM]) norm_of(x, at<const T>(plan, H_FINAL_NORM), plan[H_FINAL_KIND], h, d, eps);
    else memcpy(h, x, d * sizeof(float));
    const float* hin = as_input(h, d, bf16, pairs);
#pragma omp parallel num_threads(nt)
    product(at<const void>(plan, H_HEAD), bf16, hin, logits, V, d);
    const double logit_scale = number(plan, H_LOGIT_SCALE);  // 0: none (Tiny Aya's 0.25)
    if (logit_scale)
        for (int64_t i = 0; i < V; i++) logits[i] *= (float)logit_scale;

    // The greedy pick: the first largest logit, or the first NaN as torch.argmax takes it.
    int64_t best = 0;
    for (int64_t i = 0; i < V; i++) {
        if (logits[i] != logits[i]) { best = i; break; }
        if (logits[i] > logits[best]) best = i;
    }
    *at<int64_t>(plan, H_BEST) = best;
    *at<float>(plan, H_BEST_VALUE) = logits[best];
}

}  // namespace

extern "C" {

void gg_described_step(const int64_t* plan, const int64_t* ids, int64_t pos, int nt) {
    if (plan[H_BF16]) step<bf16>(plan, ids[0], pos, nt);
    else step<float>(plan, ids[0], pos, nt);
}

}  // extern "C"
