// Eight-float vectors shared by the CPU kernels: one AVX2 register, half an AVX-512 one. GCC /
// clang vector types, so the same source compiles to either instruction set under -march.
// Every loop runs eight lanes at a time with a scalar tail; the scalar forms here are the
// lanes' exact equivalents.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__F16C__) || defined(__FMA__) || defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace prefixgate {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 8;

// x in every lane (`f8{} + x` is an addition the compiler may not drop: 0 + -0 is +0).
inline f8 splat8(float x) { return f8{x, x, x, x, x, x, x, x}; }

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f8 load8(const c10::BFloat16* p) {  // bf16 -> float is a 16-bit shift
#if defined(__AVX2__)
  // One zero-extension and a shift: GCC spells the generic form below as two 128-bit halves.
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_slli_epi32(wide, 16);
  f8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#else
  h8 h;
  std::memcpy(&h, p, sizeof h);
  const u8 bits = __builtin_convertvector(h, u8) << 16;
  f8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

// float -> bf16 bits, round to nearest even (NaN stays NaN), as c10::BFloat16 rounds.
inline u8 bf16_bits(f8 v) {
  u8 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u8 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  return v != v ? u8{} + 0x7FC0u : rounded;
}

// float16 <-> float: one instruction each with F16C (every AVX2 CPU has it), else c10's.
inline f8 load8(const c10::Half* p) {
#if defined(__F16C__)
  const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  f8 out;
  std::memcpy(&out, &v, sizeof out);
  return out;
#else
  f8 out;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

inline void store8(c10::Half* p, f8 v) {
#if defined(__F16C__)
  __m256 in;
  std::memcpy(&in, &v, sizeof in);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(in, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int i = 0; i < 8; ++i) p[i] = static_cast<c10::Half>(v[i]);
#endif
}

inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }

// a * b + c, rounded once, lane by lane. Spelled out: the kernels build with
// -ffp-contract=off, so no expression is fused in one place and not in another (a result must
// not depend on which code path, or which vector lane, computed it).
inline f8 fma8(f8 a, f8 b, f8 c) {
#if defined(__FMA__)
  __m256 x, y, z;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  std::memcpy(&z, &c, sizeof z);
  const __m256 r = _mm256_fmadd_ps(x, y, z);
  f8 out;
  std::memcpy(&out, &r, sizeof out);
  return out;
#else
  f8 out;
  for (int i = 0; i < 8; ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
#endif
}

inline void store8(c10::BFloat16* p, f8 v) {
  const h8 h = __builtin_convertvector(bf16_bits(v), h8);
  std::memcpy(p, &h, sizeof h);
}

// The value a float takes once stored as T and read back: what torch holds between two ops.
template <typename T>
inline f8 round8(f8 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const u8 bits = bf16_bits(v) << 16;
    f8 out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
}

template <typename T>
inline float round1(float x) {
  return static_cast<float>(static_cast<T>(x));
}


// Lane-wise loops at a width: `Lanes8` (an f8: AVX2's register) everywhere, `Lanes16` (one
// AVX-512 register) where the build has AVX-512. Where every lane runs its own chain of
// operations (a score's FMAs over the dims, a dim's FMAs over the keys), the width only says
// how many chains share an instruction: a lane's bits are the same at either width.
struct Lanes8 {
  using V = f8;
  using I = i8;
  static constexpr int64_t kWidth = 8;
  static constexpr int kParts = 2;  // vectors a value pass holds per accumulator (16 registers)
  static V load(const float* p) { return load8(p); }
  static void store(float* p, V v) { store8(p, v); }
  static V splat(float x) { return splat8(x); }
  static V fma(V a, V b, V c) { return fma8(a, b, c); }
  static f8 octet(V v, int) { return v; }  // lanes 8i..8i+7 as an f8: the vector itself
};

#if defined(__AVX512F__)
typedef float f16x __attribute__((vector_size(64)));
typedef int32_t i16x __attribute__((vector_size(64)));

struct Lanes16 {
  using V = f16x;
  using I = i16x;
  static constexpr int64_t kWidth = 16;
  static constexpr int kParts = 4;  // 6 x 4 accumulators, 4 values, 1 weight: 29 of 32
  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
  static V splat(float x) {
    const __m512 r = _mm512_set1_ps(x);
    V v;
    std::memcpy(&v, &r, sizeof v);
    return v;
  }
  // lanes 8i..8i+7 (i = 0, 1) as an f8
  static f8 octet(V v, int i) {
    f8 out;
    std::memcpy(&out, reinterpret_cast<const float*>(&v) + 8 * i, sizeof out);
    return out;
  }
  static V fma(V a, V b, V c) {  // rounded once per lane, as fma8
    __m512 x, y, z;
    std::memcpy(&x, &a, sizeof x);
    std::memcpy(&y, &b, sizeof y);
    std::memcpy(&z, &c, sizeof z);
    const __m512 r = _mm512_fmadd_ps(x, y, z);
    V out;
    std::memcpy(&out, &r, sizeof out);
    return out;
  }
};
using WideLanes = Lanes16;
#else
using WideLanes = Lanes8;
#endif

// f(std::integral_constant<int, n>{}) for 0 < n < MAX, nothing otherwise: the rows a blocked
// loop leaves after its full blocks of MAX, taken as a compile-time count.
template <int MAX, typename F>
inline void with_count(int64_t n, const F& f) {
  if constexpr (MAX > 1) {
    if (n == MAX - 1) {
      f(std::integral_constant<int, MAX - 1>{});
    } else {
      with_count<MAX - 1>(n, f);
    }
  }
}

// 2^f for f in [-0.5, 0.5], highest power first: exp_lanes' polynomial, and the attention tile
// path's (which takes it in FMAs).
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f,
                                9.618437357674640e-3f, 5.550332471162809e-2f,
                                2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};

// exp(x) of N vectors of L's width, in place, as 2^k * 2^f (f in [-0.5, 0.5], degree-6
// polynomial, relative error ~2e-7); x clamped to [-87, 88], where float's exp is finite and
// normal. glibc's expf is scalar: SwiGLU over a 100-token prefill spent 6x torch's time in it.
// Each step runs across the N vectors before the next: a lane's operations (and bits) are the
// same for any N and either width, and N > 1 puts independent chains side by side. One
// vector's ~25 dependent operations (~70 cycles) at a time, the out-of-order window overlapped
// ~3 of them: a softmax over 128 scores took ~2.5 cycles an exp on Zen 3, ~18% of a prefill's
// attention.
template <typename L, int N>
inline void exp_lanes(typename L::V (&x)[N]) {
  using V = typename L::V;
  using I = typename L::I;
  const V lo = V{} - 87.f, hi = V{} + 88.f;
  V f[N], p[N];
  I k[N];
  for (int n = 0; n < N; ++n) {
    x[n] = x[n] < lo ? lo : x[n];
    x[n] = x[n] > hi ? hi : x[n];
    const V t = x[n] * 1.44269504088896341f;  // log2(e)
    const V half = t < 0 ? V{} - 0.5f : V{} + 0.5f;
    k[n] = __builtin_convertvector(t + half, I);  // round to nearest (ties away)
    f[n] = t - __builtin_convertvector(k[n], V);
  }
  for (int n = 0; n < N; ++n) p[n] = V{} + kExp2Poly[0];
  for (int c = 1; c < 7; ++c)
    for (int n = 0; n < N; ++n) p[n] = p[n] * f[n] + kExp2Poly[c];
  for (int n = 0; n < N; ++n) {
    I bits;
    std::memcpy(&bits, &p[n], sizeof bits);
    bits += k[n] << 23;
    std::memcpy(&x[n], &bits, sizeof bits);
  }
}

template <int N>
inline void exp8n(f8 (&x)[N]) {
  exp_lanes<Lanes8, N>(x);
}

inline f8 exp8(f8 x) {
  f8 one[1] = {x};
  exp8n(one);
  return one[0];
}

inline float exp1(float x) { return exp8(splat8(x))[0]; }

// dst[i * stride + j] = src[j][i] for i, j < 8: eight rows of 8 floats as eight columns.
inline void transpose8(const float* const* src, float* dst, int64_t stride) {
#if defined(__AVX__)
  __m256 r[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src[j]);
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(dst + 0 * stride, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + 1 * stride, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * stride, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * stride, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * stride, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * stride, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * stride, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * stride, _mm256_permute2f128_ps(u3, u7, 0x31));
#else
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 8; ++j) dst[i * stride + j] = src[j][i];
#endif
}

#if defined(__AMX_TILE__)
// AMX's tile configuration, palette 1, as LDTILECFG reads it: each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int tile_rows, int row_bytes) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    colsb[tile] = static_cast<uint16_t>(row_bytes);
  }
};

// Linux hands a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); where it refuses (an older kernel, a hypervisor that hides it) the kernels take
// their vector paths. Asked once, for every thread of the process.
inline bool amx_ready() {
  static const bool ready = [] {
    constexpr long kReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
}
#endif

}  // namespace prefixgate
