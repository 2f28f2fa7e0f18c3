// Group-wise quantized weights times activations quantized to 8 bits on the fly, on integer
// dot products: the scheme of llama.cpp's CPU backend (Q4_1 x Q8_1, Q8_0 x Q8_0).
//
// Why: a batch-1 decode step streams every weight once. torch's int4 CPU kernel widens each
// code to float and runs float FMAs; on AVX2 that is compute bound at ~8 GB/s, and the 102 MB
// of SmolLM2's quantized linears took ~13 ms of a 22 ms step. Here codes meet int8
// activations in integer multiply-adds (maddubs on AVX2, dpbusd with AVX512-VNNI), and each
// group's scales are applied once to its integer sum.
//
//   quant_matmul(x [M, K] float32 | bf16, codes, scales, bits, N, factors?) -> [M, N], x's dtype
//     weight[n, 32g + j] = d * code + m, per group g of 32 (Q4_1's form; m = 0 for Q8_0)
//     codes  [ceil(N / 16), K / 32, 64 * bits] uint8: units of two tiles of 8 weight rows
//            (an odd last tile alone, its partner's slot zeros), group by group; a group of a
//            unit is `bits` chunks of 32 bytes for each tile, chunk c of tile 0 then of tile 1
//            ([chunk][tile][32]): a thread's units are then one sequential stream, and a
//            chunk of both tiles one 64-byte load. A tile's group is 8 steps of 4 columns;
//            step s is 32 bytes, row r's codes for columns 4s..4s+3 at bytes 4r..4r+3, so
//            one integer multiply-add against the activations' 4 bytes broadcast gives every
//            row its partial sum in its own lane (the layout of llama.cpp's repacked x86
//            GEMMs). bits 8: the 8 steps, int8 codes -127..127.
//            bits 4: 4 x 32 bytes, byte i of vector j holding step 2j's code i in its low
//            nibble and step 2j + 1's in its high one; codes 0..15.
//            bits 5: bits 4's 128 bytes for the codes' low 4 bits, then 32 bytes, bit s of
//            byte i the 5th bit of step s's code i (one shift and a mask give a step's);
//            codes 0..31 (Q5_0, Q5_1, Q5_K as their files hold them: 5.5 bits a weight, not
//            8.5). bits 6: bits 5's 160 bytes, then 32 bytes of 6th bits alike; a code w in
//            -32..31 stored as w + 32, the 32 * sum(activation codes) taken off each integer
//            sum (Q6_K as its file holds it, 6 bits and not 8: the same integers, so the
//            same bits as its codes in 8-bit lanes). bits 12 (kLevels): bits 4's bytes,
//            each nibble an index into the 16 non-uniform levels of IQ4_NL and IQ4_XS
//            (-127..113), which are the codes the sums take: 4 bits a weight read, the
//            same integers (so the same bits) as the levels in 8-bit lanes.
//     scales [ceil(N / 16), K / 32, 2, 16] float16 or float32: per unit and group, the d
//            then the m of its 16 rows (tile 0's 8, then tile 1's). float16 is what
//            Q4_0/Q4_1/Q5_x/Q8_0 blocks carry; float32 holds the K-quants' per-group
//            products (super-block d times a 6-bit sub-scale) exactly.
//            [.., 1, 16]: d alone, m = 0 (Q8_0's signed codes, int8 weights): the
//            min term is not read, and skipping it changes no bit (m * s = 0 adds nothing).
//            With `halves` (an argument: the row count alone is ambiguous), a d for
//            columns 0-15 of each group, one for 16-31 (the integer sum then taken per
//            half, each half scaled alone): [.., 2, 16] the two alone (Q6_K's and Q3_K's
//            16-weight sub-blocks, each with its own d and no min: a min row of -0.0 was
//            ~4% of a Q6_K weight's bytes), [.., 3, 16] then m (a fused linear that joins
//            such a weight with one that has mins), [.., 4, 16] ("half mins") then an m
//            per half: Q2_K's
//            sub-blocks, each with its own min (the min term then taken per half too, from
//            the activations' sum over that half).
//            int8, with `factors` [ceil(N / 16), K / 256, scale rows, 16] float16: each is its
//            int8 times the factor of its 8 groups, the K-quants' own two levels (sub-scale
//            times the super-block's d or -dmin); exact in float32, so the same numbers as
//            the float32 form, from 1.25 bits a weight of scales instead of 2 (ScaleForm).
//   A group's 8 (16) row results come out in one vector: one conversion and one scale
//   multiply serve 8 (16) rows. A thread reads one stream of codes and one of scales,
//   prefetching its codes a fixed distance ahead (Zen 4, a 1B's batch-1 linears: two code
//   streams per tile pair, four scale streams and block-wise prefetches read 21-25 GB/s;
//   this layout 28-35).
//
// Activations, per row and group of 32: a = absmax / 127, q = round(x / a) (ties away from
// zero) in -127..127, s = a * sum(q); then y = sum over groups of d * a * (code . q) + m * s.
// The result is what llama.cpp computes, not what a float GEMV would: the activations' 8-bit
// rounding is this kernel's error (tests/engine/test_quantization.py states its bound). Each
// output row is computed alone, in the same order whatever M is, and every build (AVX2, VNNI,
// the portable loop) rounds the same operations in the same order: the kernel is batch
// invariant, and its bits do not depend on the instruction set either (the tests pin them).
//
// Registered as torch.ops.prefixgate.quant_matmul. A GEMM at prefill shapes: register blocks of
// several activation rows times two tiles, rows in chunks that stay in L1 while a block of
// tiles that stays in L2 passes (kWeightBlockBytes; see block_dot); parallel over tiles.
// AVX2 (with VNNI where the build has AVX512-VNNI; an AVX-512 build takes pairs of tiles in
// 512-bit lanes, pair_dot) or a portable scalar loop; where the CPU has AMX (Intel Xeon since
// Sapphire Rapids), blocks of 16 rows go to its tiles instead (amx_rows). Every path gives
// the same bits. engine/quantization.py packs the layout.
//
// This header holds the kernel; quant_matmul.cpp the op's entry points (checks, activation
// quantization, the dispatch by code width), and quant_matmul_4_5_iq4.cpp and
// quant_matmul_6_8.cpp the code widths' instances (matmul_width), ~29 and ~22 s of one core
// at -O3 on the AVX2 EPYC (each width compiled alone, summed): in one source they made the
// last ~40 s of a cold build on 2 cores a single compiler's.

#pragma once

#include <ATen/Parallel.h>

#include "vec.h"

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define PREFIXGATE_QMM_AVX2 1
#endif
#if PREFIXGATE_QMM_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnniBuild = true;  // 8-bit codes taken as w + 128 (see block_dot)
#else
constexpr bool kVnniBuild = false;
#endif
// Intel's AMX tiles (Sapphire Rapids and later; -march=native says so at build time, and the
// process asks Linux for the tile state at run time, see amx_ready).
#if PREFIXGATE_QMM_AVX2 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && \
    defined(__AVX512F__) && defined(__AVX512DQ__)
#define PREFIXGATE_QMM_AMX 1
#endif
// AVX-512 with VNNI: a pair of tiles (16 weight rows) in the 16 lanes of one register (pair_dot).
#if PREFIXGATE_QMM_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PREFIXGATE_QMM_WIDE 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

namespace prefixgate::qmm {

// IQ4_NL's and IQ4_XS's codes: 4-bit indices into these levels (ggml's kvalues_iq4nl), stored
// as 4-bit codes are and read as the 8-bit codes they index (the op's `bits` for them).
constexpr int kLevels = 12;
constexpr int8_t kLevelValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// The 32-byte chunks a tile's group takes: `bits` (levels: the 4 of their indices).
constexpr int code_chunks(int bits) { return bits == kLevels ? 4 : bits; }

// The c of weight codes that the vector paths take as w + c: 6-bit codes are stored so, and
// VNNI's multiply-add takes 8-bit ones unsigned; each such integer sum starts from -c times
// its activation codes' sum (QuantizedActivations::offset). 0 for the other widths and in the
// portable loop, which reads signed codes.
constexpr int32_t code_offset([[maybe_unused]] int bits) {
#if PREFIXGATE_QMM_AVX2
  return bits == 6 ? 32 : (bits == 8 || bits == kLevels) && kVnniBuild ? 128 : 0;
#else
  return 0;
#endif
}

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 8;      // weight rows per tile: one float lane each
constexpr int64_t kSteps = 8;     // 4-column steps per group
// A block is MB activation rows times T tiles, computed one 4-column step at a time: the T
// tiles' codes for the step sit in T registers, and each activation row's 4 bytes, broadcast
// once, meet all T of them (one broadcast per T multiply-adds). MB x T integer accumulators:
// 4-bit codes accumulate 16-bit pair sums (5 x 2 = 10 of the 16 AVX2 registers, with the codes,
// the broadcast and the nibble mask); 8-bit codes keep 32-bit sums and a second, unsigned
// copy of each tile's codes, so 2 x 2; 5-bit codes 16-bit sums over 4 steps, widened into 32:
// 2 x 2 where the compiler places the registers (3 x 2 measured no faster), 5 x 2 on AVX2
// without VNNI, where q5_group_sums_5x2 does (Zen 3, Gemma 3 270M's shapes at 77 rows, one
// thread: 39.3 -> 50.3 G multiply-adds/s without a min, 35.9 -> 43.2 with one; two threads,
// 1000 rows: 56.2 -> 61.7, 61.7 -> 71.5). Measured on an AVX2 EPYC (Zen 3), one thread, 1000
// rows of K = 576: 4-bit 5 x 2 ~72 G multiply-adds/s against ~48 for the former 4 x 1 blocks.
// 6-bit codes 4 x 2: their unpacking (nibble and two bit planes) is per tile, so it is shared
// by more rows, and the compiler keeps the float accumulators, touched once a group, in
// memory; a Llama 3.2 1B's Q6_K tensors at 77 rows went from ~50 to ~60 G multiply-adds/s on
// the same EPYC, two threads (5 x 2: no faster than 4).
// Each row's arithmetic is the same whichever block, and whichever tile, it falls in.
template <int BITS>
constexpr int kRowBlock = BITS == 4 || (BITS == 5 && !kVnniBuild) ? 5 : BITS == 6 ? 4 : 2;
constexpr int kTileBlock = 2;
// Rows are taken in chunks whose activation codes (~16 KB) stay in L1 while every tile of a
// task passes over them: with all 1000 rows of a prefill at once, each tile streamed ~576 KB
// of activations from beyond L2 and the same loop ran at ~half speed.
constexpr int64_t kChunkBytes = 16384;
// ... and tiles in blocks of about this many bytes of weights, which stay in L2 (half of the
// older EPYC's 512 KB) while every row chunk passes over them: with the whole task's tiles
// per chunk, a 1B model's weights came from memory once per chunk of 5 rows, 16 times for
// an 80-token prefill (~10 GB read for 844 MB of weights).
constexpr int64_t kWeightBlockBytes = 256 * 1024;
constexpr int64_t kGroupsPerTask = 512;   // activation groups quantized per parallel task
// How many groups ahead of the one computed its unit's codes are prefetched (past the unit's
// end: the next unit's, the same stream). The hardware's prefetcher alone kept a 6-bit
// weight at ~20 GB/s on Zen 4 (its decode is the most work a byte); 16 groups ahead (6 KB
// of 6-bit codes), 28-31, and the 4- and 8-bit ones no slower. Only register blocks of at
// most kPrefetchRows rows (decode) prefetch: a prefill's blocks do 8 times the work a byte
// and pass each block of weights many times (1B, 1,000 tokens: 250 -> 224 tokens/s with).
constexpr int64_t kPrefetchGroups = 16;
constexpr int kPrefetchRows = 2;

// Activation rows quantized per group of 32.
struct QuantizedActivations {
  std::vector<int8_t> codes;  // [M, K]
  std::vector<float> scale;   // [M, G]
  std::vector<float> sum;     // [M, G]: scale * sum(codes)
  // [M, G] or [M, G, 2] (per half) or empty: where each group's (half's) integer sum starts,
  // -c * sum(codes) for weight codes stored as w + c (8 bits under VNNI: c = 128; 6 bits: 32),
  // so that the sum comes out as the signed codes' (see block_dot)
  std::vector<int32_t> offset;
  std::vector<float> half_sum;  // [M, G, 2] or empty: scale * sum(codes 0-15), of 16-31
};

// Rows from `first_row` of quantized activations: where their codes and per-group numbers
// start (offset null where there are none), for the register blocks.
struct ActivationRows {
  const int8_t* codes;
  const float* scale;
  const float* sum;
  const int32_t* offset;
  int64_t offset_parts;  // 1, or 2 (an offset per half)
  const float* half_sum;

  ActivationRows(const QuantizedActivations& act, int64_t first_row, int64_t k) {
    const int64_t at = first_row * (k / kGroup);
    codes = act.codes.data() + first_row * k;
    scale = act.scale.data() + at;
    sum = act.sum.data() + at;
    const int64_t entries = act.scale.size();
    offset_parts = act.offset.empty() ? 1 : act.offset.size() / entries;
    offset = act.offset.empty() ? nullptr : act.offset.data() + offset_parts * at;
    half_sum = act.half_sum.empty() ? nullptr : act.half_sum.data() + 2 * at;
  }

  // Entry i's scale times its codes' sum over `part` of its group: 0 all, 1 codes 0-15, 2
  // 16-31 (those two only where the weights have an m per half).
  float summed(int64_t i, int part) const {
    return part == 0 ? sum[i] : half_sum[2 * i + part - 1];
  }

  // Where entry i's integer sum over `part` of its group starts: 0 all, 1 codes 0-15, 2 16-31
  // (those two where the offsets are per half).
  const int32_t* offset_of(int64_t i, int part) const {
    return offset + offset_parts * i + (part == 0 ? 0 : part - 1);
  }
};

// One group of 32 activations: a = absmax / 127, codes round(x / a) (ties away from zero)
// in -127..127, and the codes' sum; eight lanes at a time, each lane the scalar formula's
// operations (the max is exact in any order). Scalar, quantizing was ~15% of a 1536-wide
// linear at prefill sizes.
template <typename T>
inline void quantize_group(const T* src, int8_t* codes, float* scale, float* sum,
                           int32_t code_offset, int32_t* offset, bool half_offsets,
                           float* half_sum) {
  using prefixgate::f8;
  using prefixgate::i8;
  typedef int8_t c8 __attribute__((vector_size(8)));
  f8 values[kGroup / 8];
  f8 lanes{};
  for (int j = 0; j < kGroup / 8; ++j) {
    values[j] = prefixgate::load8(src + 8 * j);
    const f8 magnitude = values[j] < 0 ? -values[j] : values[j];
    lanes = magnitude > lanes ? magnitude : lanes;
  }
  float absmax = 0.f;
  for (int lane = 0; lane < 8; ++lane) absmax = std::max(absmax, lanes[lane]);
  const float a = absmax / 127.f;
  const float inverse = a > 0.f ? 1.f / a : 0.f;
  i8 totals{};
  i8 first_half{};
  for (int j = 0; j < kGroup / 8; ++j) {
    const f8 scaled = values[j] * inverse;
    f8 rounded = scaled + (scaled < 0 ? f8{} - 0.5f : f8{} + 0.5f);
    rounded = rounded < -127.f ? f8{} - 127.f : rounded;  // clamped first: 1 / a may be inf
    rounded = rounded > 127.f ? f8{} + 127.f : rounded;
    const i8 q = __builtin_convertvector(rounded, i8);  // converts toward zero: trunc
    totals += q;
    if (j == 1) first_half = totals;  // codes 0-15
    const c8 bytes = __builtin_convertvector(q, c8);
    std::memcpy(codes + 8 * j, &bytes, sizeof bytes);
  }
  int32_t total = 0, half = 0;
  for (int lane = 0; lane < 8; ++lane) {
    total += totals[lane];
    half += first_half[lane];
  }
  if (offset != nullptr) {
    if (half_offsets) {
      offset[0] = -code_offset * half;
      offset[1] = -code_offset * (total - half);
    } else {
      offset[0] = -code_offset * total;
    }
  }
  if (half_sum != nullptr) {
    half_sum[0] = a * static_cast<float>(half);
    half_sum[1] = a * static_cast<float>(total - half);
  }
  *scale = a;
  *sum = a * static_cast<float>(total);
}

// `code_offset`: the c of weight codes stored as w + c (0: none, no offsets); `halves`: an
// offset per half (weights with a d per half); `half_sums`: each half's scaled sum (weights
// with an m per half).
template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t rows, int64_t k,
                                          int32_t code_offset, bool halves, bool half_sums) {
  const int64_t groups = k / kGroup;
  const int64_t offset_parts = halves ? 2 : 1;
  QuantizedActivations out{
      std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
      std::vector<float>(rows * groups),
      std::vector<int32_t>(code_offset != 0 ? offset_parts * rows * groups : 0),
      std::vector<float>(half_sums ? 2 * rows * groups : 0)};
  // In parallel: a 1000-token prefill quantizes ~10^8 activations over a forward.
  at::parallel_for(0, rows * groups, kGroupsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)  // rows are contiguous: group i of the flat [M * G]
      quantize_group(x + i * kGroup, out.codes.data() + i * kGroup, &out.scale[i], &out.sum[i],
                     code_offset,
                     code_offset != 0 ? &out.offset[offset_parts * i] : nullptr, halves,
                     half_sums ? &out.half_sum[2 * i] : nullptr);
  });
  return out;
}

// How a tile's scales are stored: float16 (the 32-weight GGML types' own d and m), float32
// (products that float16 cannot hold), or factored: an int8 sub-scale per entry times a
// float16 factor per 8 groups, the K-quants' own two levels (d * sc, -dmin * min). Their
// float32 product is exact (11 by at most 8 significant bits), the number the float32 form
// holds: the same bits, at 1.25 bits a weight of scales instead of 2.
enum class ScaleForm { kHalf, kFloat, kFactored };

// The scale rows of a layout: d (one, or one per half with HALVES), then MINS rows of m.
constexpr int scale_rows(bool halves, int mins) { return (halves ? 2 : 1) + mins; }

// A unit: two tiles of 8 weight rows, stored group by group (see the layout at the top), so
// that one thread's units are one sequential stream of codes and one of scales. Tile t of
// the unit is 0 or 1; an odd last tile is alone in its unit, its second slot padding. BITS
// (a tile's group is that many 32-byte chunks) and ROWS (its scale rows) are the layout's,
// known at compile time: the hot loops' addresses are then constant strides.
template <int BITS, int ROWS>
struct TileSpan {
  const uint8_t* codes;  // [G, chunks, 2, 32]: group g's chunk c of tile t, 32 bytes
  const void* scales;    // [G, ROWS, 16]: at::Half, float or int8, by `form`
  ScaleForm form;
  const at::Half* factors;  // kFactored: [G / 8, ROWS, 16] float16

  // Tile t's chunk c of group g (tile 1's follows tile 0's).
  const uint8_t* chunk(int t, int64_t g, int64_t c) const {
    return codes + ((g * code_chunks(BITS) + c) * 2 + t) * 32;
  }

  // Where tile t's 8 scales of scale row `row` in group g start (tile 1's follow tile 0's).
  static int64_t scale_index(int t, int64_t row, int64_t g) {
    return ((g * ROWS + row) * 2 + t) * kTile;
  }

  // Where the factors of those scales start (kFactored): their super-block's.
  static int64_t factor_index(int t, int64_t row, int64_t g) {
    return (((g >> 3) * ROWS + row) * 2 + t) * kTile;
  }

  // Unit u's span, counted from this one.
  TileSpan unit(int64_t u, int64_t groups) const {
    const int64_t unit_scales = groups * ROWS * 16;
    return {codes + u * groups * code_chunks(BITS) * 64,
            static_cast<const char*>(scales) + u * unit_scales * scale_bytes(), form,
            factors == nullptr ? nullptr : factors + u * unit_scales / 8};
  }

  int64_t scale_bytes() const {
    return form == ScaleForm::kFloat ? 4 : form == ScaleForm::kHalf ? 2 : 1;
  }
};

// The span of a layout by its code bits and scale rows' kind.
template <int BITS, bool HALVES, int MINS>
using LayoutSpan = TileSpan<BITS, scale_rows(HALVES, MINS)>;

// Group g + kPrefetchGroups's codes of the span's unit into L1 (see kPrefetchGroups).
template <int BITS, int ROWS>
inline void prefetch_ahead(const TileSpan<BITS, ROWS>& span, int64_t g) {
  const uint8_t* ahead = span.chunk(0, g + kPrefetchGroups, 0);
  for (int c = 0; c < code_chunks(BITS); ++c) __builtin_prefetch(ahead + 64 * c);
}

// Lane r of tile t's scales of scale row `row` in group g, as float (exact in every form:
// float16 widens exactly, and a factored scale's product is exact).
template <int BITS, int ROWS>
inline float scale_at(const TileSpan<BITS, ROWS>& span, int t, int64_t row, int64_t g,
                      int64_t r) {
  const int64_t i = span.scale_index(t, row, g) + r;
  switch (span.form) {
    case ScaleForm::kFloat:
      return static_cast<const float*>(span.scales)[i];
    case ScaleForm::kHalf:
      return static_cast<float>(static_cast<const at::Half*>(span.scales)[i]);
    default:
      return static_cast<float>(static_cast<const int8_t*>(span.scales)[i]) *
             static_cast<float>(span.factors[span.factor_index(t, row, g) + r]);
  }
}

// Weight row r of tile t's code of column `col` (0-31) in group g, as the signed integer the
// sums take (6 bits: the stored w + 32, less 32). The portable loop's and dequantize_rows'
// one reading of the layout.
template <int BITS, int ROWS>
inline int32_t code_at(const TileSpan<BITS, ROWS>& span, int t, int64_t g, int64_t r, int col) {
  const int j = col / 4, i = static_cast<int>(4 * r + col % 4);  // step j, byte i of a chunk
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(span.chunk(t, g, j)[i]);
  } else {
    const uint8_t byte = span.chunk(t, g, j / 2)[i];
    int32_t code = j % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
    if constexpr (BITS == kLevels) return kLevelValues[code];
    if constexpr (BITS >= 5) code |= ((span.chunk(t, g, 4)[i] >> j) & 1) << 4;
    if constexpr (BITS == 6) code = (code | ((span.chunk(t, g, 5)[i] >> j) & 1) << 5) - 32;
    return code;
  }
}

#if PREFIXGATE_QMM_AVX2
// Eight consecutive scales from index i (a multiple of 8), as floats.
template <int BITS, int ROWS>
inline __m256 load_scales(const TileSpan<BITS, ROWS>& span, int t, int64_t row, int64_t g) {
  const int64_t i = span.scale_index(t, row, g);
  switch (span.form) {
    case ScaleForm::kFloat:
      return _mm256_loadu_ps(static_cast<const float*>(span.scales) + i);
    case ScaleForm::kHalf:
      return _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const at::Half*>(span.scales) + i)));
    default: {
      const __m256 subs = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(span.scales) + i))));
      const __m256 factors = _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(span.factors + span.factor_index(t, row, g))));
      return _mm256_mul_ps(subs, factors);
    }
  }
}

// Step j's codes of a 4-, 5- or 6-bit tile group, a byte each: `packed` the 32 bytes holding
// steps j and j ^ 1 (the even one in the low nibbles), `fifths` (5, 6 bits) the group's
// fifth bits, bit s of byte i step s's code i's, `sixths` (6 bits) its sixth bits alike. For
// block_dot and the AMX path's prepare_pair.
template <int BITS>
inline __m256i step_codes(__m256i packed, [[maybe_unused]] __m256i fifths,
                          [[maybe_unused]] __m256i sixths, int j) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0F);
  __m256i u = j % 2 == 0 ? _mm256_and_si256(packed, low_nibbles)
                         : _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
  if constexpr (BITS >= 5) {  // bit j to bit 4 (16-bit shifts of at most 4 stay in their byte
                              // under the mask)
    const __m256i fifth =
        j < 4 ? _mm256_slli_epi16(fifths, 4 - j) : _mm256_srli_epi16(fifths, j - 4);
    u = _mm256_or_si256(u, _mm256_and_si256(fifth, _mm256_set1_epi8(0x10)));
  }
  if constexpr (BITS == 6) {  // bit j to bit 5, alike (shifts of at most 5)
    const __m256i sixth =
        j < 5 ? _mm256_slli_epi16(sixths, 5 - j) : _mm256_srli_epi16(sixths, j - 5);
    u = _mm256_or_si256(u, _mm256_and_si256(sixth, _mm256_set1_epi8(0x20)));
  }
  return u;
}
#endif

#if PREFIXGATE_QMM_AVX2
// kLevelValues in both 128-bit lanes: the table of level_codes' shuffle, loaded once a loop.
inline __m256i level_table() {
  return _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevelValues)));
}

// Step j's codes of a levels tile group (kLevels): its indices' levels as signed bytes, one
// byte shuffle of `table` (level_table()).
inline __m256i level_codes(__m256i table, __m256i packed, int j) {
  return _mm256_shuffle_epi8(table, step_codes<4>(packed, __m256i{}, __m256i{}, j));
}
#endif

// One row's result for one group, the same in every block and every build: the integer dot
// product `sum` scaled by d * a, then the min term m * s, each added with one rounding.
inline float add_group(float acc, int32_t sum, float d, float a, float m, float s) {
  acc = std::fma(static_cast<float>(sum), d * a, acc);
  return std::fma(m, s, acc);
}

// A group in a register block: its integer sums, then their scaling (the d, then the min
// term), whole, or half by half with HALVES (steps 0-3 are columns 0-15, each half its own
// d; `clear(part)` starts a part's sums, `scale_sums(d_row, part, with_min)` scales them; part
// 0 all codes, 1 codes 0-15, 2 codes 16-31).
// MINS: 0 no min term, 1 one m a group (after the last part), 2 an m per half (after each).
// The same order in every block and every width.
template <bool HALVES, int MINS, typename Clear, typename Accumulate, typename Scale>
__attribute__((always_inline)) inline void one_group(const Clear& clear,
                                                     const Accumulate& accumulate,
                                                     const Scale& scale_sums) {
  static_assert(MINS < 2 || HALVES, "an m per half needs the halves");
  if constexpr (!HALVES) {
    clear(0);
    accumulate(0, kSteps / 2);
    scale_sums(0, 0, MINS > 0);
  } else {
    clear(1);
    accumulate(0, kSteps / 4);
    scale_sums(0, 1, MINS == 2);
    clear(2);
    accumulate(kSteps / 4, kSteps / 2);
    scale_sums(1, 2, MINS > 0);
  }
}

// Which of a tile's scale rows holds the m of `part` (see one_group): after the d row, or the
// two of HALVES; with MINS 2, rows 2 and 3, one a half.
template <bool HALVES, int MINS>
constexpr int64_t m_row(int part) {
  return MINS == 2 ? 1 + part : HALVES ? 2 : 1;
}

#if PREFIXGATE_QMM_AVX2 && !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
// A 4-bit group's integer sums for block_dot's prefill block (5 activation rows x 2 tiles, the
// 16-bit pair sums of kPairs): its 8 steps, written out in assembly. Why: the block's 10
// accumulators, the two tiles' codes, the broadcast, the product and the nibble mask take 15
// of the 16 AVX2 registers, and the compiler, which also holds the 10 float accumulators
// live across the group, kept 9 of the 10 sums on the stack: a load and a store each every
// two steps. Here the sums stay in registers for the whole group; the float work around it
// stays C++. The instructions are block_dot's own (the same maddubs and adds on the same
// bytes; integer sums have no order), so the bits are too. Measured on the AVX2 EPYC (Zen 3),
// one thread, SmolLM2's int4 linears (tools/bench_kernels.py, in turns): 77 rows 68.1 -> 74.8
// G multiply-adds/s, 200 rows 64.9 -> 71.5; a 1,000-token prefill 472-493 -> 490-550 tokens/s.
//   codes: the group's chunk 0 of tile 0 (tile 1's chunk c at +32 from tile 0's, chunks 64
//   bytes apart); acts: row 0's group codes, row r's at + r * k; sums: written.
#define PG_Q4_ROW(OFF, ADDR, S0, S1)                                                       \
  "vpbroadcastd " #OFF ADDR ", %[b]\n\t"                                                    \
  "vpmaddubsw %[b], %[u0], %[p]\n\t"                                                        \
  "vpaddw %[p], %[" S0 "], %[" S0 "]\n\t"                                                   \
  "vpmaddubsw %[b], %[u1], %[p]\n\t"                                                        \
  "vpaddw %[p], %[" S1 "], %[" S1 "]\n\t"
// The first step's products start the sums.
#define PG_Q4_FIRST_ROW(OFF, ADDR, S0, S1)                                                 \
  "vpbroadcastd " #OFF ADDR ", %[b]\n\t"                                                    \
  "vpmaddubsw %[b], %[u0], %[" S0 "]\n\t"                                                   \
  "vpmaddubsw %[b], %[u1], %[" S1 "]\n\t"
#define PG_Q4_STEP(ROW, OFF)                                                               \
  ROW(OFF, "(%[a0])", "s00", "s01")                                                         \
  ROW(OFF, "(%[a0],%[k],1)", "s10", "s11")                                                  \
  ROW(OFF, "(%[a0],%[k],2)", "s20", "s21")                                                  \
  ROW(OFF, "(%[a3])", "s30", "s31")                                                         \
  ROW(OFF, "(%[a3],%[k],1)", "s40", "s41")
// Steps 2c (low nibbles, activation bytes EVEN..EVEN + 3) and 2c + 1 (high nibbles, ODD..)
// of chunk c, whose tiles' bytes start at C0 and C1.
#define PG_Q4_PAIR(FIRST, C0, C1, EVEN, ODD)                                               \
  "vpand " #C0 "(%[c]), %[mask], %[u0]\n\t"                                                 \
  "vpand " #C1 "(%[c]), %[mask], %[u1]\n\t" PG_Q4_STEP(FIRST, EVEN)                         \
  "vmovdqu " #C0 "(%[c]), %[u0]\n\t"                                                        \
  "vmovdqu " #C1 "(%[c]), %[u1]\n\t"                                                        \
  "vpsrlw $4, %[u0], %[u0]\n\t"                                                             \
  "vpsrlw $4, %[u1], %[u1]\n\t"                                                             \
  "vpand %[u0], %[mask], %[u0]\n\t"                                                         \
  "vpand %[u1], %[mask], %[u1]\n\t" PG_Q4_STEP(PG_Q4_ROW, ODD)
// always_inline: the compiler sizes an asm statement by its lines and called this one, the
// sums then passing through memory (measured: the gain halved).
__attribute__((always_inline)) inline void q4_group_sums_5x2(const uint8_t* codes,
                                                             const int8_t* acts, int64_t k,
                                                             __m256i (&sums)[5][2]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int8_t* acts3 = acts + 3 * k;
  __m256i u0, u1, b, p;
  asm(PG_Q4_PAIR(PG_Q4_FIRST_ROW, 0, 32, 0, 4) PG_Q4_PAIR(PG_Q4_ROW, 64, 96, 8, 12)
          PG_Q4_PAIR(PG_Q4_ROW, 128, 160, 16, 20) PG_Q4_PAIR(PG_Q4_ROW, 192, 224, 24, 28)
      : [s00] "=&x"(sums[0][0]), [s01] "=&x"(sums[0][1]), [s10] "=&x"(sums[1][0]),
        [s11] "=&x"(sums[1][1]), [s20] "=&x"(sums[2][0]), [s21] "=&x"(sums[2][1]),
        [s30] "=&x"(sums[3][0]), [s31] "=&x"(sums[3][1]), [s40] "=&x"(sums[4][0]),
        [s41] "=&x"(sums[4][1]), [u0] "=&x"(u0), [u1] "=&x"(u1), [b] "=&x"(b), [p] "=&x"(p)
      : [c] "r"(codes), [a0] "r"(acts), [a3] "r"(acts3), [k] "r"(k), [mask] "x"(mask)
      : "memory");
}
#undef PG_Q4_PAIR

// The same for 5-bit codes (Q5_0, Q5_1, Q5_K), in a block of 5 rows x 2 tiles where the
// compiler's code took 2 x 2 (the unpacking, a nibble and the 5th bits' plane, is per tile and
// then serves 5 rows instead of 2). 16-bit pair sums hold 4 steps (4 * 2 * 31 * 127), so the
// first 4 steps' sums wait in `stash` while the last 4 accumulate; each 16-bit sum is then
// widened (pairs added into 32 bits) and the two added: the integers of block_dot's loop, the
// group's 32-bit sums. The 5th bit's mask and the ones as memory operands (kAsmConstants;
// the nibble mask is a register, as in the 4-bit block).
alignas(32) inline constexpr uint64_t kAsmConstants[2][4] = {
    {0x1010101010101010, 0x1010101010101010, 0x1010101010101010, 0x1010101010101010},
    {0x0001000100010001, 0x0001000100010001, 0x0001000100010001, 0x0001000100010001}};
// Tile bytes C (the nibble chunk) and F (the 5th bits' plane), one step's codes into U:
// NIBBLE the instructions that leave the step's nibble in U, then bit 4 from the plane
// (shifted by FOP FN: block_dot's step_codes).
#define PG_Q5_CODES(U, NIBBLE, F, FOP, FN)                                                  \
  NIBBLE "vmovdqu " #F "(%[c]), %[p]\n\t" FOP " $" #FN ", %[p], %[p]\n\t"                   \
  "vpand (%[mk]), %[p], %[p]\n\t"                                                           \
  "vpor %[p], %[" U "], %[" U "]\n\t"
#define PG_Q5_LOW(U, C) "vpand " #C "(%[c]), %[mask], %[" U "]\n\t"
#define PG_Q5_HIGH(U, C)                                                                    \
  "vmovdqu " #C "(%[c]), %[" U "]\n\t"                                                      \
  "vpsrlw $4, %[" U "], %[" U "]\n\t"                                                       \
  "vpand %[" U "], %[mask], %[" U "]\n\t"
// Step j: both tiles' codes (NIBBLE PG_Q5_LOW or PG_Q5_HIGH of chunk C, the plane shifted by
// FOP FN), then the rows' products from activation byte 4j (ROW: PG_Q4_ROW or, to start the
// sums, PG_Q4_FIRST_ROW).
#define PG_Q5_STEP(ROW, NIBBLE, C, FOP, FN, OFF)                                            \
  PG_Q5_CODES("u0", NIBBLE("u0", C), 256, FOP, FN)                                          \
  PG_Q5_CODES("u1", NIBBLE("u1", 32 + C), 288, FOP, FN) PG_Q4_STEP(ROW, OFF)
#define PG_Q5_STASH(S, OFF) "vmovdqa %[" S "], " #OFF "(%[stash])\n\t"
#define PG_Q5_WIDEN(S, OFF)                                                                 \
  "vpmaddwd 32(%[mk]), %[" S "], %[" S "]\n\t"                                              \
  "vmovdqa " #OFF "(%[stash]), %[p]\n\t"                                                    \
  "vpmaddwd 32(%[mk]), %[p], %[p]\n\t"                                                      \
  "vpaddd %[p], %[" S "], %[" S "]\n\t"
#define PG_Q5_EACH(M)                                                                      \
  M("s00", 0) M("s01", 32) M("s10", 64) M("s11", 96) M("s20", 128) M("s21", 160)            \
      M("s30", 192) M("s31", 224) M("s40", 256) M("s41", 288)
__attribute__((always_inline)) inline void q5_group_sums_5x2(const uint8_t* codes,
                                                             const int8_t* acts, int64_t k,
                                                             __m256i (&sums)[5][2]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const int8_t* acts3 = acts + 3 * k;
  alignas(32) __m256i stash[10];
  __m256i u0, u1, b, p;
  asm(PG_Q5_STEP(PG_Q4_FIRST_ROW, PG_Q5_LOW, 0, "vpsllw", 4, 0)
          PG_Q5_STEP(PG_Q4_ROW, PG_Q5_HIGH, 0, "vpsllw", 3, 4)
              PG_Q5_STEP(PG_Q4_ROW, PG_Q5_LOW, 64, "vpsllw", 2, 8)
                  PG_Q5_STEP(PG_Q4_ROW, PG_Q5_HIGH, 64, "vpsllw", 1, 12)
                      PG_Q5_EACH(PG_Q5_STASH)
                          PG_Q5_STEP(PG_Q4_FIRST_ROW, PG_Q5_LOW, 128, "vpsrlw", 0, 16)
                              PG_Q5_STEP(PG_Q4_ROW, PG_Q5_HIGH, 128, "vpsrlw", 1, 20)
                                  PG_Q5_STEP(PG_Q4_ROW, PG_Q5_LOW, 192, "vpsrlw", 2, 24)
                                      PG_Q5_STEP(PG_Q4_ROW, PG_Q5_HIGH, 192, "vpsrlw", 3, 28)
                                          PG_Q5_EACH(PG_Q5_WIDEN)
      : [s00] "=&x"(sums[0][0]), [s01] "=&x"(sums[0][1]), [s10] "=&x"(sums[1][0]),
        [s11] "=&x"(sums[1][1]), [s20] "=&x"(sums[2][0]), [s21] "=&x"(sums[2][1]),
        [s30] "=&x"(sums[3][0]), [s31] "=&x"(sums[3][1]), [s40] "=&x"(sums[4][0]),
        [s41] "=&x"(sums[4][1]), [u0] "=&x"(u0), [u1] "=&x"(u1), [b] "=&x"(b), [p] "=&x"(p)
      : [c] "r"(codes), [a0] "r"(acts), [a3] "r"(acts3), [k] "r"(k), [mask] "x"(mask),
        [mk] "r"(kAsmConstants), [stash] "r"(stash)
      : "memory");
}
#undef PG_Q5_EACH
#undef PG_Q5_WIDEN
#undef PG_Q5_STASH
#undef PG_Q5_STEP
#undef PG_Q5_HIGH
#undef PG_Q5_LOW
#undef PG_Q5_CODES
#undef PG_Q4_STEP
#undef PG_Q4_FIRST_ROW
#undef PG_Q4_ROW
#endif

// MB activation rows from `first_row` times the T tiles of `span`; writes
// out[mb * n + 8 * t + r], rounded once to T (the activations' dtype).
template <int BITS, int MB, int T, bool HALVES, int MINS, typename OUT>
void block_dot(const LayoutSpan<BITS, HALVES, MINS>& span, const QuantizedActivations& act,
               int64_t first_row, int64_t k, OUT* out, int64_t n) {
  const int64_t groups = k / kGroup;
  const ActivationRows rows(act, first_row, k);
  // a tile's group: 4 bits, chunks 0-3 (steps 2c, 2c + 1); 5, 6 bits: the 5th bits' plane in
  // chunk 4, the 6th bits' in 5; 8 bits, chunk j step j
#if PREFIXGATE_QMM_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  constexpr bool kVnni = true;
#else
  constexpr bool kVnni = false;
#endif
  // 4 bits without VNNI: 16-bit pair sums (8 steps of <= 2 * 15 * 127 fit); else 32-bit sums.
  constexpr bool kPairs = BITS == 4 && !kVnni;
  __m256 acc[MB][T];
  for (int mb = 0; mb < MB; ++mb)
    for (int t = 0; t < T; ++t) acc[mb][t] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i levels = level_table();  // kLevels' lookup
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (MB <= kPrefetchRows) prefetch_ahead(span, g);
    // With VNNI one dpbusd waits ~5 cycles on the one before it into the same register:
    // fewer than 4 accumulators (decode's 1 x 2) get steps spread over chains, summed after.
    constexpr int kChains = kVnni && MB * T < 4 ? 4 / (MB * T) : 1;
    __m256i sums[kChains][MB][T];
    // Codes taken as w + c add c * sum(activation codes) to the integer sum: each row's first
    // chain starts from minus that (its offset), so the sum comes out as the signed codes'.
    constexpr bool kOffset = code_offset(BITS) != 0;
    const auto clear = [&](int part) __attribute__((always_inline)) {
      for (int c = 0; c < kChains; ++c)
        for (int mb = 0; mb < MB; ++mb) {
          const __m256i start = kOffset && c == 0
                                    ? _mm256_set1_epi32(*rows.offset_of(mb * groups + g, part))
                                    : _mm256_setzero_si256();
          for (int t = 0; t < T; ++t) sums[c][mb][t] = start;
        }
    };
    // The integer sums of steps [2 * first_pair, 2 * last_pair) into `sums`.
    const auto accumulate = [&](int first_pair, int last_pair) __attribute__((always_inline)) {
#if !(defined(__AVX512VNNI__) && defined(__AVX512VL__))
    if constexpr ((kPairs || BITS == 5) && MB == 5 && T == 2) {  // a whole group, in assembly
      static_assert(!kOffset, "the assembly writes the sums: they must start from 0");
      if (first_pair == 0 && last_pair == kSteps / 2) {
        if constexpr (kPairs)
          q4_group_sums_5x2(span.chunk(0, g, 0), rows.codes + g * kGroup, k, sums[0]);
        else
          q5_group_sums_5x2(span.chunk(0, g, 0), rows.codes + g * kGroup, k, sums[0]);
        return;
      }
    }
#endif
    // 5 bits without VNNI: 16-bit pair sums over 4 steps (<= 4 * 2 * 31 * 127), then widened
    // into `sums`: the same integers as widening every step, for fewer instructions; 6 bits
    // over 2 steps (<= 2 * 2 * 63 * 127).
    [[maybe_unused]] __m256i sums16[MB][T];
    if constexpr (BITS >= 5 && BITS < 8 && !kVnni)
      for (int mb = 0; mb < MB; ++mb)
        for (int t = 0; t < T; ++t) sums16[mb][t] = _mm256_setzero_si256();
    for (int pair = first_pair; pair < last_pair; ++pair) {
      [[maybe_unused]] __m256i packed[T];  // 4-6 bits: steps 2 * pair and 2 * pair + 1
      [[maybe_unused]] __m256i fifths[T];  // 5, 6 bits: bit s of byte i, step s's code i's 5th
      [[maybe_unused]] __m256i sixths[T];  // 6 bits: its 6th
      if constexpr (BITS == 5 || BITS == 6) {
        for (int t = 0; t < T; ++t)
          fifths[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(span.chunk(t, g, 4)));
      }
      if constexpr (BITS == 6) {
        for (int t = 0; t < T; ++t)
          sixths[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(span.chunk(t, g, 5)));
      }
      if constexpr (BITS != 8) {
        for (int t = 0; t < T; ++t)
          packed[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(span.chunk(t, g, pair)));
      }
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * pair + half;
        __m256i u[T];                      // the multiply-add's unsigned operand, per tile
        [[maybe_unused]] __m256i sign[T];  // 8 bits without VNNI: the codes, for their signs
        for (int t = 0; t < T; ++t) {
          if constexpr (BITS != 8 && BITS != kLevels)
            u[t] = step_codes<BITS>(packed[t], BITS >= 5 ? fifths[t] : __m256i{},
                                    BITS == 6 ? sixths[t] : __m256i{}, j);
          if constexpr (BITS == 8 || BITS == kLevels) {
            // 8-bit codes are signed and the multiply-add takes its first operand unsigned:
            // with VNNI, w + 128 (its top bit flipped), the 128 * sum(activation codes) it
            // adds taken off the integer sum after; without, |w|, w's sign moved onto the
            // activation (llama.cpp's trick: maddubs' pair sums of 127 * 127 stay in int16).
            // Levels: their indices looked up, the same bytes as the levels stored.
            __m256i codes8;
            if constexpr (BITS == kLevels)
              codes8 = level_codes(levels, packed[t], j);
            else
              codes8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(span.chunk(t, g, j)));
            if constexpr (kVnni) {
              u[t] = _mm256_xor_si256(codes8, _mm256_set1_epi8(static_cast<char>(0x80)));
            } else {
              u[t] = _mm256_sign_epi8(codes8, codes8);
              sign[t] = codes8;
            }
          }
        }
        for (int mb = 0; mb < MB; ++mb) {
          int32_t four;
          std::memcpy(&four, rows.codes + mb * k + g * kGroup + 4 * j, sizeof four);
          const __m256i s = _mm256_set1_epi32(four);
          for (int t = 0; t < T; ++t) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
            sums[j % kChains][mb][t] = _mm256_dpbusd_epi32(sums[j % kChains][mb][t], u[t], s);
#else
            if constexpr (kPairs) {  // <= 8 * 2 * 15 * 127
              sums[0][mb][t] = _mm256_add_epi16(sums[0][mb][t], _mm256_maddubs_epi16(u[t], s));
            } else if constexpr (BITS == 5 || BITS == 6) {
              sums16[mb][t] = _mm256_add_epi16(sums16[mb][t], _mm256_maddubs_epi16(u[t], s));
            } else {
              const __m256i pairs = _mm256_maddubs_epi16(u[t], _mm256_sign_epi8(s, sign[t]));
              sums[0][mb][t] =
                  _mm256_add_epi32(sums[0][mb][t], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
            }
#endif
          }
        }
      }
      if constexpr ((BITS == 5 || BITS == 6) && !kVnni) {
        if (BITS == 6 || pair % 2 == 1) {  // 4 (6 bits: 2) steps summed: widen, start again
          for (int mb = 0; mb < MB; ++mb)
            for (int t = 0; t < T; ++t) {
              sums[0][mb][t] = _mm256_add_epi32(
                  sums[0][mb][t], _mm256_madd_epi16(sums16[mb][t], _mm256_set1_epi16(1)));
              sums16[mb][t] = _mm256_setzero_si256();
            }
        }
      }
    }
    };
    // `sums` scaled by the d in scale row `d_row` and added (add_group's first rounding, eight
    // rows at once), then, `with_min`, the min term (its second); `part`: the codes summed, 0
    // all, 1 codes 0-15, 2 codes 16-31.
    const auto scale_sums = [&](int64_t d_row, int part,
                                bool with_min) __attribute__((always_inline)) {
      for (int t = 0; t < T; ++t) {
        const __m256 d = load_scales(span, t, d_row, g);
        [[maybe_unused]] __m256 m;
        if (with_min) m = load_scales(span, t, m_row<HALVES, MINS>(part), g);
        for (int mb = 0; mb < MB; ++mb) {
          __m256i total = sums[0][mb][t];
          for (int c = 1; c < kChains; ++c) total = _mm256_add_epi32(total, sums[c][mb][t]);
          if constexpr (kPairs) total = _mm256_madd_epi16(total, _mm256_set1_epi16(1));
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(rows.scale[mb * groups + g]));
          acc[mb][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), scale, acc[mb][t]);
          if (with_min)
            acc[mb][t] = _mm256_fmadd_ps(
                m, _mm256_set1_ps(rows.summed(mb * groups + g, MINS == 2 ? part : 0)),
                acc[mb][t]);
        }
      }
    };
    one_group<HALVES, MINS>(clear, accumulate, scale_sums);
  }
  for (int mb = 0; mb < MB; ++mb) {
    for (int t = 0; t < T; ++t) {
      prefixgate::f8 lanes;
      std::memcpy(&lanes, &acc[mb][t], sizeof lanes);
      prefixgate::store8(out + mb * n + t * kTile, lanes);
    }
  }
#else
  for (int mb = 0; mb < MB; ++mb) {
    for (int t = 0; t < T; ++t) {
      float total[kTile] = {};
      for (int64_t g = 0; g < groups; ++g) {
        const int8_t* a = rows.codes + mb * k + g * kGroup;
        for (int64_t r = 0; r < kTile; ++r) {
          int32_t sums[2] = {};  // columns 0-15 and 16-31
          for (int col = 0; col < kGroup; ++col)
            sums[col / 16] += code_at(span, t, g, r, col) * a[col];
          const float ga = rows.scale[mb * groups + g];
          const auto m = [&](int part) {
            const int64_t row = m_row<HALVES, MINS>(part);
            return scale_at(span, t, row, g, r);
          };
          const float d = scale_at(span, t, 0, g, r);
          const int64_t i = mb * groups + g;
          if constexpr (!HALVES) {  // without a min row m = 0: its fma adds nothing
            total[r] =
                add_group(total[r], sums[0] + sums[1], d, ga, MINS ? m(0) : 0.f, rows.sum[i]);
          } else if constexpr (MINS == 2) {
            const float d_high = scale_at(span, t, 1, g, r);
            total[r] = add_group(total[r], sums[0], d, ga, m(1), rows.summed(i, 1));
            total[r] = add_group(total[r], sums[1], d_high, ga, m(2), rows.summed(i, 2));
          } else {
            const float d_high = scale_at(span, t, 1, g, r);
            total[r] = std::fma(static_cast<float>(sums[0]), d * ga, total[r]);
            total[r] = add_group(total[r], sums[1], d_high, ga, MINS ? m(2) : 0.f, rows.sum[i]);
          }
        }
      }
      for (int64_t r = 0; r < kTile; ++r) out[mb * n + t * kTile + r] = static_cast<OUT>(total[r]);
    }
  }
#endif
}

#if PREFIXGATE_QMM_WIDE
// block_dot for a pair of tiles in 512-bit registers: tile 0's 8 weight rows in lanes 0-7,
// tile 1's in lanes 8-15, so one VNNI multiply-add, conversion and scaling serves both, and a
// register block takes kWideRows activation rows. Every lane runs block_dot's operations on
// its row, in the same order (the same integer sums, then the same two roundings a group):
// the same bits as block_dot with T = 2, at half the instructions. Measured on the Intel Xeon
// (family 6 model 207), SmolLM2's linears at 8 rows: 129 G multiply-adds/s in 256-bit lanes.
constexpr int kWideRows = 8;

// Chunk c of group g of both tiles, tile 0's in the low half: one load.
template <int BITS, int ROWS>
inline __m512i pair_bytes(const TileSpan<BITS, ROWS>& span, int64_t g, int64_t c) {
  return _mm512_loadu_si512(span.chunk(0, g, c));
}

// The 16 scales of scale row `row` in group g, tile 0's in the low half, from one load; a
// factored scale's int8 times `factor`, the row's factors of g's super-block, which the
// caller widens once per super-block.
template <int BITS, int ROWS>
inline __m512 pair_scales(const TileSpan<BITS, ROWS>& span, int64_t row, int64_t g,
                          __m512 factor) {
  const int64_t i = span.scale_index(0, row, g);
  switch (span.form) {
    case ScaleForm::kFloat:
      return _mm512_loadu_ps(static_cast<const float*>(span.scales) + i);
    case ScaleForm::kHalf:
      return _mm512_cvtph_ps(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const at::Half*>(span.scales) + i)));
    default:
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                               reinterpret_cast<const __m128i*>(
                                   static_cast<const int8_t*>(span.scales) + i)))),
                           factor);
  }
}

// step_codes in 512-bit lanes: the same bytes, tile by tile.
template <int BITS>
inline __m512i pair_step_codes(__m512i packed, [[maybe_unused]] __m512i fifths,
                               [[maybe_unused]] __m512i sixths, int j) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512i u = j % 2 == 0 ? _mm512_and_si512(packed, low_nibbles)
                         : _mm512_and_si512(_mm512_srli_epi16(packed, 4), low_nibbles);
  if constexpr (BITS >= 5) {
    const __m512i fifth =
        j < 4 ? _mm512_slli_epi16(fifths, 4 - j) : _mm512_srli_epi16(fifths, j - 4);
    u = _mm512_or_si512(u, _mm512_and_si512(fifth, _mm512_set1_epi8(0x10)));
  }
  if constexpr (BITS == 6) {
    const __m512i sixth =
        j < 5 ? _mm512_slli_epi16(sixths, 5 - j) : _mm512_srli_epi16(sixths, j - 5);
    u = _mm512_or_si512(u, _mm512_and_si512(sixth, _mm512_set1_epi8(0x20)));
  }
  return u;
}

// MB activation rows from `first_row` times the two tiles of `span`; writes
// out[mb * n + lane], lanes 0-15.
template <int BITS, int MB, bool HALVES, int MINS, typename OUT>
void pair_dot(const LayoutSpan<BITS, HALVES, MINS>& span, const QuantizedActivations& act,
              int64_t first_row, int64_t k, OUT* out, int64_t n) {
  const int64_t groups = k / kGroup;
  const ActivationRows rows(act, first_row, k);
  // A multiply-add waits several cycles on the one before it into the same register: at
  // least eight chains in flight (integer sums: any order gives the same total).
  constexpr int kChains = (8 + MB - 1) / MB;
  __m512 acc[MB];
  for (int mb = 0; mb < MB; ++mb) acc[mb] = _mm512_setzero_ps();
  constexpr int kScaleRows = scale_rows(HALVES, MINS);
  // Factored scales: each scale row's factors widened once per super-block of 8 groups.
  const bool factored = span.form == ScaleForm::kFactored;
  __m512 factors[kScaleRows] = {};
  // levels: the table of w + 128 (w's top bit flipped) in every 128-bit lane
  [[maybe_unused]] const __m512i biased_levels = _mm512_xor_si512(
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kLevelValues))),
      _mm512_set1_epi8(static_cast<char>(0x80)));
  for (int64_t g = 0; g < groups; ++g) {
    if (factored && g % 8 == 0)
      for (int r = 0; r < kScaleRows; ++r)
        factors[r] = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(span.factors + span.factor_index(0, r, g))));
    if constexpr (MB <= kPrefetchRows) prefetch_ahead(span, g);
    // the group's chunks in address order (4-6 bits: the nibbles' four, then the planes)
    [[maybe_unused]] __m512i packed[4], fifths{}, sixths{};
    if constexpr (BITS != 8)
      for (int c = 0; c < 4; ++c) packed[c] = pair_bytes(span, g, c);
    if constexpr (BITS == 5 || BITS == 6) fifths = pair_bytes(span, g, 4);
    if constexpr (BITS == 6) sixths = pair_bytes(span, g, 5);
    __m512i sums[kChains][MB];
    const auto clear = [&](int part) __attribute__((always_inline)) {  // as block_dot's
      for (int c = 0; c < kChains; ++c)
        for (int mb = 0; mb < MB; ++mb)
          sums[c][mb] = code_offset(BITS) != 0 && c == 0
                            ? _mm512_set1_epi32(*rows.offset_of(mb * groups + g, part))
                            : _mm512_setzero_si512();
    };
    const auto accumulate = [&](int first_pair, int last_pair) __attribute__((always_inline)) {
      for (int pair = first_pair; pair < last_pair; ++pair) {
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * pair + half;
          __m512i u;
          if constexpr (BITS == 8) {  // w + 128, as block_dot's VNNI loop
            u = _mm512_xor_si512(pair_bytes(span, g, j),
                                 _mm512_set1_epi8(static_cast<char>(0x80)));
          } else if constexpr (BITS == kLevels) {  // the levels + 128, looked up
            u = _mm512_shuffle_epi8(biased_levels,
                                    pair_step_codes<4>(packed[pair], __m512i{}, __m512i{}, j));
          } else {
            u = pair_step_codes<BITS>(packed[pair], fifths, sixths, j);
          }
          for (int mb = 0; mb < MB; ++mb) {
            int32_t four;
            std::memcpy(&four, rows.codes + mb * k + g * kGroup + 4 * j, sizeof four);
            sums[j % kChains][mb] =
                _mm512_dpbusd_epi32(sums[j % kChains][mb], u, _mm512_set1_epi32(four));
          }
        }
      }
    };
    const auto scale_sums = [&](int64_t d_row, int part,
                                bool with_min) __attribute__((always_inline)) {
      const __m512 d = pair_scales(span, d_row, g, factors[d_row]);
      [[maybe_unused]] __m512 m;
      if (with_min) {
        const int64_t m_at = m_row<HALVES, MINS>(part);
        m = pair_scales(span, m_at, g, factors[m_at]);
      }
      for (int mb = 0; mb < MB; ++mb) {
        __m512i total = sums[0][mb];
        for (int c = 1; c < kChains; ++c) total = _mm512_add_epi32(total, sums[c][mb]);
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(rows.scale[mb * groups + g]));
        acc[mb] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), scale, acc[mb]);
        if (with_min)
          acc[mb] = _mm512_fmadd_ps(
              m, _mm512_set1_ps(rows.summed(mb * groups + g, MINS == 2 ? part : 0)), acc[mb]);
      }
    };
    one_group<HALVES, MINS>(clear, accumulate, scale_sums);
  }
  for (int mb = 0; mb < MB; ++mb) {
    prefixgate::f8 low, high;
    std::memcpy(&low, &acc[mb], sizeof low);
    std::memcpy(&high, reinterpret_cast<const float*>(&acc[mb]) + kTile, sizeof high);
    prefixgate::store8(out + mb * n, low);
    prefixgate::store8(out + mb * n + kTile, high);
  }
}
#endif

// Rows [begin, end) times the T tiles of `span`: blocks of kRowBlock rows, then the rest in
// one smaller block.
template <int BITS, int T, bool HALVES, int MINS, typename OUT>
void rows_dot(const LayoutSpan<BITS, HALVES, MINS>& span, const QuantizedActivations& act,
              int64_t begin, int64_t end, int64_t k, OUT* out, int64_t n) {
#if PREFIXGATE_QMM_WIDE
  if constexpr (T == 2) {  // a pair of tiles: 512-bit lanes, the same bits
    int64_t row = begin;
    for (; row + kWideRows <= end; row += kWideRows)
      pair_dot<BITS, kWideRows, HALVES, MINS>(span, act, row, k, out + row * n, n);
    const auto rest = [&](auto rows) {
      pair_dot<BITS, decltype(rows)::value, HALVES, MINS>(span, act, row, k, out + row * n, n);
    };
    prefixgate::with_count<kWideRows>(end - row, rest);
    return;
  }
#endif
  constexpr int MB = kRowBlock<BITS>;
  int64_t i = begin;
  for (; i + MB <= end; i += MB)
    block_dot<BITS, MB, T, HALVES, MINS>(span, act, i, k, out + i * n, n);
  const auto rest = [&](auto rows) {
    block_dot<BITS, decltype(rows)::value, T, HALVES, MINS>(span, act, i, k, out + i * n, n);
  };
  prefixgate::with_count<MB>(end - i, rest);
}

constexpr int64_t kAmxRows = 16;  // activation rows per AMX block: a tile's rows

#if PREFIXGATE_QMM_AMX
// Rows at prefill shapes on AMX tiles: blocks of 16 activation rows times a pair of tiles (16
// weight rows), one tile multiply (TDPBSSD: signed codes times signed codes, exact 32-bit
// sums) per group of 32 columns, or per half of one (HALVES). A group's integer sums are the
// same integers the vector loop gets (integer addition has no order), and the float epilogue
// is block_dot's, operation for operation: acc = fma(float(sum), d * a, acc), then
// fma(m, s, acc), group by group. So a row's bits are what it gets alone, on the vector path;
// the pinned digests check it. Rows short of a block of 16 and an odd last tile take
// block_dot.
//
// The layouts need no activation packing: a tile of A is 16 activation rows of a group's 32
// codes, read in place with the row stride K; B is the group's 8 steps of 4 columns, each
// step 64 bytes, tile t's 32 then tile t + 1's (the steps of our weight layout side by side,
// 4-bit codes split out of their nibbles), so C's row i is activation row i against the 16
// weight rows, one float lane each. Only the epilogue is vector work; on the 2-vCPU Xeon
// measured (family 6 model 207) it, not the tile multiply, bounds the loop.
constexpr int64_t kAmxChunkRows = 256;  // rows whose codes (<= 384 KB at K = 1536) stay in L2

using prefixgate::amx_ready;

// The tile configuration (palette 1) for a group's part of `part_cols` columns: tiles 0-3 the
// sums (16 x 16 int32) of two row blocks times two pairs, 4-5 the two row blocks' activations
// (16 rows x part_cols bytes), 6-7 the two pairs' weights (part_cols / 4 rows of 64 bytes).
// Four independent multiplies a part: one tile multiply's latency is several times its
// issue interval, and one chain at a time left the tile unit idle most of the time.
struct AmxConfig : prefixgate::TileConfig {
  explicit AmxConfig(int part_cols) {
    for (int i = 0; i < 4; ++i) set(i, kAmxRows, 64);
    for (int i = 4; i < 6; ++i) set(i, kAmxRows, part_cols);
    for (int i = 6; i < 8; ++i) set(i, part_cols / 4, 64);
  }
};

// A pair of tiles made ready for the tile multiply, every group: B's steps (64 bytes each,
// 8 per group) and the scale rows as 16 floats (d, or d per half, then m).
struct PairWeights {
  std::vector<int8_t> steps;  // [G, 8, 64]
  std::vector<float> scales;  // [G, parts, 16]
};

template <int BITS, bool HALVES, int MINS>
void prepare_pair(const LayoutSpan<BITS, HALVES, MINS>& span, int64_t groups,
                  PairWeights& pair) {
  constexpr int kParts = scale_rows(HALVES, MINS);  // the scale rows, in their order
  pair.steps.resize(groups * kSteps * 64);
  pair.scales.resize(groups * kParts * 16);
  [[maybe_unused]] const __m256i levels = level_table();  // kLevels' lookup
  for (int64_t g = 0; g < groups; ++g) {
    int8_t* steps = pair.steps.data() + g * kSteps * 64;
    for (int t = 0; t < 2; ++t) {
      const __m256i fifths =
          BITS == 5 || BITS == 6
              ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(span.chunk(t, g, 4)))
              : __m256i{};
      const __m256i sixths =
          BITS == 6 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(span.chunk(t, g, 5)))
                    : __m256i{};
      for (int j = 0; j < kSteps; ++j) {
        __m256i step = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(span.chunk(t, g, BITS == 8 ? j : j / 2)));
        if constexpr (BITS == kLevels) {
          step = level_codes(levels, step, j);
        } else if constexpr (BITS != 8) {
          step = step_codes<BITS>(step, fifths, sixths, j);
        }
        // 6-bit codes are stored as w + 32: the tiles multiply signed bytes, w itself
        if constexpr (BITS == 6) step = _mm256_sub_epi8(step, _mm256_set1_epi8(32));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + j * 64 + t * 32), step);
      }
    }
    float* scales = pair.scales.data() + g * kParts * 16;
    for (int part = 0; part < kParts; ++part) {
      for (int t = 0; t < 2; ++t)
        _mm256_storeu_ps(scales + part * 16 + t * 8,
                         load_scales(span, t, part, g));
    }
  }
}

// A sums tile of a group's part added into `acc` (16 activation rows x 16 weight rows, in
// memory; `first`: it holds nothing yet, the zeros block_dot starts from): block_dot's
// scale_sums, sixteen lanes at a time. Row i's activation scale is da[i * groups + g], its
// scaled code sum for the min term sa[i * sa_stride].
inline void amx_epilogue(const int32_t* sums, const float* d, const float* m, const float* da,
                         const float* sa, int64_t sa_stride, int64_t groups, int64_t g,
                         bool first, float* acc) {
  const __m512 dv = _mm512_loadu_ps(d);
  const __m512 mv = m != nullptr ? _mm512_loadu_ps(m) : _mm512_setzero_ps();
  for (int i = 0; i < kAmxRows; ++i) {
    const __m512 total = _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * i));
    const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(da[i * groups + g]));
    const __m512 before = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + 16 * i);
    __m512 lanes = _mm512_fmadd_ps(total, scale, before);
    if (m != nullptr) lanes = _mm512_fmadd_ps(mv, _mm512_set1_ps(sa[i * sa_stride]), lanes);
    _mm512_store_ps(acc + 16 * i, lanes);
  }
}

// RB blocks of 16 activation rows from `row` times PB pairs of tiles (1 or 2 each), every
// group; writes out[(row + i) * n + 16 * pb + lane]. The tile configuration is loaded.
// Tile numbers are literals (GCC's tile intrinsics paste them into their assembly).
template <int RB, int PB, bool HALVES, int MINS, typename OUT>
void amx_block(const PairWeights* pairs, const QuantizedActivations& act, int64_t row, int64_t k,
               OUT* out, int64_t n) {
  const int64_t groups = k / kGroup;
  constexpr int kParts = scale_rows(HALVES, MINS);
  constexpr int kPartCols = HALVES ? 16 : 32;
  alignas(64) int32_t sums[4][kAmxRows * 16];
  alignas(64) float acc[RB][PB][kAmxRows * 16];
  const int8_t* a0 = act.codes.data() + row * k;
  const int8_t* a1 = a0 + kAmxRows * k;
  for (int64_t g = 0; g < groups; ++g) {
    for (int part = 0; part < (HALVES ? 2 : 1); ++part) {
      const int64_t cols = g * kGroup + part * kPartCols;
      const int64_t step = (g * kSteps + part * kPartCols / 4) * 64;
      _tile_loadd(4, a0 + cols, k);
      if constexpr (RB == 2) _tile_loadd(5, a1 + cols, k);
      _tile_loadd(6, pairs[0].steps.data() + step, 64);
      if constexpr (PB == 2) _tile_loadd(7, pairs[1].steps.data() + step, 64);
      _tile_zero(0);
      _tile_dpbssd(0, 4, 6);
      if constexpr (PB == 2) {
        _tile_zero(1);
        _tile_dpbssd(1, 4, 7);
      }
      if constexpr (RB == 2) {
        _tile_zero(2);
        _tile_dpbssd(2, 5, 6);
      }
      if constexpr (RB == 2 && PB == 2) {
        _tile_zero(3);
        _tile_dpbssd(3, 5, 7);
      }
      _tile_stored(0, sums[0], 64);
      if constexpr (PB == 2) _tile_stored(1, sums[1], 64);
      if constexpr (RB == 2) _tile_stored(2, sums[2], 64);
      if constexpr (RB == 2 && PB == 2) _tile_stored(3, sums[3], 64);
      // d of this part, and m after the last part (MINS 2: after each, its own)
      const bool with_min = MINS == 2 || (MINS == 1 && part == (HALVES ? 1 : 0));
      const int m_part = MINS == 2 ? 2 + part : kParts - 1;
      for (int rb = 0; rb < RB; ++rb) {
        const int64_t first_row = row + rb * kAmxRows;
        const float* da = act.scale.data() + first_row * groups;
        const float* sa = MINS == 2 ? act.half_sum.data() + 2 * (first_row * groups + g) + part
                                    : act.sum.data() + first_row * groups + g;
        const int64_t sa_stride = MINS == 2 ? 2 * groups : groups;
        for (int pb = 0; pb < PB; ++pb) {
          const float* scales = pairs[pb].scales.data() + g * kParts * 16;
          amx_epilogue(sums[2 * rb + pb], scales + part * 16,
                       with_min ? scales + m_part * 16 : nullptr, da, sa, sa_stride, groups, g,
                       g == 0 && part == 0, acc[rb][pb]);
        }
      }
    }
  }
  for (int rb = 0; rb < RB; ++rb) {
    for (int pb = 0; pb < PB; ++pb) {
      for (int i = 0; i < kAmxRows; ++i) {
        prefixgate::f8 low, high;
        std::memcpy(&low, acc[rb][pb] + 16 * i, sizeof low);
        std::memcpy(&high, acc[rb][pb] + 16 * i + 8, sizeof high);
        OUT* dst = out + (row + rb * kAmxRows + i) * n + pb * 2 * kTile;
        prefixgate::store8(dst, low);
        prefixgate::store8(dst + kTile, high);
      }
    }
  }
}

// Rows [first, last) (a multiple of 16) times the pairs of tiles of units [begin, end) that
// are whole pairs: two pairs and two row blocks at a time, what is left one by one.
template <int BITS, bool HALVES, int MINS, typename OUT>
void amx_rows(const LayoutSpan<BITS, HALVES, MINS>& base, int64_t tiles, int64_t begin,
              int64_t end, const QuantizedActivations& act, int64_t first, int64_t last,
              int64_t k, OUT* out, int64_t n) {
  const int64_t groups = k / kGroup;
  PairWeights pairs[2];
  for (int64_t u = begin; u < end;) {
    const int64_t t = u * kTileBlock;
    if (t + kTileBlock > tiles) break;  // the odd last tile: block_dot's
    const bool two = u + 1 < end && t + 2 * kTileBlock <= tiles;
    prepare_pair<BITS, HALVES, MINS>(base.unit(u, groups), groups, pairs[0]);
    if (two) prepare_pair<BITS, HALVES, MINS>(base.unit(u + 1, groups), groups, pairs[1]);
    OUT* block_out = out + t * kTile;
    for (int64_t row = first; row < last;) {
      const bool tall = row + 2 * kAmxRows <= last;
      if (tall && two) {
        amx_block<2, 2, HALVES, MINS>(pairs, act, row, k, block_out, n);
      } else if (tall) {
        amx_block<2, 1, HALVES, MINS>(pairs, act, row, k, block_out, n);
      } else if (two) {
        amx_block<1, 2, HALVES, MINS>(pairs, act, row, k, block_out, n);
      } else {
        amx_block<1, 1, HALVES, MINS>(pairs, act, row, k, block_out, n);
      }
      row += tall ? 2 * kAmxRows : kAmxRows;
    }
    u += two ? 2 : 1;
  }
}
#endif

// Whether a call of `rows` activation rows takes the AMX tiles for its blocks of 16.
inline bool amx_serves(int64_t rows) {
#if PREFIXGATE_QMM_AMX
  return rows >= kAmxRows && amx_ready();
#else
  (void)rows;
  return false;
#endif
}

template <int BITS, bool HALVES, int MINS, typename OUT>
void quant_matmul_impl(const QuantizedActivations& act, const uint8_t* codes,
                       const void* scales, ScaleForm form, const at::Half* factors,
                       int64_t rows, int64_t n, int64_t k, OUT* out) {
  const int64_t groups = k / kGroup;
  constexpr int kScaleRows = scale_rows(HALVES, MINS);
  const int64_t tiles = n / kTile;
  // A chunk is whole register blocks of the path that computes it, at least one: chunks of
  // kRowBlock rows cut the 512-bit path's blocks of 8 short where K is large (at K = 8192,
  // 2 rows for 6- and 8-bit codes: a Llama 3.2 1B's Q6_K ffn_down at 80 rows ran at ~85 G
  // multiply-adds/s on Zen 4, ~180 in blocks of 8; its activations then come from L2).
#if PREFIXGATE_QMM_WIDE
  constexpr int64_t kChunkBlock = kWideRows;
#else
  constexpr int64_t kChunkBlock = kRowBlock<BITS>;
#endif
  const int64_t chunk =
      std::max<int64_t>(kChunkBlock, kChunkBytes / k / kChunkBlock * kChunkBlock);
  // parallel over blocks of kTileBlock tiles (the last may be short)
  const int64_t units = (tiles + kTileBlock - 1) / kTileBlock;
  // Rows [0, tile_rows) of every full pair of tiles go to the AMX tiles where they serve.
  const int64_t tile_rows = amx_serves(rows) ? rows / kAmxRows * kAmxRows : 0;
  const TileSpan<BITS, kScaleRows> base{codes, scales, form, factors};
  const int64_t unit_bytes =
      kTileBlock * groups *
      (kTile * kGroup * code_chunks(BITS) / 8 + kScaleRows * kTile * base.scale_bytes());
  const int64_t block_units = std::max<int64_t>(1, kWeightBlockBytes / unit_bytes);
  at::parallel_for(0, units, 4, [&](int64_t begin, int64_t end) {
#if PREFIXGATE_QMM_AMX
    if (tile_rows > 0) {
      const AmxConfig config(HALVES ? kGroup / 2 : kGroup);
      _tile_loadconfig(&config);
      for (int64_t first = 0; first < tile_rows; first += kAmxChunkRows)
        amx_rows<BITS, HALVES, MINS>(base, tiles, begin, end, act, first,
                                    std::min(tile_rows, first + kAmxChunkRows), k, out, n);
      _tile_release();
    }
#endif
    for (int64_t block = begin; block < end; block += block_units) {
      for (int64_t first = 0; first < rows; first += chunk) {
        const int64_t last = std::min(rows, first + chunk);
        for (int64_t u = block; u < std::min(end, block + block_units); ++u) {
          const int64_t t = u * kTileBlock;
          if (t + kTileBlock <= tiles && last <= tile_rows) continue;  // the tiles did these
          const auto span = base.unit(u, groups);
          OUT* block_out = out + t * kTile;
          if (t + kTileBlock <= tiles) {
            rows_dot<BITS, kTileBlock, HALVES, MINS>(span, act, std::max(first, tile_rows), last,
                                                     k, block_out, n);
          } else {
            rows_dot<BITS, 1, HALVES, MINS>(span, act, first, last, k, block_out, n);
          }
        }
      }
    }
  });
}

// f(halves, mins), each a compile-time constant: the scale-row layouts there are.
template <typename F>
void with_rows(bool halves, int64_t mins, const F& f) {
  using std::integral_constant;
  if (halves && mins == 2) {
    f(std::true_type{}, integral_constant<int, 2>{});
  } else if (halves && mins == 1) {
    f(std::true_type{}, integral_constant<int, 1>{});
  } else if (halves) {
    f(std::true_type{}, integral_constant<int, 0>{});
  } else if (mins == 1) {
    f(std::false_type{}, integral_constant<int, 1>{});
  } else {
    f(std::false_type{}, integral_constant<int, 0>{});
  }
}

// f(bits), a compile-time constant: the code widths there are.
template <typename F>
void with_width(int64_t bits, const F& f) {
  if (bits == 4) {
    f(std::integral_constant<int, 4>{});
  } else if (bits == 5) {
    f(std::integral_constant<int, 5>{});
  } else if (bits == 6) {
    f(std::integral_constant<int, 6>{});
  } else if (bits == kLevels) {
    f(std::integral_constant<int, kLevels>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

// The product for weights of one code width, whichever their scale rows.
template <int BITS, typename OUT>
void matmul_width(const QuantizedActivations& act, const uint8_t* codes, const void* scales,
                  ScaleForm form, const at::Half* factors, bool halves, int64_t mins,
                  int64_t rows, int64_t n, int64_t k, OUT* out) {
  with_rows(halves, mins, [&](auto halves_tag, auto mins_tag) {
    quant_matmul_impl<BITS, decltype(halves_tag)::value, decltype(mins_tag)::value>(
        act, codes, scales, form, factors, rows, n, k, out);
  });
}

// matmul_width's instances for one width, both output dtypes: declared `extern` here for every
// width, defined (an empty PREFIX) in the source that compiles that width.
#define PREFIXGATE_QMM_WIDTH(PREFIX, BITS)                                                      \
  PREFIX template void matmul_width<BITS, float>(                                              \
      const QuantizedActivations&, const uint8_t*, const void*, ScaleForm, const at::Half*,    \
      bool, int64_t, int64_t, int64_t, int64_t, float*);                                       \
  PREFIX template void matmul_width<BITS, c10::BFloat16>(                                      \
      const QuantizedActivations&, const uint8_t*, const void*, ScaleForm, const at::Half*,    \
      bool, int64_t, int64_t, int64_t, int64_t, c10::BFloat16*);

PREFIXGATE_QMM_WIDTH(extern, 4)
PREFIXGATE_QMM_WIDTH(extern, 5)
PREFIXGATE_QMM_WIDTH(extern, 6)
PREFIXGATE_QMM_WIDTH(extern, 8)
PREFIXGATE_QMM_WIDTH(extern, kLevels)

}  // namespace prefixgate::qmm
