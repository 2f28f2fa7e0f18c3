// Group-wise quantized weights times activations quantized to 8 bits on the fly, on integer
// dot products: the scheme of llama.cpp's CPU backend (Q4_1 x Q8_1, Q8_0 x Q8_0).
//
// Why: a batch-1 decode step streams every weight once. torch's int4 CPU kernel widens each
// code to float and runs float FMAs; on AVX2 that is compute bound at ~8 GB/s, and the 102 MB
// of SmolLM2's quantized linears took ~13 ms of a 22 ms step. Here codes meet int8
// activations in integer multiply-adds (maddubs on AVX2, dpbusd with AVX512-VNNI), and each
// group's scales are applied once to its integer sum.
//
//   quant_matmul(x [M, K] float32 | bf16, codes, scales, bits) -> [M, N] in x's dtype
//     weight[n, 32g + j] = d * code + m, per group g of 32 (Q4_1's form; m = 0 for Q8_0)
//     codes  [N / 8, K / 32, 8 * bits * 4] uint8: tiles of 8 weight rows. A group of a tile is
//            8 steps of 4 columns; step s is 32 bytes, row r's codes for columns 4s..4s+3 at
//            bytes 4r..4r+3, so one integer multiply-add against the activations' 4 bytes
//            broadcast gives every row its partial sum in its own lane (the layout of
//            llama.cpp's repacked x86 GEMMs). bits 8: the 8 steps, int8 codes -127..127.
//            bits 4: 4 x 32 bytes, byte i of vector j holding step 2j's code i in its low
//            nibble and step 2j + 1's in its high one; codes 0..15.
//     scales [N / 8, 2, K / 32, 8] float16: a tile's d then its m, 8 rows per group
//   A thread reads one sequential stream, and a group's 8 row results come out in one
//   vector: one conversion and one scale multiply serve 8 rows.
//
// Activations, per row and group of 32: a = absmax / 127, q = round(x / a) (ties away from
// zero) in -127..127, s = a * sum(q); then y = sum over groups of d * a * (code . q) + m * s.
// The result is what llama.cpp computes, not what a float GEMV would: the activations' 8-bit
// rounding is this kernel's error (tests/engine/test_quantization.py states its bound). Each
// output row is computed alone, in the same order whatever M is: the kernel is batch
// invariant.
//
// Registered as torch.ops.prefixgate.quant_matmul; parallel over tiles, every activation row
// served by one read of a tile. AVX2 (with VNNI where the build has AVX512-VNNI) or a portable
// scalar loop; engine/quantization.py packs the layout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PREFIXGATE_QMM_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 8;      // weight rows per tile: one float lane each
constexpr int64_t kSteps = 8;     // 4-column steps per group
// Activation rows per pass over a tile's group: 4-bit codes unpack into 8 registers, which
// leaves room for 4 rows' accumulators (the unpacking is shared by more rows); 8-bit codes
// keep a second, unsigned copy in 8 more, so 2 rows. Each row's arithmetic is the same
// whichever block it falls in.
template <int BITS>
constexpr int kRowBlock = BITS == 4 ? 4 : 2;
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of a tile's stream
constexpr int64_t kGroupsPerTask = 512;   // activation groups quantized per parallel task

// Activation rows quantized per group of 32.
struct QuantizedActivations {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scale;   // [M, G]
  std::vector<float> sum;     // [M, G]: scale * sum(codes)
  std::vector<int32_t> code_sum;  // [M, G]: sum(codes), for 8-bit weights taken unsigned
};

template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = k / kGroup;
  QuantizedActivations out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
                           std::vector<float>(rows * groups), std::vector<int32_t>(rows * groups)};
  // In parallel: a 100-token prefill quantizes ~10^7 activations over a forward, ~30 ms on one
  // thread (AVX2 build; 479 vs 214 us for 100 rows of 1536 on two).
  at::parallel_for(0, rows * groups, kGroupsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
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
      out.code_sum[i] = total;
    }
  });
  return out;
}

// Tile t's rows times MB activation rows from `first_row`; writes out[mb * n + r], rounded
// once to T (the activations' dtype).
template <int BITS, int MB, typename T>
void tile_dot(const uint8_t* codes, const at::Half* scales, const QuantizedActivations& act,
              int64_t first_row, int64_t k, T* out, int64_t n) {
  const int64_t groups = k / kGroup;
  const int8_t* qa = act.codes.data() + first_row * k;
  const float* da = act.scale.data() + first_row * groups;
  const float* sa = act.sum.data() + first_row * groups;
  [[maybe_unused]] const int32_t* ca = act.code_sum.data() + first_row * groups;
  constexpr int64_t kGroupBytes = kTile * kGroup * BITS / 8;
#if PREFIXGATE_QMM_AVX2
  __m256 acc[MB];
  for (int mb = 0; mb < MB; ++mb) acc[mb] = _mm256_setzero_ps();
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* group_codes = codes + g * kGroupBytes;
    __builtin_prefetch(group_codes + kPrefetchBytes);
    __builtin_prefetch(group_codes + kPrefetchBytes + 64);
    if constexpr (BITS == 8) {
      __builtin_prefetch(group_codes + kPrefetchBytes + 128);
      __builtin_prefetch(group_codes + kPrefetchBytes + 192);
    }
    __m256i w[kSteps];
    [[maybe_unused]] __m256i u8[kSteps];  // 8 bits: the unsigned operand (see below)
    for (int j = 0; j < kSteps; ++j) {
      if constexpr (BITS == 4) {
        if (j % 2 == 0) {
          const __m256i packed =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_codes + j / 2 * 32));
          w[j] = _mm256_and_si256(packed, low_nibbles);
          w[j + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
        }
      } else {
        // 8-bit codes are signed and the multiply-add takes its first operand unsigned. Once
        // per group, not per activation row: with VNNI, w + 128 (its top bit flipped), the
        // 128 * sum(activation codes) it adds taken off the integer sum after; without, |w|,
        // w's sign moved onto the activation in the row loop (llama.cpp's trick: maddubs'
        // pair sums of 127 * 127 stay within int16).
        const __m256i codes8 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_codes + j * 32));
        w[j] = codes8;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        u8[j] = _mm256_xor_si256(codes8, _mm256_set1_epi8(static_cast<char>(0x80)));
#else
        u8[j] = _mm256_sign_epi8(codes8, codes8);
#endif
      }
    }
    const __m256 d = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kTile)));
    const __m256 m = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + (groups + g) * kTile)));
    for (int mb = 0; mb < MB; ++mb) {
      const int8_t* a = qa + mb * k + g * kGroup;
      __m256i sums = _mm256_setzero_si256();
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      // four chains: one dpbusd waits ~5 cycles on the one before it into the same register
      __m256i chains[4] = {sums, sums, sums, sums};
#else
      __m256i pairs = _mm256_setzero_si256();  // 4 bits: 8 steps of pair sums fit in int16
#endif
      for (int j = 0; j < kSteps; ++j) {
        int32_t four;
        std::memcpy(&four, a + 4 * j, sizeof four);
        __m256i u = w[j], s = _mm256_set1_epi32(four);
        if constexpr (BITS == 8) {
          u = u8[j];
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
          s = _mm256_sign_epi8(s, w[j]);  // the code's sign, its magnitude in u
#endif
        }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        chains[j % 4] = _mm256_dpbusd_epi32(chains[j % 4], u, s);
#else
        if constexpr (BITS == 4) {
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u, s));  // <= 8 * 2 * 15 * 127
        } else {
          sums = _mm256_add_epi32(sums,
                                  _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
        }
#endif
      }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      sums = _mm256_add_epi32(_mm256_add_epi32(chains[0], chains[1]),
                              _mm256_add_epi32(chains[2], chains[3]));
      if constexpr (BITS == 8)  // the codes were taken as w + 128
        sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(128 * ca[mb * groups + g]));
#else
      if constexpr (BITS == 4) sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
      const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(da[mb * groups + g]));
      acc[mb] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[mb]);
      acc[mb] = _mm256_fmadd_ps(m, _mm256_set1_ps(sa[mb * groups + g]), acc[mb]);
    }
  }
  for (int mb = 0; mb < MB; ++mb) {
    prefixgate::f8 lanes;
    std::memcpy(&lanes, &acc[mb], sizeof lanes);
    prefixgate::store8(out + mb * n, lanes);
  }
#else
  for (int mb = 0; mb < MB; ++mb) {
    float total[kTile] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group_codes = codes + g * kGroupBytes;
      const int8_t* a = qa + mb * k + g * kGroup;
      for (int64_t r = 0; r < kTile; ++r) {
        int32_t sum = 0;
        for (int64_t j = 0; j < kSteps; ++j) {
          for (int64_t i = 0; i < 4; ++i) {
            int32_t code;
            if constexpr (BITS == 4) {
              const uint8_t byte = group_codes[j / 2 * 32 + 4 * r + i];
              code = j % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
            } else {
              code = static_cast<int8_t>(group_codes[j * 32 + 4 * r + i]);
            }
            sum += code * a[4 * j + i];
          }
        }
        const float d = static_cast<float>(scales[g * kTile + r]);
        const float m = static_cast<float>(scales[(groups + g) * kTile + r]);
        total[r] += d * da[mb * groups + g] * static_cast<float>(sum) + m * sa[mb * groups + g];
      }
    }
    for (int64_t r = 0; r < kTile; ++r) out[mb * n + r] = static_cast<T>(total[r]);
  }
#endif
}

template <int BITS, typename T>
void quant_matmul_impl(const QuantizedActivations& act, const uint8_t* codes,
                       const at::Half* scales, int64_t rows, int64_t n, int64_t k, T* out) {
  const int64_t groups = k / kGroup;
  const int64_t tile_code_bytes = groups * kTile * kGroup * BITS / 8;
  const int64_t tile_scales = 2 * groups * kTile;
  at::parallel_for(0, n / kTile, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t + 1 < end) {  // the next tile's scales: a separate, short stream
        const auto* next = reinterpret_cast<const char*>(scales + (t + 1) * tile_scales);
        for (int64_t off = 0; off < tile_scales * 2; off += 64) __builtin_prefetch(next + off);
      }
      const uint8_t* tile_codes = codes + t * tile_code_bytes;
      const at::Half* scale_ptr = scales + t * tile_scales;
      T* tile_out = out + t * kTile;
      int64_t i = 0;
      for (; i + kRowBlock<BITS> <= rows; i += kRowBlock<BITS>)
        tile_dot<BITS, kRowBlock<BITS>>(tile_codes, scale_ptr, act, i, k, tile_out + i * n, n);
      if constexpr (kRowBlock<BITS> > 2) {
        if (i + 2 <= rows) {
          tile_dot<BITS, 2>(tile_codes, scale_ptr, act, i, k, tile_out + i * n, n);
          i += 2;
        }
      }
      if (i < rows) tile_dot<BITS, 1>(tile_codes, scale_ptr, act, i, k, tile_out + i * n, n);
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
              "quant_matmul: codes must be a contiguous uint8 [N / 8, K / 32, 8 * bits * 4]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({n / kTile, 2, groups, kTile}),
              "quant_matmul: scales must be a contiguous float16 [N / 8, 2, K / 32, 8]");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const at::Half* scale_ptr = scales.data_ptr<at::Half>();
  const auto run = [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const QuantizedActivations act = quantize_activations(x.data_ptr<T>(), rows, k);
    if (bits == 4) {
      quant_matmul_impl<4>(act, code_ptr, scale_ptr, rows, n, k, out.data_ptr<T>());
    } else {
      quant_matmul_impl<8>(act, code_ptr, scale_ptr, rows, n, k, out.data_ptr<T>());
    }
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixgate, m) {
  m.def("quant_matmul(Tensor x, Tensor codes, Tensor scales, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("quant_matmul", &quant_matmul); }
