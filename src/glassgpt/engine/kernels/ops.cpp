// gemv.cpp's kernels as torch operators, so that eager code and torch.compile'd graphs call
// them through the dispatcher (a few microseconds) rather than through Python:
//
//   torch.ops.glassgpt.gemv(x, weight, bias?)                       float32 or bfloat16
//   torch.ops.glassgpt.gemv_q8(x, weight, scales, bias?)            int8 weight, per-row scales
//   torch.ops.glassgpt.gemv_q4(x, packed, scales_mins, bias?, N, gs) int4.py's 4-bit layout
//   torch.ops.glassgpt.gelu_tanh(x)                                  GELU's tanh form, elementwise
//
// x is [M, K] (a few rows); the result is [M, N] in x's dtype. Shapes for torch.compile (the
// "fake" implementations) are registered in engine/native.py. Compiled without AVX-512 flags:
// only gemv.cpp's functions use those instructions. With GG_GEMV_ONLY (the AVX2 build, gemv_avx2.cpp)
// only `gemv` and `features` are registered.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

extern "C" {
int gg_features(void);
void gg_gemv_f32(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int);
void gg_gemv_bf16(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, int);
void gg_gemv_bf16_widen(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                        float*, int);
#ifndef GG_GEMV_ONLY
void gg_gemv_q8(const int8_t*, const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int,
                int16_t*, float*, int);
void gg_gemv_q4(const uint8_t*, const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int64_t,
                int, int8_t*, float*, float*, int);
void gg_gelu_tanh(const void*, void*, int64_t, int, int);
#endif
}

namespace {

void check(const at::Tensor& t, at::ScalarType dtype, int64_t dim, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype && t.dim() == dim,
                "glassgpt kernel: ", what, " must be a contiguous CPU tensor of ", dim, " dims and dtype ", dtype);
}

const void* bias_ptr(const std::optional<at::Tensor>& bias, at::ScalarType dtype, int64_t n) {
    if (!bias.has_value()) return nullptr;
    check(*bias, dtype, 1, "bias");
    TORCH_CHECK(bias->size(0) == n, "glassgpt kernel: bias has ", bias->size(0), " entries, not ", n);
    return bias->data_ptr();
}

bool is_bf16(const at::Tensor& x) {
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                "glassgpt kernel: x must be float32 or bfloat16");
    return x.scalar_type() == at::kBFloat16;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
    const auto dtype = x.scalar_type();
    const bool bf = is_bf16(x);
    check(x, dtype, 2, "x");
    check(weight, dtype, 2, "weight");
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    TORCH_CHECK(weight.size(1) == K, "glassgpt kernel: weight is [", N, ", ", weight.size(1), "], x has ", K, " columns");
    const void* b = bias_ptr(bias, dtype, N);
    at::Tensor y = at::empty({M, N}, x.options());
    const int nt = at::get_num_threads();
    if (!bf) {
        gg_gemv_f32(weight.const_data_ptr<float>(), x.const_data_ptr<float>(), static_cast<const float*>(b),
                    y.mutable_data_ptr<float>(), M, N, K, nt);
    } else if (gg_features() & 2) {
        gg_gemv_bf16(static_cast<const uint16_t*>(weight.const_data_ptr()), static_cast<const uint16_t*>(x.const_data_ptr()),
                     static_cast<const uint16_t*>(b), static_cast<uint16_t*>(y.mutable_data_ptr()), M, N, K, nt);
    } else {
        at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
        gg_gemv_bf16_widen(static_cast<const uint16_t*>(weight.const_data_ptr()),
                           static_cast<const uint16_t*>(x.const_data_ptr()), static_cast<const uint16_t*>(b),
                           static_cast<uint16_t*>(y.mutable_data_ptr()), M, N, K, xf.mutable_data_ptr<float>(), nt);
    }
    return y;
}

#ifndef GG_GEMV_ONLY
at::Tensor gemv_q8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                   const std::optional<at::Tensor>& bias) {
    const auto dtype = x.scalar_type();
    const bool bf = is_bf16(x);
    check(x, dtype, 2, "x");
    check(weight, at::kChar, 2, "weight");
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    TORCH_CHECK(weight.size(1) == K, "glassgpt kernel: weight is [", N, ", ", weight.size(1), "], x has ", K, " columns");
    check(scales, dtype, 1, "scales");
    TORCH_CHECK(scales.size(0) == N, "glassgpt kernel: ", scales.size(0), " scales for ", N, " rows");
    const void* b = bias_ptr(bias, dtype, N);
    at::Tensor y = at::empty({M, N}, x.options());
    at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kShort));
    at::Tensor xs = at::empty({M}, x.options().dtype(at::kFloat));
    gg_gemv_q8(weight.const_data_ptr<int8_t>(), scales.const_data_ptr(), x.const_data_ptr(), b, y.mutable_data_ptr(),
               M, N, K, bf, xq.mutable_data_ptr<int16_t>(), xs.mutable_data_ptr<float>(), at::get_num_threads());
    return y;
}

at::Tensor gemv_q4(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_mins,
                   const std::optional<at::Tensor>& bias, int64_t N, int64_t gs) {
    const auto dtype = x.scalar_type();
    const bool bf = is_bf16(x);
    check(x, dtype, 2, "x");
    const int64_t M = x.size(0), K = x.size(1), NB = (N + 15) / 16;
    TORCH_CHECK(gs % 8 == 0 && K % gs == 0, "glassgpt kernel: group size ", gs, " must divide ", K, " and be a multiple of 8");
    check(packed, at::kByte, 3, "packed weight");
    TORCH_CHECK(packed.size(0) == NB && packed.size(1) == K / 8 && packed.size(2) == 64,
                "glassgpt kernel: packed weight must be [", NB, ", ", K / 8, ", 64]");
    check(scales_mins, dtype, 4, "scales_mins");
    TORCH_CHECK(scales_mins.size(0) == NB && scales_mins.size(1) == K / gs && scales_mins.size(2) == 2 &&
                    scales_mins.size(3) == 16,
                "glassgpt kernel: scales_mins must be [", NB, ", ", K / gs, ", 2, 16]");
    const void* b = bias_ptr(bias, dtype, N);
    at::Tensor y = at::empty({M, N}, x.options());
    at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
    at::Tensor xscale = at::empty({M, K / gs}, x.options().dtype(at::kFloat));
    at::Tensor xsum = at::empty({M, K / gs}, x.options().dtype(at::kFloat));
    gg_gemv_q4(packed.const_data_ptr<uint8_t>(), scales_mins.const_data_ptr(), x.const_data_ptr(), b,
               y.mutable_data_ptr(), M, N, K, gs, bf, xq.mutable_data_ptr<int8_t>(), xscale.mutable_data_ptr<float>(),
               xsum.mutable_data_ptr<float>(), at::get_num_threads());
    return y;
}

at::Tensor gelu_tanh(const at::Tensor& x) {
    const bool bf = is_bf16(x);
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "glassgpt kernel: x must be a contiguous CPU tensor");
    at::Tensor y = at::empty(x.sizes(), x.options());
    gg_gelu_tanh(x.const_data_ptr(), y.mutable_data_ptr(), x.numel(), bf, at::get_num_threads());
    return y;
}

#endif

int64_t features() { return gg_features(); }

}  // namespace

TORCH_LIBRARY(glassgpt, m) {
    m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
    m.def("features() -> int", &features);
#ifndef GG_GEMV_ONLY
    m.def("gemv_q8(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
    m.def("gemv_q4(Tensor x, Tensor packed, Tensor scales_mins, Tensor? bias, int out_features, int group_size) -> Tensor");
    m.def("gelu_tanh(Tensor x) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(glassgpt, CPU, m) {
    m.impl("gemv", &gemv);
#ifndef GG_GEMV_ONLY
    m.impl("gemv_q8", &gemv_q8);
    m.impl("gemv_q4", &gemv_q4);
    m.impl("gelu_tanh", &gelu_tanh);
#endif
}
