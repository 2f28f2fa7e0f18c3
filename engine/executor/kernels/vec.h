// Eight-float vectors shared by the CPU kernels: one AVX2 register, half an AVX-512 one. GCC /
// clang vector types, so the same source compiles to either instruction set under -march.
// Every loop runs eight lanes at a time with a scalar tail; the scalar forms here are the
// lanes' exact equivalents.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace prefixgate {

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 8;

inline f8 load8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f8 load8(const c10::BFloat16* p) {  // bf16 -> float is a 16-bit shift
  h8 h;
  std::memcpy(&h, p, sizeof h);
  const u8 bits = __builtin_convertvector(h, u8) << 16;
  f8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// float -> bf16 bits, round to nearest even (NaN stays NaN), as c10::BFloat16 rounds.
inline u8 bf16_bits(f8 v) {
  u8 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u8 rounded = (bits + (((bits >> 16) & 1u) + 0x7FFFu)) >> 16;
  return v != v ? u8{} + 0x7FC0u : rounded;
}

inline void store8(float* p, f8 v) { std::memcpy(p, &v, sizeof v); }

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

// exp(x), eight at a time, as 2^k * 2^f (f in [-0.5, 0.5], degree-6 polynomial, relative
// error ~2e-7); x clamped to [-87, 88], where float's exp is finite and normal. glibc's expf
// is scalar: SwiGLU over a 100-token prefill spent 6x torch's time in it.
inline f8 exp8(f8 x) {
  const f8 lo = f8{} - 87.f, hi = f8{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const f8 t = x * 1.44269504088896341f;  // log2(e)
  const f8 half = t < 0 ? f8{} - 0.5f : f8{} + 0.5f;
  const i8 k = __builtin_convertvector(t + half, i8);  // round to nearest (ties away)
  const f8 f = t - __builtin_convertvector(k, f8);
  f8 p = f8{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  i8 bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += k << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

inline float exp1(float x) { return exp8(f8{} + x)[0]; }

// a . b for n a multiple of 8, summed as a tree: a plain reduction loop adds the lanes one
// after another (the compiler may not reorder float sums), a 16-add dependency chain per
// key that was most of the decode kernel's time.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  typedef float f4 __attribute__((vector_size(16)));
  f8 even{}, odd{};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    even += load8(a + d) * load8(b + d);
    odd += load8(a + d + 8) * load8(b + d + 8);
  }
  if (d < n) even += load8(a + d) * load8(b + d);
  const f8 s8 = even + odd;
  const f4 s4 =
      __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

}  // namespace prefixgate
