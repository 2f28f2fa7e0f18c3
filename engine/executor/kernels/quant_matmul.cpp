// The quant_matmul and dequantize_rows ops' entry points: the weight's tensors checked, the
// activations quantized, the call dispatched by code width to the kernel (quant_matmul_kernel.h
// says what it computes and how).

#include <ATen/ops/empty.h>

#include "ops.h"
#include "quant_matmul_kernel.h"

namespace {

using namespace prefixgate::qmm;

// Rows `ids` of the weight as float32 [len(ids), K]: w = code * d + m rounded as GGML's
// dequantizers round it (the product, then the sum; m = -0.0 where the layout has none), so a
// tied embedding read from the head's blocks holds the file's values bit for bit.
template <int BITS, bool HALVES, int MINS>
void dequantize_impl(const LayoutSpan<BITS, HALVES, MINS>& base, int64_t groups,
                     const int64_t* ids, int64_t count, float* out) {
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = ids[i], t = id / kTile % kTileBlock, r = id % kTile;
      const auto span = base.unit(id / (kTile * kTileBlock), groups);
      for (int64_t g = 0; g < groups; ++g) {
        float d[2], m[2] = {-0.f, -0.f};
        for (int half = 0; half < 2; ++half) {
          d[half] = scale_at(span, t, HALVES ? half : 0, g, r);
          if constexpr (MINS > 0) m[half] = scale_at(span, t, m_row<HALVES, MINS>(1 + half), g, r);
        }
        float* row = out + i * groups * kGroup + g * kGroup;
        for (int col = 0; col < kGroup; ++col) {
          const float w = static_cast<float>(code_at(span, t, g, r, col)) * d[col / 16];
          row[col] = w + m[col / 16];
        }
      }
    }
  });
}

// A weight's layout, checked against its tensors: the op's one reading of them.
struct WeightLayout {
  int64_t groups;  // K / 32
  int64_t mins;    // scale rows of m after the d (see quant_matmul)
  ScaleForm form;
  const at::Half* factors;  // kFactored only
};

// Literal messages only: on the lent device's image (g++ 13.3, torch 2.11) a TORCH_CHECK
// that formats a number into its message segfaults instead of raising, in any extension
// (a one-line probe showed it; docs/benchmarks.md), where a literal one raises.
WeightLayout check_weight(const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                          int64_t n, const std::optional<at::Tensor>& factors, bool halves) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8 || bits == kLevels,
              "quantized weight: bits must be 4, 5, 6, 8 or 12 (IQ4 levels)");
  TORCH_CHECK(n >= 0 && n % kTile == 0, "quantized weight: N must be a multiple of 8");
  const int64_t units = (n + 2 * kTile - 1) / (2 * kTile);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 3 &&
                  codes.size(0) == units && codes.size(2) == 64 * code_chunks(bits),
              "quantized weight: codes must be a contiguous uint8 [ceil(N / 16), K / 32, "
              "64 * bits]");
  const int64_t groups = codes.size(1);
  // scale rows: the d (one a group, or with `halves` one a 16-column half), then the mins:
  // 1 d alone (m = 0), 2 d and m, or with halves 2 the two d alone (Q6_K's, Q3_K's), 3 and m,
  // 4 and an m per half (Q2_K's)
  const int64_t parts = scales.dim() == 4 ? scales.size(2) : 0;
  const int64_t mins = parts - (halves ? 2 : 1);
  const bool factored = factors.has_value();
  TORCH_CHECK((factored ? scales.scalar_type() == at::kChar
                        : scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) &&
                  scales.is_contiguous() && parts >= 1 && parts <= 4 &&
                  scales.sizes() == at::IntArrayRef({units, groups, parts, 2 * kTile}),
              "quantized weight: scales must be a contiguous float16 or float32 (int8 with "
              "factors) [ceil(N / 16), K / 32, 1 to 4, 16]");
  TORCH_CHECK(mins >= 0 && mins <= (halves ? 2 : 1),
              "quantized weight: scale rows must be 1 or 2 (d, m), or with halves 2 to 4 (two "
              "d, then no m, one, or one a half)");
  TORCH_CHECK(!factored || (groups % 8 == 0 && factors->scalar_type() == at::kHalf &&
                            factors->is_contiguous() &&
                            factors->sizes() ==
                                at::IntArrayRef({units, groups / 8, parts, 2 * kTile})),
              "quantized weight: factors must be a contiguous float16 [ceil(N / 16), K / 256, "
              "scale rows, 16] (K a multiple of 256)");
  const ScaleForm form = factored                             ? ScaleForm::kFactored
                         : scales.scalar_type() == at::kFloat ? ScaleForm::kFloat
                                                              : ScaleForm::kHalf;
  return {groups, mins, form, factored ? factors->data_ptr<at::Half>() : nullptr};
}

// f(bits, halves, mins), each a compile-time constant: the layouts there are.
template <typename F>
void with_layout(int64_t bits, bool halves, int64_t mins, const F& f) {
  with_width(bits, [&](auto bits_tag) {
    with_rows(halves, mins,
              [&](auto halves_tag, auto mins_tag) { f(bits_tag, halves_tag, mins_tag); });
  });
}

}  // namespace

namespace prefixgate::ops {

using namespace qmm;

// Which integer dot products this build runs, for the start-up line: "amx+avx512-vnni" (AMX
// tiles for blocks of 16 rows, VNNI for the rest), "avx512-vnni", "avx2" or "portable".
std::string quant_matmul_path() {
#if PREFIXGATE_QMM_AMX
  if (amx_ready()) return "amx+avx512-vnni";
#endif
  if (kVnniBuild) return "avx512-vnni";
#if PREFIXGATE_QMM_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                           int64_t n, const at::Tensor& ids,
                           const std::optional<at::Tensor>& factors, bool halves) {
  const WeightLayout layout = check_weight(codes, scales, bits, n, factors, halves);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1,
              "dequantize_rows: rows must be a 1-D int64 tensor");
  const at::Tensor rows = ids.contiguous();
  const int64_t count = rows.size(0);
  const int64_t* id_ptr = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id_ptr[i] >= 0 && id_ptr[i] < n, "dequantize_rows: a row is out of range");
  at::Tensor out = at::empty({count, layout.groups * kGroup}, codes.options().dtype(at::kFloat));
  with_layout(bits, halves, layout.mins, [&](auto bits_tag, auto halves_tag, auto mins_tag) {
    constexpr int kBits = decltype(bits_tag)::value, kMins = decltype(mins_tag)::value;
    constexpr bool kHalves = decltype(halves_tag)::value;
    const LayoutSpan<kBits, kHalves, kMins> base{codes.data_ptr<uint8_t>(), scales.data_ptr(),
                                                layout.form, layout.factors};
    dequantize_impl<kBits, kHalves, kMins>(base, layout.groups, id_ptr, count,
                                           out.data_ptr<float>());
  });
  return out;
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        int64_t bits, int64_t n, const std::optional<at::Tensor>& factors,
                        bool halves, bool float_out) {
  const WeightLayout layout = check_weight(codes, scales, bits, n, factors, halves);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant_matmul: x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_matmul: x must be float32 or bfloat16");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kGroup == 0, "quant_matmul: K must be a multiple of 32 (x's second size)");
  TORCH_CHECK(k / kGroup == layout.groups,
              "quantized weight: codes must be a contiguous uint8 [ceil(N / 16), K / 32, "
              "64 * bits]");
  // float_out: the float32 sums as they are, for bf16 activations too (a head's logits: in
  // bf16 they step by 0.06-0.125 nats at common magnitudes, and near-ties become ties). The
  // kernel computes in float32 either way; only the store's rounding differs.
  const bool wide = float_out || x.scalar_type() == at::kFloat;
  at::Tensor out = at::empty({rows, n}, x.options().dtype(wide ? at::kFloat : at::kBFloat16));
  if (rows == 0 || n == 0) return out;
  const auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const QuantizedActivations act = quantize_activations(
        x.data_ptr<T>(), rows, k, code_offset(bits), halves, layout.mins == 2);
    with_width(bits, [&](auto bits_tag) {
      const auto product = [&](auto* dst) {
        matmul_width<decltype(bits_tag)::value>(act, codes.data_ptr<uint8_t>(),
                                                scales.data_ptr(), layout.form, layout.factors,
                                                halves, layout.mins, rows, n, k, dst);
      };
      if (wide) {
        product(out.data_ptr<float>());
      } else {
        product(out.data_ptr<c10::BFloat16>());
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return out;
}

}  // namespace prefixgate::ops
