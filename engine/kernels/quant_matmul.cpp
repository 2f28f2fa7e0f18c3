// Group-wise quantized weights times activations quantized to 8 bits on the fly, on integer
// dot products: the scheme of llama.cpp's CPU backend (Q4_1 x Q8_1, Q8_0 x Q8_0).
//
// Why: a batch-1 decode step streams every weight once. torch's int4 CPU kernel widens each
// code to float and runs float FMAs; on AVX2 that is compute bound at ~8 GB/s, and the 102 MB
// of SmolLM2's quantized linears took ~13 ms of a 22 ms step. Here 32 codes meet 32 int8
// activations in one or two instructions (maddubs + madd, or VNNI's dpbusd), and each group's
// scales are applied once to the integer sum.
//
//   quant_matmul(x [M, K] float32 | bf16, codes, scales, bits) -> [M, N] in x's dtype
//     weight[n, 32g + j] = d * code + m, per group g of 32 (Q4_1's form; m = 0 for Q8_0)
//     codes  [N / 4, K / 32, 4 * B] uint8: tiles of 4 weight rows, each group's 4 rows side by
//            side, B bytes a row: bits 4, B = 16, byte j holding code j in its low nibble and
//            code 16 + j in its high one (GGML's order), codes 0..15; bits 8, B = 32, int8
//            codes -127..127
//     scales [N / 4, 2, K / 32, 4] float16: a tile's d then its m, 4 rows per group
//   The tiled layout makes a thread's reads one sequential stream (a cache line per group of
//   a tile for 4 bits): with rows one after another the four rows of a tile were four
//   streams, and the prefetcher lost ~half the bandwidth on K = 1536.
//
// Activations, per row and group of 32: a = absmax / 127, q = round(x / a) (ties away from
// zero) in -127..127, s = a * sum(q); then y = sum over groups of d * a * (code . q) + m * s.
// The result is what llama.cpp computes, not what a float GEMV would: the activations' 8-bit
// rounding is this kernel's error (tests/engine/test_quantization.py states its bound).
//
// Registered as torch.ops.prefixgate.quant_matmul; parallel over tiles, every activation row
// served by one read of a tile. AVX2 (with VNNI where the build has AVX512-VNNI) or a portable
// scalar loop; engine/quantization.py packs the layout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PREFIXGATE_QMM_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 4;     // weight rows per tile: four independent accumulator chains
constexpr int kRowBlock = 2;     // activation rows per pass over a tile: 4 x 2 accumulators
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of a tile's stream (measured)

// Activation rows quantized per group of 32.
struct QuantizedActivations {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scale;   // [M, G]
  std::vector<float> sum;     // [M, G]: scale * sum(codes)
};

template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  QuantizedActivations out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
                           std::vector<float>(rows * groups)};
  for (int64_t i = 0; i < rows * groups; ++i) {
    const T* src = x + i * kGroup;  // rows are contiguous: group i of the flat [M * G]
    float values[kGroup];
    float absmax = 0.f;
    for (int64_t j = 0; j < kGroup; ++j) {
      values[j] = static_cast<float>(src[j]);
      absmax = std::max(absmax, std::fabs(values[j]));
    }
    const float scale = absmax / 127.f;
    const float inverse = scale > 0.f ? 1.f / scale : 0.f;
    int32_t total = 0;
    int8_t* codes = out.codes.data() + i * kGroup;
    for (int64_t j = 0; j < kGroup; ++j) {
      const float scaled = values[j] * inverse;
      const float rounded = std::trunc(scaled + (scaled < 0.f ? -0.5f : 0.5f));
      codes[j] = static_cast<int8_t>(std::clamp(rounded, -127.f, 127.f));
      total += codes[j];
    }
    out.scale[i] = scale;
    out.sum[i] = scale * static_cast<float>(total);
  }
  return out;
}

#if PREFIXGATE_QMM_AVX2
inline float horizontal_sum(__m128 v) {
  const __m128 half = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}

inline float horizontal_sum(__m256 v) {
  return horizontal_sum(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}
#endif

// One tile (4 weight rows) times MB activation rows from `first_row`. `scales`: the tile's d
// and m as float, [2, G, 4]; `products`: room for [MB, G, 4] floats. Writes
// out[mb * out_stride + r].
template <int BITS, int MB>
void tile_dot(const uint8_t* codes, const float* scales, const QuantizedActivations& act,
              int64_t first_row, int64_t k, float* out, int64_t out_stride, float* products) {
  const int64_t groups = k / kGroup;
  const int8_t* qa = act.codes.data() + first_row * k;
  const float* da = act.scale.data() + first_row * groups;
  const float* sa = act.sum.data() + first_row * groups;
  const float* d = scales;
  const float* m = scales + groups * kTile;
  constexpr int64_t kRowBytes = BITS == 4 ? kGroup / 2 : kGroup;
  constexpr int64_t kGroupBytes = kTile * kRowBytes;
#if PREFIXGATE_QMM_AVX2
  // Before the loop, four rows at a time: every group's d * a (the loop then broadcasts it
  // straight from memory, a load, instead of a multiply and a register shuffle) and the sums
  // of m * s.
  __m128 min_terms[MB];
  for (int mb = 0; mb < MB; ++mb) {
    min_terms[mb] = _mm_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m128 a_scale = _mm_set1_ps(da[mb * groups + g]);
      _mm_storeu_ps(products + (mb * groups + g) * kTile,
                    _mm_mul_ps(_mm_loadu_ps(d + g * kTile), a_scale));
      min_terms[mb] = _mm_fmadd_ps(_mm_loadu_ps(m + g * kTile),
                                   _mm_set1_ps(sa[mb * groups + g]), min_terms[mb]);
    }
  }
  __m256 acc[MB][kTile];
  for (int mb = 0; mb < MB; ++mb)
    for (int r = 0; r < kTile; ++r) acc[mb][r] = _mm256_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group_codes = codes + g * kGroupBytes;
    __builtin_prefetch(group_codes + kPrefetchBytes);
    if constexpr (kGroupBytes > 64) __builtin_prefetch(group_codes + kPrefetchBytes + 64);
    __m256i w[kTile];
    for (int r = 0; r < kTile; ++r) {
      const uint8_t* p = group_codes + r * kRowBytes;
      if constexpr (BITS == 4) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        w[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low_nibbles);
      } else {
        w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      }
    }
    for (int mb = 0; mb < MB; ++mb) {
      const __m256i a =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + mb * k + g * kGroup));
      const float* group_products = products + (mb * groups + g) * kTile;
      for (int r = 0; r < kTile; ++r) {
        // u8 x s8: 4-bit codes are unsigned; signed 8-bit codes lend their sign to the
        // activation (|w| * sign(w) a), GGML's trick, so no pair sum passes 2 * 127 * 127.
        __m256i u = w[r], s = a;
        if constexpr (BITS == 8) {
          u = _mm256_sign_epi8(w[r], w[r]);
          s = _mm256_sign_epi8(a, w[r]);
        }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
        acc[mb][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                     _mm256_broadcast_ss(group_products + r), acc[mb][r]);
      }
    }
  }
  for (int mb = 0; mb < MB; ++mb) {
    float mins[kTile];
    _mm_storeu_ps(mins, min_terms[mb]);
    for (int r = 0; r < kTile; ++r)
      out[mb * out_stride + r] = horizontal_sum(acc[mb][r]) + mins[r];
  }
#else
  (void)products;
  for (int mb = 0; mb < MB; ++mb) {
    for (int r = 0; r < kTile; ++r) {
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* p = codes + g * kGroupBytes + r * kRowBytes;
        const int8_t* a = qa + mb * k + g * kGroup;
        int32_t sum = 0;
        for (int64_t j = 0; j < kGroup; ++j) {
          int32_t code;
          if constexpr (BITS == 4) {
            code = j < kGroup / 2 ? (p[j] & 0x0F) : (p[j - kGroup / 2] >> 4);
          } else {
            code = static_cast<int8_t>(p[j]);
          }
          sum += code * a[j];
        }
        total += d[g * kTile + r] * da[mb * groups + g] * static_cast<float>(sum) +
                 m[g * kTile + r] * sa[mb * groups + g];
      }
      out[mb * out_stride + r] = total;
    }
  }
#endif
}

// A tile's fp16 scales -> float. F16C where the build has it: c10::Half's portable conversion
// is ~15 instructions a value, two per group of 4 x 32 weights.
void widen_scales(const at::Half* scales, int64_t count, float* out) {
  int64_t i = 0;
#if PREFIXGATE_QMM_AVX2
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + i))));
#endif
  for (; i < count; ++i) out[i] = static_cast<float>(scales[i]);
}

template <int BITS>
void quant_matmul_impl(const QuantizedActivations& act, const uint8_t* codes,
                       const at::Half* scales, int64_t rows, int64_t n, int64_t k, float* out) {
  const int64_t groups = k / kGroup;
  const int64_t tile_code_bytes = groups * kTile * (BITS == 4 ? kGroup / 2 : kGroup);
  const int64_t tile_scales = 2 * groups * kTile;
  at::parallel_for(0, n / kTile, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(tile_scales), products(kRowBlock * groups * kTile);
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) {  // the next tile's scales: a separate, short stream
        const auto* next = reinterpret_cast<const char*>(scales + (t + 1) * tile_scales);
        for (int64_t off = 0; off < tile_scales * 2; off += 64) __builtin_prefetch(next + off);
      }
      widen_scales(scales + t * tile_scales, tile_scales, wide.data());
      const uint8_t* tile_codes = codes + t * tile_code_bytes;
      float* tile_out = out + t * kTile;
      int64_t i = 0;
      for (; i + kRowBlock <= rows; i += kRowBlock)
        tile_dot<BITS, kRowBlock>(tile_codes, wide.data(), act, i, k, tile_out + i * n, n,
                                  products.data());
      if (i < rows)
        tile_dot<BITS, 1>(tile_codes, wide.data(), act, i, k, tile_out + i * n, n,
                          products.data());
    }
  });
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_matmul: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant_matmul: x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_matmul: x must be float32 or bfloat16");
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup;
  const int64_t n = codes.size(0) * kTile;
  TORCH_CHECK(k % kGroup == 0, "quant_matmul: K must be a multiple of 32, got ", k);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.sizes() == at::IntArrayRef({n / kTile, groups, kTile * bits * 4}),
              "quant_matmul: codes must be a contiguous uint8 [N / 4, K / 32, 4 * bits * 4]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({n / kTile, 2, groups, kTile}),
              "quant_matmul: scales must be a contiguous float16 [N / 4, 2, K / 32, 4]");
  at::Tensor out = at::empty({rows, n}, x.options().dtype(at::kFloat));
  if (rows == 0 || n == 0) return out.to(x.scalar_type());
  const QuantizedActivations act =
      x.scalar_type() == at::kFloat ? quantize_activations(x.data_ptr<float>(), rows, k)
                                    : quantize_activations(x.data_ptr<c10::BFloat16>(), rows, k);
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const at::Half* scale_ptr = scales.data_ptr<at::Half>();
  if (bits == 4) {
    quant_matmul_impl<4>(act, code_ptr, scale_ptr, rows, n, k, out.data_ptr<float>());
  } else {
    quant_matmul_impl<8>(act, code_ptr, scale_ptr, rows, n, k, out.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def("quant_matmul(Tensor x, Tensor codes, Tensor scales, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("quant_matmul", &quant_matmul); }
