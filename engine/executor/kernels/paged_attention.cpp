// Attention of every query of a step over the paged KV cache, read in place through each
// sequence's block table: prefill spans, suffixes after a cache hit, decodes, recomputes.
//
// Why one kernel: a query's result must not depend on which path computed it (same request,
// same answer, whatever else runs or is cached). Here a query at position p attends to keys
// lo..p (lo = 0, or p - window + 1 in a sliding-window layer) in fixed positional chunks of
// 128 tokens ([0, 128), [128, 256), ...; the chunks before lo's are not read, the keys of
// lo's chunk before lo weigh nothing), each chunk's
// partial softmax computed by the same arithmetic (each score one FMA chain over the dims in
// order, a key per vector lane, against the chunk's keys transposed once per run of tiles; the
// chunk's max, exponentials and sums; value accumulation FMA by FMA in key order), and the
// chunks merged in chunk order. Nothing in that depends on how many queries, sequences or
// shared blocks the call holds: those only decide which queries share one read of a chunk's
// keys (a tile) and how the loops are blocked. Where the CPU multiplies bf16 pairs (AVX512-BF16)
// and queries and cache are bf16, the chunk's scores and weighted values are bf16 pair products
// instead (pair_scores; AMX tile products where the CPU has them, tile_scores): the same
// chunks, softmax and merge, other bits, and then every such call of the machine takes them.
//
//   attention_plan(block_tables, seq_rows, positions, block_size, window)
//       -> (items [I, 3] = (chunk, first member, member count), members [M], part_start [T+1])
//     Once per forward and window (0: none), shared by every layer with that window: query t
//     (sequence row seq_rows[t], position positions[t]) needs chunks lo / 128..p / 128; the
//     queries that read the same blocks for a
//     chunk (one sequence's prefill span; decodes sharing a registry prefix) form tiles of up
//     to 16. part_start: where each query's per-chunk partial results go.
//   paged_attention(q, k_cache, v_cache, block_tables, seq_rows, positions, items, members,
//                   part_start, scale, window) -> out [T, num_heads, head_dim]
//     q [T, num_heads, head_dim] float32 or bf16; caches [num_blocks, block_size, kv_heads,
//     head_dim] float32, bf16 or float16 (widened to float32 on load), head_dim a multiple of
//     8, at most 256. GQA: the query heads of a KV head are blocked together over each read.
//
// Compiled at run time by engine/executor/kernels/__init__.py.

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

// bf16 pair products (VDPBF16PS: AVX512-BF16, Zen 4 and Cooper Lake on; -march=native says so
// at build time), and Intel's AMX tiles over the same layouts where the CPU has them (Sapphire
// Rapids and later; prefixgate::amx_ready at run time).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PREFIXGATE_ATTN_PAIRS 1
#else
#define PREFIXGATE_ATTN_PAIRS 0
#endif
#if PREFIXGATE_ATTN_PAIRS && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PREFIXGATE_ATTN_AMX 1
#else
#define PREFIXGATE_ATTN_AMX 0
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using prefixgate::exp1;
using prefixgate::f8;

constexpr int64_t kChunkTokens = 128;  // keys per partial softmax, at fixed positions
constexpr int64_t kTileQueries = 16;   // queries sharing one read of a chunk
constexpr int64_t kKeyBlock = 16;      // value rows read from L1 by every query head of a tile
constexpr int64_t kMaxGroup = 64;      // query heads per KV head
// A chunk's scores and transposed keys per row: 128 plus room for a last block of lanes
// computed past the chunk (score_keys' blocks of 24, 32 or 64 keys), never read
constexpr int64_t kScoreStride = kChunkTokens + 32;


// A row as float32 (n a multiple of 8): float32 storage is read in place, 16-bit widened into
// `buffer`.
inline const float* float_row(const float* src, float*, int64_t) { return src; }

template <typename S>
inline const float* float_row(const S* src, float* buffer, int64_t n) {
  for (int64_t d = 0; d < n; d += 8) prefixgate::store8(buffer + d, prefixgate::load8(src + d));
  return buffer;
}

// The first key a query at position p attends to: 0, or the window's first.
inline int64_t first_key(int64_t p, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
}

// Scores of NH query heads (sharing a KV head) against the block of keys k0.. (BLOCKS vectors
// of L's width), the keys transposed (key k's dim d at keys_t[d * kScoreStride + k]): a key
// per lane, each score one FMA chain over the dims in order, s = fma(q[d], k[d], s), d = 0,
// 1, ... The chains of a block share every load; no lane depends on another (a scalar loop of
// fmaf gives the same bits, at any width).
template <typename L, int64_t HEAD_DIM, int NH, int BLOCKS>
inline void score_keys(const float* const* q, const float* keys_t, int64_t k0,
                       int64_t head_dim_rt, float* const* out) {
  using V = typename L::V;
  constexpr int64_t kStep = L::kWidth * BLOCKS;
  static_assert((kChunkTokens + kStep - 1) / kStep * kStep <= kScoreStride,
                "a chunk's last block of keys, padding lanes included, must fit kScoreStride");
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  V acc[NH][BLOCKS];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < BLOCKS; ++j) acc[h][j] = V{};
  const float* column = keys_t + k0;
  for (int64_t d = 0; d < head_dim; ++d, column += kScoreStride) {
    V keys[BLOCKS];
    for (int j = 0; j < BLOCKS; ++j) keys[j] = L::load(column + L::kWidth * j);
    for (int h = 0; h < NH; ++h) {
      const V qd = L::splat(q[h][d]);
      for (int j = 0; j < BLOCKS; ++j) acc[h][j] = L::fma(qd, keys[j], acc[h][j]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < BLOCKS; ++j) L::store(out[h] + k0 + L::kWidth * j, acc[h][j]);
}

// acc[h] += weights[h][k] * rows[k][offset..] for k < n, FMA by FMA in key order, for NH
// query heads sharing a KV head: PARTS vectors of L's width at a time, every value load
// serving all NH. A dim's chain is the same whichever pass and width hold it.
template <typename L, int NH, int PARTS>
inline void weigh_dims(const float* const* weights, const float* const* rows, int64_t offset,
                       int64_t n, float* const* acc) {
  using V = typename L::V;
  V sums[NH][PARTS];
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < PARTS; ++j) sums[h][j] = L::load(acc[h] + L::kWidth * j);
  for (int64_t k = 0; k < n; ++k) {
    const float* __restrict r = rows[k] + offset;
    V values[PARTS];
    for (int j = 0; j < PARTS; ++j) values[j] = L::load(r + L::kWidth * j);
    for (int h = 0; h < NH; ++h) {
      const V w = L::splat(weights[h][k]);
      for (int j = 0; j < PARTS; ++j) sums[h][j] = L::fma(w, values[j], sums[h][j]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < PARTS; ++j) L::store(acc[h] + L::kWidth * j, sums[h][j]);
}

// The NQ accumulators of acc (each HEAD_DIM long) against the same n value rows: the widest
// lanes the build has, L::kParts vectors a pass (AVX2: 2 x 8 dims, so NQ = 6 keeps 12 FMA
// chains with the 2 value vectors and one weight in 16 registers; AVX-512: 4 x 16 dims in 32),
// then single vectors, then eight dims.
template <int64_t HEAD_DIM, int NQ>
inline void weigh_values(const float* const* weights, const float* const* rows, int64_t offset,
                         int64_t n, int64_t head_dim_rt, float* const* acc) {
  using W = prefixgate::WideLanes;
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : head_dim_rt;
  int64_t d0 = 0;
  const auto pass = [&](auto lanes, auto parts) {
    using L = decltype(lanes);
    constexpr int kParts = decltype(parts)::value;
    for (; d0 + L::kWidth * kParts <= head_dim; d0 += L::kWidth * kParts) {
      float* part[NQ];
      for (int h = 0; h < NQ; ++h) part[h] = acc[h] + d0;
      weigh_dims<L, NQ, kParts>(weights, rows, offset + d0, n, part);
    }
  };
  pass(W{}, std::integral_constant<int, W::kParts>{});
  pass(W{}, std::integral_constant<int, 1>{});
  pass(prefixgate::Lanes8{}, std::integral_constant<int, 1>{});
}

// `count` query rows (query heads of the tile's members, a KV head's group after group)
// against the same transposed keys, row r over its first n[r] keys. Rows are blocked so that
// each key load serves several: AVX2, three rows over 24 keys (9 chains, 3 keys, a query: 13
// of 16 registers), or two / one over 32; AVX-512, six rows over 64 keys (24 chains, 4 keys, a
// query: 29 of 32), fewer rows over as many. A block runs to its longest row (the extra lanes
// are never read), and which rows share a block changes no score's chain.
template <int64_t HEAD_DIM>
inline void score_rows(const float* const* q, const float* keys_t, const int64_t* n,
                       int64_t head_dim, float* const* out, int64_t count) {
  using W = prefixgate::WideLanes;
  constexpr int kRows = W::kWidth == 8 ? 3 : 6;
  constexpr int kBlocks = W::kWidth == 8 ? 3 : 4;
  constexpr int64_t kStep = W::kWidth * kBlocks;
  const auto longest = [&](int64_t first, int64_t rows) {
    return *std::max_element(n + first, n + first + rows);
  };
  // Key block outside, row blocks inside: a block of keys (head_dim x kStep floats, 6 KB for
  // 64 dims on AVX2) stays in L1 for every row block that reads it, where the chunk's whole
  // transposed keys (40 KB) would be streamed from L2 again for each.
  const int64_t whole = count / kRows * kRows;
  if (whole > 0) {
    const int64_t all = longest(0, whole);
    for (int64_t k0 = 0; k0 < all; k0 += kStep)  // past a row's n: padding lanes, never read
      for (int64_t r = 0; r < whole; r += kRows)
        if (k0 < longest(r, kRows))
          score_keys<W, HEAD_DIM, kRows, kBlocks>(q + r, keys_t, k0, head_dim, out + r);
  }
  const int64_t r = whole;
  const auto rest = [&](auto rows) {
    constexpr int kRest = decltype(rows)::value;
    constexpr int kRestBlocks = kRest <= 2 ? 4 : kBlocks;
    const int64_t last = longest(r, kRest);
    for (int64_t k0 = 0; k0 < last; k0 += W::kWidth * kRestBlocks)
      score_keys<W, HEAD_DIM, kRest, kRestBlocks>(q + r, keys_t, k0, head_dim, out + r);
  };
  prefixgate::with_count<kRows>(count - r, rest);
}

// `count` (weights, accumulator) pairs (query heads of several tile members) over the same
// n value rows, six at a time: which pairs share a pass changes no accumulator's order.
template <int64_t HEAD_DIM>
inline void weigh_heads(const float* const* weights, const float* const* rows, int64_t offset,
                        int64_t n, int64_t head_dim, float* const* acc, int64_t count) {
  int64_t h = 0;
  for (; h + 6 <= count; h += 6)
    weigh_values<HEAD_DIM, 6>(weights + h, rows, offset, n, head_dim, acc + h);
  const auto rest = [&](auto size) {
    weigh_values<HEAD_DIM, decltype(size)::value>(weights + h, rows, offset, n, head_dim,
                                                  acc + h);
  };
  prefixgate::with_count<6>(count - h, rest);
}

// max(s[0..len)): exact whatever the order, so eight lanes at a time.
inline float chunk_max(const float* s, int64_t len) {
  f8 lanes = f8{} - std::numeric_limits<float>::infinity();
  int64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    const f8 x = prefixgate::load8(s + k);
    lanes = x > lanes ? x : lanes;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (int lane = 0; lane < 8; ++lane) m = std::max(m, lanes[lane]);
  for (; k < len; ++k) m = std::max(m, s[k]);
  return m;
}

#if PREFIXGATE_ATTN_PAIRS
// The pair paths: where the CPU multiplies bf16 pairs and both the queries and the cache are
// bf16, scores and the values' weighted sum are bf16 pair products (each pair's two products
// exact, added into float32 lanes) over the same 128-key chunks, the softmax between them and
// the merge as on the vector path: on AMX's tiles (TDPBF16PS) where the CPU has them, else in
// 512-bit vectors (VDPBF16PS: half the multiply-add instructions of float32 FMAs, and the
// keys and values read as bf16, never widened). A query row's scores are its dim pairs in
// order against each key, its weighted sum its bf16 numerators' key pairs in order against
// each value dim (pairs past the row's keys add exact zeros): no row's arithmetic depends on
// which other rows share a tile or a pass, so the invariance holds as on the vector path; the
// bits differ from it (the numerators are rounded to bf16, the scale is applied to the float32
// score) and between the tiles and the vectors (their pairs' sums round differently), so a
// machine keeps one path for every call: the tiles, else the vectors, wherever they serve.

constexpr int64_t kTileRows = 16;  // query rows a tile holds, and a block of rows here

// out[r][n] (r < rows, n < 16 * key_tiles, row stride kScoreStride) = the dot product of query
// row r (q: rows of HEAD_DIM bf16) with key n; keys as tile_scores reads them. Six rows and up
// to 64 keys a pass: 24 float32 chains, four key loads and one broadcast a row per dim pair.
template <int64_t HEAD_DIM, int NR, int NK>
inline void pair_score_block(const uint16_t* q, const uint32_t* keys, float* out) {
  __m512 acc[NR][NK];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NK; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < HEAD_DIM / 2; ++j) {
    __m512bh k[NK];
    for (int b = 0; b < NK; ++b)
      k[b] = (__m512bh)_mm512_loadu_si512(keys + j * kChunkTokens + 16 * b);
    for (int r = 0; r < NR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q + r * HEAD_DIM + 2 * j, 4);
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < NK; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qp, k[b]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NK; ++b) _mm512_storeu_ps(out + r * kScoreStride + 16 * b, acc[r][b]);
}

template <int64_t HEAD_DIM>
void pair_scores(const uint16_t* q, const uint32_t* keys, int64_t key_tiles, float* out,
                 int64_t rows) {
  for (int64_t n0 = 0; n0 < key_tiles; n0 += 4) {
    const auto keys_of = [&](auto nk) {
      constexpr int kNK = decltype(nk)::value;
      int64_t r = 0;
      for (; r + 6 <= rows; r += 6)
        pair_score_block<HEAD_DIM, 6, kNK>(q + r * HEAD_DIM, keys + n0 * 16,
                                           out + r * kScoreStride + n0 * 16);
      prefixgate::with_count<6>(rows - r, [&](auto nr) {
        pair_score_block<HEAD_DIM, decltype(nr)::value, kNK>(q + r * HEAD_DIM, keys + n0 * 16,
                                                             out + r * kScoreStride + n0 * 16);
      });
    };
    prefixgate::with_count<5>(std::min<int64_t>(4, key_tiles - n0), keys_of);
  }
}

// out[r][d] (r < rows, row stride HEAD_DIM) = the sum over key pairs p < pairs of row r's
// numerators of keys 2p, 2p + 1 (probs: bf16, row stride kChunkTokens) times their values'
// dim d (values as tile_values reads them), key pair after key pair. Six rows and 64 dims a
// pass: 24 float32 chains, four value loads and one broadcast a row per key pair.
template <int64_t HEAD_DIM, int NR>
inline void pair_value_block(const uint16_t* probs, const uint32_t* values, int64_t pairs,
                             float* out) {
  for (int64_t d0 = 0; d0 < HEAD_DIM; d0 += 64) {
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh v[4];
      for (int b = 0; b < 4; ++b)
        v[b] = (__m512bh)_mm512_loadu_si512(values + p * HEAD_DIM + d0 + 16 * b);
      for (int r = 0; r < NR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, probs + r * kChunkTokens + 2 * p, 4);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], w, v[b]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int b = 0; b < 4; ++b) _mm512_storeu_ps(out + r * HEAD_DIM + d0 + 16 * b, acc[r][b]);
  }
}

template <int64_t HEAD_DIM>
void pair_values(const uint16_t* probs, const uint32_t* values, int64_t pairs, float* out,
                 int64_t rows) {
  static_assert(HEAD_DIM % 64 == 0, "four vectors of 16 dims a pass");
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6)
    pair_value_block<HEAD_DIM, 6>(probs + r * kChunkTokens, values, pairs, out + r * HEAD_DIM);
  prefixgate::with_count<6>(rows - r, [&](auto nr) {
    pair_value_block<HEAD_DIM, decltype(nr)::value>(probs + r * kChunkTokens, values, pairs,
                                                    out + r * HEAD_DIM);
  });
}
#endif

#if PREFIXGATE_ATTN_AMX
// The tile path (see the pair paths above): a query row's scores are one tile row against the
// chunk's keys, its weighted sum one tile row of bf16 numerators against the chunk's values,
// 32 keys a step in key order.
//
// Tiles 0-3 accumulate (16 rows x 16 float32), 4 holds A (16 rows x 32 bf16), 5-7 B (16 bf16
// pairs x 16 columns); every tile 16 rows of 64 bytes.
struct AttentionTiles : prefixgate::TileConfig {
  AttentionTiles() {
    for (int i = 0; i < 8; ++i) set(i, 16, 64);
  }
};

// out[r][n] (n < 16 * key_tiles, row stride kScoreStride) = the dot product of query row r
// (q: 16 rows of HEAD_DIM bf16) with key n; keys: the chunk's keys as dim pairs, pair j of
// key n at keys[j * kChunkTokens + n]. Four key tiles share each load of A.
template <int64_t HEAD_DIM>
void tile_scores(const uint16_t* q, const uint32_t* keys, int64_t key_tiles, float* out) {
  constexpr int64_t kStride = kChunkTokens * 4;
  for (int64_t n0 = 0; n0 < key_tiles; n0 += 4) {
    const int64_t n = std::min<int64_t>(4, key_tiles - n0);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < HEAD_DIM / 32; ++step) {
      _tile_loadd(4, q + step * 32, HEAD_DIM * 2);
      const uint32_t* b = keys + step * 16 * kChunkTokens + n0 * 16;
      _tile_loadd(5, b, kStride);
      _tile_dpbf16ps(0, 4, 5);
      if (n > 1) {
        _tile_loadd(6, b + 16, kStride);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (n > 2) {
        _tile_loadd(7, b + 32, kStride);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (n > 3) {
        _tile_loadd(5, b + 48, kStride);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    float* o = out + n0 * 16;
    _tile_stored(0, o, kScoreStride * 4);
    if (n > 1) _tile_stored(1, o + 16, kScoreStride * 4);
    if (n > 2) _tile_stored(2, o + 32, kScoreStride * 4);
    if (n > 3) _tile_stored(3, o + 48, kScoreStride * 4);
  }
}

// out[r][d] (row stride HEAD_DIM) = sum over keys k < 32 * key_steps of probs[r][k] (bf16,
// row stride kChunkTokens) times value k's dim d; values: key pairs, pair j's dim d at
// values[j * HEAD_DIM + d]. 32 keys a step, in key order.
template <int64_t HEAD_DIM>
void tile_values(const uint16_t* probs, const uint32_t* values, int64_t key_steps, float* out) {
  static_assert(HEAD_DIM % 64 == 0, "four tiles of 16 dims a pass");
  constexpr int64_t kStride = HEAD_DIM * 4;
  for (int64_t d0 = 0; d0 < HEAD_DIM; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < key_steps; ++step) {
      _tile_loadd(4, probs + step * 32, kChunkTokens * 2);
      const uint32_t* b = values + step * 16 * HEAD_DIM + d0;
      _tile_loadd(5, b, kStride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + 16, kStride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 32, kStride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 48, kStride);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, out + d0, kStride);
    _tile_stored(1, out + d0 + 16, kStride);
    _tile_stored(2, out + d0 + 32, kStride);
    _tile_stored(3, out + d0 + 48, kStride);
  }
}

#endif

#if PREFIXGATE_ATTN_PAIRS
// s[k] = e^(s[k] - m) for k in [first, last), returning their sum (16 lanes, then a fixed
// tree): the pair paths' own exponentials, 2^n * 2^f with f's polynomial (vec.h's
// kExp2Poly) in FMAs and the power by VSCALEFPS, ten operations a vector where exp_lanes
// takes ~25: with the products on the tiles, the softmax was most of the time left. Lanes
// past `last` are neither read nor written.
inline float pair_exponentials(float* s, int64_t first, int64_t last, float m) {
  const __m512 max = _mm512_set1_ps(m), floor = _mm512_set1_ps(-87.f);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = first; k < last; k += 16) {
    const __mmask16 mask =
        last - k >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (last - k)) - 1u);
    const __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + k), max), floor);
    const __m512 t = _mm512_mul_ps(x, log2e);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(prefixgate::kExp2Poly[0]);
    for (int c = 1; c < 7; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(prefixgate::kExp2Poly[c]));
    const __m512 e = _mm512_maskz_mov_ps(mask, _mm512_scalef_ps(p, n));
    _mm512_mask_storeu_ps(s + k, mask, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// 16 bf16 as their float32 bit patterns shifted into place: `high` puts them in the upper half.
inline __m512i widen16(const c10::BFloat16* p, bool high) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return high ? _mm512_slli_epi32(w, 16) : w;
}
#endif

// The plan's items cut into one contiguous run per thread, of about equal estimated work
// (bounds[j]..bounds[j + 1] is run j). Counting items was not enough: a decode batch's plan
// lists its shared chunks first, each an item of every member's query heads, then one small
// item per member for its own last chunk, so the first thread took every shared chunk and the
// other waited at the barrier (8 decodes sharing a prefix: two threads 1.2x one). An item's
// work is its keys times its rows (the members' query heads; the tiles' rows rounded up to a
// whole tile) plus the chunk's layout, about kLayoutRows rows a KV head. Which thread runs an
// item changes none of its arithmetic, so the bits are the same for any cut; runs stay
// contiguous so that a chunk's consecutive tiles still reuse one layout.
std::vector<int64_t> balanced_runs(const int64_t* item_ptr, int64_t num_items,
                                   const int64_t* member_ptr, const int64_t* pos,
                                   int64_t num_heads, int64_t num_kv_heads, bool tiles) {
  constexpr int64_t kLayoutRows = 2;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  std::vector<int64_t> bounds{0};
  if (threads == 1) {
    bounds.push_back(num_items);
    return bounds;
  }
  const int64_t group = num_heads / num_kv_heads, round = tiles ? 16 : 1;
  std::vector<double> done(num_items + 1, 0.0);  // work of the items before each
  for (int64_t item = 0; item < num_items; ++item) {
    const int64_t start = item_ptr[3 * item] * kChunkTokens, count = item_ptr[3 * item + 2];
    const int64_t* tile = member_ptr + item_ptr[3 * item + 1];
    int64_t keys = 0;
    for (int64_t i = 0; i < count; ++i)
      keys = std::max(keys, std::min(kChunkTokens, pos[tile[i]] + 1 - start));
    const int64_t rows = (count * group + round - 1) / round * round + kLayoutRows;
    done[item + 1] = done[item] + static_cast<double>(keys * rows * num_kv_heads);
  }
  for (int64_t j = 1; j < threads; ++j) {
    const double target = done[num_items] * static_cast<double>(j) / static_cast<double>(threads);
    int64_t cut = std::lower_bound(done.begin(), done.end(), target) - done.begin();
    // the nearer of the two item boundaries around the target, never behind the last cut
    if (cut > 0 && target - done[cut - 1] < done[cut] - target) --cut;
    bounds.push_back(std::clamp(cut, bounds.back(), num_items));
  }
  bounds.push_back(num_items);
  return bounds;
}

// HEAD_DIM > 0 fixes the row length at compile time (unrolled loops); 0 reads it at run time.
template <typename T, typename KV, int64_t HEAD_DIM>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_rows,
            const at::Tensor& positions, const at::Tensor& items, const at::Tensor& members,
            const at::Tensor& part_start, double scale, int64_t window, at::Tensor& out) {
  const int64_t num_queries = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, cols = block_tables.size(1);
  const int64_t block_stride = k_cache.stride(0), token_stride = k_cache.stride(1);
  const T* q_ptr = q.data_ptr<T>();
  const KV* k_ptr = k_cache.data_ptr<KV>();
  const KV* v_ptr = v_cache.data_ptr<KV>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* rows = seq_rows.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* item_ptr = items.data_ptr<int64_t>();
  const int64_t* member_ptr = members.data_ptr<int64_t>();
  const int64_t* starts = part_start.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t num_parts = starts[num_queries];
  // Per (query, chunk) and query head: the unnormalized output, the chunk's max and sum.
  // Kept between calls (a 100-token prefill's are ~2 MB: freshly allocated, each layer paid
  // its page faults); every entry a call reads, it wrote.
  static thread_local std::vector<float> parts;
  const size_t needed = num_parts * num_heads * (head_dim + 2);
  if (parts.size() < needed) parts.resize(needed);
  float* part_acc = parts.data();
  float* part_max = part_acc + num_parts * num_heads * head_dim;
  float* part_sum = part_max + num_parts * num_heads;

  // A pair path where it serves (see pair_scores): on the tiles where the CPU has them, else
  // in vectors; otherwise the vector path.
  constexpr bool pairs = PREFIXGATE_ATTN_PAIRS && std::is_same_v<T, c10::BFloat16> &&
                         std::is_same_v<KV, c10::BFloat16> && HEAD_DIM > 0 &&
                         HEAD_DIM % 64 == 0;
#if PREFIXGATE_ATTN_AMX
  const bool tiles = pairs && prefixgate::amx_ready();
#else
  constexpr bool tiles = false;
#endif

  const std::vector<int64_t> runs = balanced_runs(item_ptr, items.size(0), member_ptr, pos,
                                                  num_heads, num_kv_heads, tiles);
  const auto attend_items = [&](int64_t begin, int64_t end) {
    if (begin == end) return;
    const int64_t q_row = num_heads * head_dim, kv_row = num_kv_heads * head_dim;
    // Consecutive items of one chunk (the plan lists a chunk's tiles together) reuse its keys
    // and values as the last item laid them out (transposed, widened or paired): the same
    // blocks, and at least as many keys. A 77-token suffix after a registry hit is 5 tiles a
    // chunk: the vector path widened and transposed each chunk 5 times.
    int64_t laid_chunk = -1, laid_keys = 0;
    static thread_local std::vector<int64_t> laid_blocks;  // its capacity kept between calls
#if PREFIXGATE_ATTN_PAIRS
    // The pair paths' buffers: queries per KV head [kv_heads][rows][HEAD_DIM] bf16, the
    // chunk's keys as dim pairs [kv_heads][HEAD_DIM / 2][kChunkTokens], its values as key
    // pairs [kv_heads][kChunkTokens / 2][HEAD_DIM], one KV head's numerators [rows]
    // [kChunkTokens] bf16, and one block of 16 rows' results.
    static thread_local std::vector<uint32_t> tile_scratch;
    const int64_t tile_rows = (kTileQueries * group + kTileRows - 1) / kTileRows * kTileRows;
    uint16_t* tq = nullptr;
    uint32_t *tkeys = nullptr, *tvalues = nullptr;
    uint16_t* tprobs = nullptr;
    float* block_out = nullptr;
    if (pairs) {
      const size_t q_words = num_kv_heads * tile_rows * head_dim / 2;
      const size_t kv_words = num_kv_heads * head_dim / 2 * kChunkTokens;
      const size_t p_words = tile_rows * kChunkTokens / 2;
      const size_t out_words = kTileRows * std::max<int64_t>(kScoreStride, head_dim);
      const size_t words = q_words + 2 * kv_words + p_words + out_words + 16;
      if (tile_scratch.size() < words) tile_scratch.resize(words);
      tq = reinterpret_cast<uint16_t*>(tile_scratch.data());
      tkeys = tile_scratch.data() + q_words;
      tvalues = tkeys + kv_words;
      tprobs = reinterpret_cast<uint16_t*>(tvalues + kv_words);
      block_out = reinterpret_cast<float*>(tvalues + kv_words + p_words);
#if PREFIXGATE_ATTN_AMX
      if (tiles) {
        const AttentionTiles config;
        _tile_loadconfig(&config);
      }
#endif
    }
#endif
    // Per-thread scratch, kept between calls (not allocated and zeroed per layer): the
    // tile's scaled queries, its scores, and for 16-bit storage the chunk's K and V rows
    // widened once for every member and head.
    static thread_local std::vector<float> scratch;
    const size_t probs_size = kTileQueries * num_heads * kScoreStride;
    const size_t widened_size = std::is_same_v<KV, float> ? 0 : kChunkTokens * kv_row;
    const size_t keys_size = num_kv_heads * head_dim * kScoreStride;
    const size_t total = kTileQueries * q_row + probs_size + keys_size + 8 * kv_row + widened_size;
    if (scratch.size() < total) scratch.resize(total);
    float* const qf = scratch.data();
    float* const probs = qf + kTileQueries * q_row;
    float* const keys_t = probs + probs_size;  // [kv_heads, head_dim, kScoreStride]
    float* const widened_keys = keys_t + keys_size;  // 8 key rows on their way to keys_t
    [[maybe_unused]] float* const widened = widened_keys + 8 * kv_row;
    const float* value_rows[kChunkTokens];
    int64_t len[kTileQueries];
    int64_t skip[kTileQueries];  // the chunk's keys before the member's window: weigh nothing
    int64_t part_of[kTileQueries];  // where the member's partial result for this chunk goes
    const float* pv_weights[kTileQueries * kMaxGroup];
    float* pv_acc[kTileQueries * kMaxGroup];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item_ptr[3 * item], count = item_ptr[3 * item + 2];
      const int64_t* tile = member_ptr + item_ptr[3 * item + 1];
      const int64_t start = chunk * kChunkTokens;
      int64_t longest = 0;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t t = tile[i];
        len[i] = std::min(kChunkTokens, pos[t] + 1 - start);
        const int64_t lo = first_key(pos[t], window);
        skip[i] = std::max<int64_t>(0, lo - start);
        part_of[i] = starts[t] + chunk - lo / kChunkTokens;
        longest = std::max(longest, len[i]);
        if (pairs) continue;
        const float* src = float_row(q_ptr + t * q_row, qf + i * q_row, q_row);
        for (int64_t j = 0; j < q_row; ++j) qf[i * q_row + j] = src[j] * fscale;
      }
      // Every tile member reads these blocks for this chunk (the plan's grouping key).
      const int64_t* table = tables + rows[tile[0]] * cols;
      const auto cache_offset = [&](int64_t k) {
        const int64_t p = start + k;
        return table[p / block_size] * block_stride + p % block_size * token_stride;
      };
      // This chunk's keys and values in place from the item before (see laid_chunk)?
      const int64_t* first_block = table + start / block_size;
      const int64_t num_blocks = (start + longest - 1) / block_size - start / block_size + 1;
      const bool laid_out = chunk == laid_chunk && longest <= laid_keys &&
                            std::equal(first_block, first_block + num_blocks, laid_blocks.begin());
      if (!laid_out) {
        laid_chunk = chunk;
        laid_keys = longest;
        laid_blocks.assign(first_block, first_block + num_blocks);
      }
#if PREFIXGATE_ATTN_PAIRS
      if constexpr (pairs) {
        const int64_t key_tiles = (longest + 15) / 16, rows_per_head = count * group;
        const int64_t padded_rows = (rows_per_head + kTileRows - 1) / kTileRows * kTileRows;
        const uint16_t* q_bits = reinterpret_cast<const uint16_t*>(q_ptr);
        // B: the keys' dim pairs transposed, 8 keys x 8 pairs at a time, every KV head of
        // those 8 keys before the next 8 (past the last key: it again, as on the vector path;
        // those scores are never read). Key rows in the order they lie in memory: one KV
        // head's slice of each row (a 1 KB stride for the 1B) crosses a page every few rows,
        // where the hardware's stride prefetcher stops, and read chunk by chunk that way the
        // cache gave ~9 GB/s; whole rows in order stream.
        for (int64_t k0 = 0; k0 < (laid_out ? 0 : key_tiles * 16); k0 += 8) {
          const c10::BFloat16* key_rows[8];
          for (int64_t j = 0; j < 8; ++j)
            key_rows[j] = k_ptr + cache_offset(std::min(k0 + j, longest - 1));
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            uint32_t* kb = tkeys + h * HEAD_DIM / 2 * kChunkTokens;
            for (int64_t pair = 0; pair < HEAD_DIM / 2; pair += 8) {
              const float* src[8];
              for (int j = 0; j < 8; ++j)
                src[j] = reinterpret_cast<const float*>(key_rows[j] + h * HEAD_DIM) + pair;
              prefixgate::transpose8(src, reinterpret_cast<float*>(kb + pair * kChunkTokens + k0),
                                     kChunkTokens);
            }
          }
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          // A: the members' query heads of this KV head (then, for the tiles, zero rows to a
          // whole tile)
          uint16_t* qa = tq + h * tile_rows * HEAD_DIM;
          for (int64_t i = 0, r = 0; i < count; ++i)
            for (int64_t g = 0; g < group; ++g, ++r)
              std::memcpy(qa + r * HEAD_DIM, q_bits + tile[i] * q_row + (h * group + g) * HEAD_DIM,
                          HEAD_DIM * 2);
          if (tiles)  // the vector pairs read the rows there are
            std::fill(qa + rows_per_head * HEAD_DIM, qa + padded_rows * HEAD_DIM, uint16_t{0});
          const uint32_t* kb = tkeys + h * HEAD_DIM / 2 * kChunkTokens;
          for (int64_t rb = 0; rb < padded_rows; rb += kTileRows) {
#if PREFIXGATE_ATTN_AMX
            if (tiles) {
              tile_scores<HEAD_DIM>(qa + rb * HEAD_DIM, kb, key_tiles, block_out);
            } else
#endif
            {
              pair_scores<HEAD_DIM>(qa + rb * HEAD_DIM, kb, key_tiles, block_out,
                                    std::min(kTileRows, rows_per_head - rb));
            }
            const __m512 scale16 = _mm512_set1_ps(fscale);
            for (int64_t r = rb; r < std::min(rows_per_head, rb + kTileRows); ++r) {
              const int64_t i = r / group, head = h * group + r % group;
              float* dst = probs + (i * num_heads + head) * kScoreStride;
              const float* src = block_out + (r - rb) * kScoreStride;
              for (int64_t k = 0; k < key_tiles * 16; k += 16)
                _mm512_storeu_ps(dst + k, _mm512_mul_ps(_mm512_loadu_ps(src + k), scale16));
            }
          }
        }
      }
#endif
      if (!pairs) {
      // Keys transposed (a key per lane: [kv_head][dim][key]), 8 keys at a time; values as
      // rows (widened once where stored in 16 bits); not again where the item before laid
      // them out. The lanes past this item's keys then hold the chunk's later keys instead of
      // the last key repeated: their scores are never read either way.
      for (int64_t k0 = 0; k0 < (laid_out ? 0 : longest); k0 += 8) {
        const float* group_keys[8];
        for (int64_t j = 0; j < 8; ++j) {
          const int64_t p = start + std::min(k0 + j, longest - 1);  // pad: repeat a key
          const int64_t offset =
              table[p / block_size] * block_stride + p % block_size * token_stride;
          group_keys[j] = float_row(k_ptr + offset, widened_keys + j * kv_row, kv_row);
        }
        for (int64_t h = 0; h < num_kv_heads; ++h)
          for (int64_t d = 0; d < head_dim; d += 8) {
            const float* src[8];
            for (int j = 0; j < 8; ++j) src[j] = group_keys[j] + h * head_dim + d;
            prefixgate::transpose8(src, keys_t + (h * head_dim + d) * kScoreStride + k0,
                                   kScoreStride);
          }
      }
      for (int64_t k = 0; k < (laid_out ? 0 : longest); ++k) {
        const int64_t offset = cache_offset(k);
        if constexpr (std::is_same_v<KV, float>) {
          value_rows[k] = v_ptr + offset;
        } else {
          value_rows[k] = float_row(v_ptr + offset, widened + k * kv_row, kv_row);
        }
      }
      // Scores: every member's query heads of a KV head against the transposed keys.
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float* q_rows[kTileQueries * kMaxGroup];
        float* out_rows[kTileQueries * kMaxGroup];
        int64_t row_len[kTileQueries * kMaxGroup];
        int64_t num_rows = 0;
        for (int64_t i = 0; i < count; ++i) {
          for (int64_t g = 0; g < group; ++g, ++num_rows) {
            const int64_t head = h * group + g;
            q_rows[num_rows] = qf + i * q_row + head * head_dim;
            out_rows[num_rows] = probs + (i * num_heads + head) * kScoreStride;
            row_len[num_rows] = len[i];
          }
        }
        score_rows<HEAD_DIM>(q_rows, keys_t + h * head_dim * kScoreStride, row_len, head_dim,
                             out_rows, num_rows);
      }
      }  // the vector path's scores
      // Softmax numerators per (member, head), with the chunk's max and sum.
      for (int64_t i = 0; i < count; ++i) {
        const int64_t part = part_of[i];
        for (int64_t head = 0; head < num_heads; ++head) {
          float* __restrict s = probs + (i * num_heads + head) * kScoreStride;
          std::fill(s, s + skip[i], 0.f);  // outside the window: weight 0 in the values' sum
          float m = chunk_max(s + skip[i], len[i] - skip[i]);
#if PREFIXGATE_ATTN_PAIRS
          if (pairs) {  // no accumulator to clear: the pair paths write it whole
            part_max[part * num_heads + head] = m;
            part_sum[part * num_heads + head] = pair_exponentials(s, skip[i], len[i], m);
            continue;
          }
#endif
          f8 sums{};
          int64_t k = skip[i];
          // Eight vectors of the widest lanes at a time, then 32 keys (vec.h: exp_lanes): the
          // same exponentials lane for lane at any width, and the sum takes them eight at a
          // time in key order. Eight independent chains hide the ~25 dependent operations of
          // one vector's exponential (two left it latency-bound at ~3 cycles an exponential).
          using W = prefixgate::WideLanes;
          const auto exponentials = [&](auto vectors) {
            constexpr int kVectors = decltype(vectors)::value;
            constexpr int64_t kSpan = kVectors * W::kWidth;
            for (; k + kSpan <= len[i]; k += kSpan) {
              typename W::V e[kVectors];
              for (int j = 0; j < kVectors; ++j) e[j] = W::load(s + k + W::kWidth * j) - m;
              prefixgate::exp_lanes<W, kVectors>(e);
              for (int j = 0; j < kVectors; ++j) {
                W::store(s + k + W::kWidth * j, e[j]);
                for (int o = 0; o < W::kWidth / 8; ++o) sums += W::octet(e[j], o);
              }
            }
          };
          exponentials(std::integral_constant<int, 8>{});
          exponentials(std::integral_constant<int, 32 / W::kWidth>{});
          for (; k + 8 <= len[i]; k += 8) {
            const f8 e = prefixgate::exp8(prefixgate::load8(s + k) - m);
            prefixgate::store8(s + k, e);
            sums += e;
          }
          float sum = 0.f;
          for (; k < len[i]; ++k) {
            s[k] = exp1(s[k] - m);
            sum += s[k];
          }
          for (int lane = 0; lane < 8; ++lane) sum += sums[lane];
          part_max[part * num_heads + head] = m;
          part_sum[part * num_heads + head] = sum;
          // cleared in vectors: std::fill's memset of 256 bytes was a `rep stos`, ~4% of
          // this loop
          float* acc = part_acc + (part * num_heads + head) * head_dim;
          for (int64_t d = 0; d < head_dim; d += 8) prefixgate::store8(acc + d, f8{});
        }
      }
#if PREFIXGATE_ATTN_PAIRS
      if constexpr (pairs) {
        const int64_t key_steps = (longest + 31) / 32, rows_per_head = count * group;
        const int64_t padded_rows = (rows_per_head + kTileRows - 1) / kTileRows * kTileRows;
        // B: values as key pairs (dim d of keys 2j, 2j + 1 in one 32-bit word), every KV
        // head of a key pair before the next (rows in memory order, as the keys); past the
        // laying item's last key, zeros (the tiles read whole steps of 32 keys, the vector
        // pairs the keys there are). An item that reuses the layout may have fewer keys: its
        // numerators past them are zeros, which weigh the later keys' values by nothing
        const int64_t value_pairs = tiles ? key_steps * 16 : (longest + 1) / 2;
        for (int64_t pair = 0; pair < (laid_out ? 0 : value_pairs); ++pair) {
          const int64_t k = 2 * pair;
          const c10::BFloat16* even = k < longest ? v_ptr + cache_offset(k) : nullptr;
          const c10::BFloat16* odd = k + 1 < longest ? v_ptr + cache_offset(k + 1) : nullptr;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            uint32_t* vb = tvalues + h * (kChunkTokens / 2) * HEAD_DIM;
            for (int64_t d = 0; d < HEAD_DIM; d += 16) {
              const __m512i lo =
                  even ? widen16(even + h * HEAD_DIM + d, false) : _mm512_setzero_si512();
              const __m512i hi =
                  odd ? widen16(odd + h * HEAD_DIM + d, true) : _mm512_setzero_si512();
              _mm512_storeu_si512(vb + pair * HEAD_DIM + d, _mm512_or_si512(lo, hi));
            }
          }
        }
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const uint32_t* vb = tvalues + h * (kChunkTokens / 2) * HEAD_DIM;
          // A: each row's numerators in bf16, zero past its keys
          for (int64_t i = 0, r = 0; i < count; ++i) {
            for (int64_t g = 0; g < group; ++g, ++r) {
              const float* src = probs + (i * num_heads + h * group + g) * kScoreStride;
              uint16_t* dst = tprobs + r * kChunkTokens;
              for (int64_t k = 0; k < key_steps * 32; k += 16) {
                const int64_t live = std::clamp<int64_t>(len[i] - k, 0, 16);
                const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
                const __m256bh bf = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k),
                                    (__m256i)bf);
              }
            }
          }
          if (tiles)
            std::fill(tprobs + rows_per_head * kChunkTokens, tprobs + padded_rows * kChunkTokens,
                      uint16_t{0});
          for (int64_t rb = 0; rb < padded_rows; rb += kTileRows) {
#if PREFIXGATE_ATTN_AMX
            if (tiles) {
              tile_values<HEAD_DIM>(tprobs + rb * kChunkTokens, vb, key_steps, block_out);
            } else
#endif
            {
              pair_values<HEAD_DIM>(tprobs + rb * kChunkTokens, vb, (longest + 1) / 2, block_out,
                                    std::min(kTileRows, rows_per_head - rb));
            }
            for (int64_t r = rb; r < std::min(rows_per_head, rb + kTileRows); ++r) {
              const int64_t i = r / group, head = h * group + r % group;
              std::memcpy(part_acc + (part_of[i] * num_heads + head) * HEAD_DIM,
                          block_out + (r - rb) * HEAD_DIM, HEAD_DIM * 4);
            }
          }
        }
        continue;
      }
#endif
      // The numerator-weighted sum of the values, in key order, 16 value rows at a time for
      // every member (they stay in L1 meanwhile); the query heads of the members that read
      // as many of the 16 (all but the diagonal chunk's) share each pass over them.
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t kb = 0; kb < longest; kb += kKeyBlock) {
          for (int64_t i = 0; i < count;) {
            const int64_t n = std::min(kKeyBlock, len[i] - kb);
            int64_t pairs = 0;
            for (; i < count && std::min(kKeyBlock, len[i] - kb) == n; ++i) {
              if (n <= 0) continue;
              const int64_t part = part_of[i];
              for (int64_t g = 0; g < group; ++g, ++pairs) {
                const int64_t head = h * group + g;
                pv_weights[pairs] = probs + (i * num_heads + head) * kScoreStride + kb;
                pv_acc[pairs] = part_acc + (part * num_heads + head) * head_dim;
              }
            }
            if (n > 0)
              weigh_heads<HEAD_DIM>(pv_weights, value_rows + kb, h * head_dim, n, head_dim,
                                    pv_acc, pairs);
          }
        }
      }
    }
#if PREFIXGATE_ATTN_AMX
    if (tiles) _tile_release();
#endif
  };
  at::parallel_for(0, static_cast<int64_t>(runs.size()) - 1, 1, [&](int64_t first, int64_t last) {
    attend_items(runs[first], runs[last]);
  });

  // Merge each (query, head)'s chunks in chunk order: out = sum_c acc_c e^(m_c - M) / L.
  at::parallel_for(0, num_queries * num_heads, 1, [&](int64_t begin, int64_t end) {
    float merged[256];
    for (int64_t id = begin; id < end; ++id) {
      const int64_t t = id / num_heads, head = id % num_heads;
      const int64_t first = starts[t], chunks = starts[t + 1] - first;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part_max[(first + c) * num_heads + head]);
      float total = 0.f;
      std::fill(merged, merged + head_dim, 0.f);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t part = (first + c) * num_heads + head;
        const float w = exp1(part_max[part] - m);
        total += part_sum[part] * w;
        const float* a = part_acc + part * head_dim;
        const f8 w8 = prefixgate::splat8(w);
        for (int64_t d = 0; d < head_dim; d += 8)
          prefixgate::store8(merged + d, prefixgate::fma8(w8, prefixgate::load8(a + d),
                                                                 prefixgate::load8(merged + d)));
      }
      T* o = out_ptr + id * head_dim;
      const f8 inverse = prefixgate::splat8(1.f / total);
      for (int64_t d = 0; d < head_dim; d += 8)
        prefixgate::store8(o + d, prefixgate::load8(merged + d) * inverse);
    }
  });
}

template <typename T, typename KV>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& pos,
                       const at::Tensor& items, const at::Tensor& members,
                       const at::Tensor& starts, double scale, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 64:
      return attend<T, KV, 64>(q, k_cache, v_cache, tables, rows, pos, items, members, starts,
                               scale, window, out);
    case 128:
      return attend<T, KV, 128>(q, k_cache, v_cache, tables, rows, pos, items, members, starts,
                                scale, window, out);
    case 256:  // Gemma 3
      return attend<T, KV, 256>(q, k_cache, v_cache, tables, rows, pos, items, members, starts,
                                scale, window, out);
    default:
      return attend<T, KV, 0>(q, k_cache, v_cache, tables, rows, pos, items, members, starts,
                              scale, window, out);
  }
}

template <typename T>
void dispatch_cache_dtype(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& tables,
                          const at::Tensor& rows, const at::Tensor& pos, const at::Tensor& items,
                          const at::Tensor& members, const at::Tensor& starts, double scale,
                          int64_t window, at::Tensor& out) {
  switch (k_cache.scalar_type()) {
    case at::kHalf:
      return dispatch_head_dim<T, at::Half>(q, k_cache, v_cache, tables, rows, pos, items,
                                            members, starts, scale, window, out);
    case at::kBFloat16:
      return dispatch_head_dim<T, c10::BFloat16>(q, k_cache, v_cache, tables, rows, pos, items,
                                                 members, starts, scale, window, out);
    case at::kFloat:
      return dispatch_head_dim<T, float>(q, k_cache, v_cache, tables, rows, pos, items, members,
                                         starts, scale, window, out);
    default:
      TORCH_CHECK(false, "paged_attention: KV cache must be float32, bfloat16 or float16");
  }
}

}  // namespace

namespace prefixgate::ops {

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_plan(const at::Tensor& block_tables,
                                                              const at::Tensor& seq_rows,
                                                              const at::Tensor& positions,
                                                              int64_t block_size,
                                                              int64_t window) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong);
  TORCH_CHECK(seq_rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong);
  TORCH_CHECK(seq_rows.numel() == positions.numel() && block_size > 0 && window >= 0);
  const at::Tensor tables = block_tables.contiguous(), rows = seq_rows.contiguous(),
                   pos = positions.contiguous();
  const int64_t num_queries = pos.numel(), num_rows = tables.size(0), cols = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* p = pos.data_ptr<int64_t>();
  // Blocks each sequence row holds this step: entries past them may be stale.
  std::vector<int64_t> used(num_rows, 0);
  for (int64_t t = 0; t < num_queries; ++t) {
    TORCH_CHECK(row[t] >= 0 && row[t] < num_rows && p[t] >= 0, "bad sequence row or position");
    used[row[t]] = std::max(used[row[t]], p[t] / block_size + 1);
  }
  for (int64_t r = 0; r < num_rows; ++r) TORCH_CHECK(used[r] <= cols, "block table too short");
  at::Tensor part_start = at::empty({num_queries + 1}, pos.options());
  int64_t* starts = part_start.data_ptr<int64_t>();
  starts[0] = 0;
  // (chunk, the chunk's block ids) -> the queries reading them, in query order
  std::map<std::vector<int64_t>, std::vector<int64_t>> readers;
  std::vector<const std::vector<int64_t>*> order;
  std::vector<int64_t> key;
  for (int64_t t = 0; t < num_queries; ++t) {
    const int64_t first_chunk = first_key(p[t], window) / kChunkTokens;
    const int64_t chunks = p[t] / kChunkTokens + 1;
    starts[t + 1] = starts[t] + chunks - first_chunk;
    for (int64_t c = first_chunk; c < chunks; ++c) {
      const int64_t first = c * kChunkTokens / block_size;
      const int64_t last = std::min(((c + 1) * kChunkTokens + block_size - 1) / block_size,
                                    used[row[t]]);
      key.assign(1, c);
      key.insert(key.end(), table + row[t] * cols + first, table + row[t] * cols + last);
      auto [it, fresh] = readers.try_emplace(key);
      if (fresh) order.push_back(&it->first);
      it->second.push_back(t);
    }
  }
  std::vector<int64_t> items, members;
  for (const std::vector<int64_t>* k : order) {
    const std::vector<int64_t>& queries = readers[*k];
    // Tiles of 16 in query order, listed last tile first: within a sequence a later query
    // reads at least as many of the chunk's keys, so every tile after the first finds the
    // keys and values it needs already laid out by the one before (attend's laid_chunk).
    const int64_t num_tiles =
        (static_cast<int64_t>(queries.size()) + kTileQueries - 1) / kTileQueries;
    for (int64_t tile = num_tiles - 1; tile >= 0; --tile) {
      const size_t i = tile * kTileQueries;
      const int64_t count = std::min<int64_t>(kTileQueries, queries.size() - i);
      items.insert(items.end(), {(*k)[0], static_cast<int64_t>(members.size()), count});
      members.insert(members.end(), queries.begin() + i, queries.begin() + i + count);
    }
  }
  at::Tensor item_tensor = at::empty({static_cast<int64_t>(items.size() / 3), 3}, pos.options());
  at::Tensor member_tensor = at::empty({static_cast<int64_t>(members.size())}, pos.options());
  std::copy(items.begin(), items.end(), item_tensor.data_ptr<int64_t>());
  std::copy(members.begin(), members.end(), member_tensor.data_ptr<int64_t>());
  return {item_tensor, member_tensor, part_start};
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_rows, const at::Tensor& positions,
                           const at::Tensor& items, const at::Tensor& members,
                           const at::Tensor& part_start, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3));
  TORCH_CHECK(k_cache.strides() == v_cache.strides());
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= kMaxGroup, "at most 64 query heads per KV head");
  TORCH_CHECK(q.size(2) % 8 == 0 && q.size(2) <= 256, "head_dim: a multiple of 8, at most 256");
  TORCH_CHECK(seq_rows.numel() == q.size(0) && positions.numel() == q.size(0));
  TORCH_CHECK(part_start.numel() == q.size(0) + 1 && items.dim() == 2 && items.size(1) == 3);
  TORCH_CHECK(window >= 0, "window: 0 (none) or the keys a query sees");
  for (const at::Tensor* t : {&block_tables, &seq_rows, &positions, &items, &members, &part_start})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "plan tensors: contiguous int64");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_cache_dtype<c10::BFloat16>(qc, k_cache, v_cache, block_tables, seq_rows, positions,
                                        items, members, part_start, scale, window, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_attention: q must be float32 or bfloat16");
    dispatch_cache_dtype<float>(qc, k_cache, v_cache, block_tables, seq_rows, positions, items,
                                members, part_start, scale, window, out);
  }
  return out;
}

// Which path bf16 queries over a bf16 cache take (head_dim a multiple of 64), for the start-up
// line: "amx-bf16" (the tiles), "avx512-bf16" (pair products in vectors) or "vector". Every
// other call takes the vector path.
std::string attention_path() {
#if PREFIXGATE_ATTN_AMX
  if (prefixgate::amx_ready()) return "amx-bf16";
#endif
#if PREFIXGATE_ATTN_PAIRS
  return "avx512-bf16";
#else
  return "vector";
#endif
}

}  // namespace prefixgate::ops
