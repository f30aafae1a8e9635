#pragma once
// What every matrix-vector kernel shares, whatever its instruction set (gemv.h: AVX-512; gemv_avx2.cpp:
// AVX2): bfloat16 as bits, one value loaded or stored in either precision, each OpenMP thread's share of
// W's rows, and the loop over those rows, 4 of W against up to MAXM of x at a time. No intrinsics here.
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include <type_traits>

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 f32_to_bf16(float f) {  // round to nearest even, as torch does
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

template <typename T> static inline float load1(const T* p, int64_t i);
template <> inline float load1<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load1<bf16>(const bf16* p, int64_t i) { return bf16_to_f32(p[i]); }
template <typename T> static inline void store1(T* p, int64_t i, float v);
template <> inline void store1<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store1<bf16>(bf16* p, int64_t i, float v) { p[i] = f32_to_bf16(v); }

// This thread's share [lo, hi) of `n` units.
static inline void share(int64_t n, int64_t* lo, int64_t* hi) {
    int t = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t per = n / nt, extra = n % nt;
    *lo = t * per + (t < extra ? t : extra);
    *hi = *lo + per + (t < extra ? 1 : 0);
}

// ---------------------------------------------------------------------------------------------
// The loop over rows, shared by the row-major kernels. `rows(R, MB, n, m0, out)` computes rows
// n..n+R-1 of W against rows m0..m0+MB-1 of x into out[m][r]; `finish(m, n, v)` stores one result.

#define MAXM 4
template <int V> using I = std::integral_constant<int, V>;

template <class Rows, class Finish>
static inline void row_range(int64_t lo, int64_t hi, int64_t M, Rows rows, Finish finish) {
    float out[MAXM][4];
    for (int64_t n = lo; n < hi;) {
        if (hi - n >= 4) {
            for (int64_t m0 = 0; m0 < M; m0 += MAXM) {
                int64_t mb = M - m0 < MAXM ? M - m0 : MAXM;
                switch (mb) {
                    case 1: rows(I<4>{}, I<1>{}, n, m0, out); break;
                    case 2: rows(I<4>{}, I<2>{}, n, m0, out); break;
                    case 3: rows(I<4>{}, I<3>{}, n, m0, out); break;
                    default: rows(I<4>{}, I<4>{}, n, m0, out); break;
                }
                for (int64_t m = 0; m < mb; m++)
                    for (int64_t i = 0; i < 4; i++) finish(m0 + m, n + i, out[m][i]);
            }
            n += 4;
        } else {
            for (int64_t m = 0; m < M; m++) {
                rows(I<1>{}, I<1>{}, n, m, out);
                finish(m, n, out[0][0]);
            }
            n += 1;
        }
    }
}

// This thread's share of N rows.
template <class Rows, class Finish>
static inline void row_loop(int64_t N, int64_t M, Rows rows, Finish finish) {
    int64_t lo, hi;
    share(N, &lo, &hi);
    row_range(lo, hi, M, rows, finish);
}
