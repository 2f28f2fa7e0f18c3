// The element-wise glue of a Llama decoder layer, one call each instead of four to six torch
// ops: at batch 1 a step runs 61 RMSNorms, 60 residual adds and 30 SwiGLUs over rows of
// 576-3072 numbers, and torch's per-op cost (10-15 us for a composite rms_norm) was a fifth
// of the step. Arithmetic and rounding follow the torch reference in engine/models/layers.py
// op by op (float32 inside, one rounding to the storage dtype where torch rounds), so bf16
// results differ from it only where float32 sums are ordered differently.
//
//   rms_norm(x, weight, eps)                 weight * round(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm(x, residual, weight, eps)   (rms_norm(residual + x), residual + x)
//   silu_and_mul(gate_up)                    round(silu(gate)) * up, gate_up = [gate | up]
//   gelu_tanh_and_mul(gate_up)               round(gelu_tanh(gate)) * up (GeGLU: Gemma)
//   rope_and_cache(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
//       rotates the q and k heads of qkv in place (rotate-half RoPE over the first cos.size(-1)
//       dims of each head: all of it, or Phi's partial rotary) and writes k and v into the
//       paged cache at their slots
//
// Registered under torch.ops.prefixgate by register_ops.cpp.

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <tuple>
#include <type_traits>

namespace {

using namespace prefixgate;  // NOLINT: the vector helpers of vec.h

// Rows per parallel task: one row is too little work to hand to another thread.
constexpr int64_t kRowsPerTask = 16;

// One row: out = weight * round(h * rsqrt(mean(h^2) + eps)), h = x (+ residual, rounded).
template <typename T>
void norm_row(const T* __restrict x, const T* __restrict residual, const T* __restrict weight,
              int64_t d, float eps, T* __restrict out, T* __restrict sum_out) {
  const int64_t whole = d / kLanes * kLanes;
  f8 squares8{};
  float squares = 0.f;
  if (residual != nullptr) {
    for (int64_t i = 0; i < whole; i += kLanes) {
      const f8 h = round8<T>(load8(x + i) + load8(residual + i));
      store8(sum_out + i, h);
      squares8 += h * h;
    }
    for (int64_t i = whole; i < d; ++i) {
      const float h = round1<T>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
      sum_out[i] = static_cast<T>(h);
      squares += h * h;
    }
    x = sum_out;
  } else {
    for (int64_t i = 0; i < whole; i += kLanes) {
      const f8 h = load8(x + i);
      squares8 += h * h;
    }
    for (int64_t i = whole; i < d; ++i) squares += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  }
  for (int64_t i = 0; i < kLanes; ++i) squares += squares8[i];
  const float r = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < whole; i += kLanes)
    store8(out + i, load8(weight + i) * round8<T>(load8(x + i) * r));
  for (int64_t i = whole; i < d; ++i)
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * round1<T>(static_cast<float>(x[i]) * r));
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
               double eps, at::Tensor& out, at::Tensor* sum_out) {
  const int64_t n = x.size(0), d = x.size(1);
  const T* x_ptr = x.data_ptr<T>();
  const T* r_ptr = residual ? residual->data_ptr<T>() : nullptr;
  const T* w_ptr = weight.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  T* s_ptr = sum_out ? sum_out->data_ptr<T>() : nullptr;
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      norm_row<T>(x_ptr + i * d, r_ptr ? r_ptr + i * d : nullptr, w_ptr, d,
                  static_cast<float>(eps), o_ptr + i * d, s_ptr ? s_ptr + i * d : nullptr);
  };
  if (n <= kRowsPerTask) {
    rows(0, n);
  } else {
    at::parallel_for(0, n, kRowsPerTask, rows);
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "bfloat16 or float32 only");
}

// The activation as gate / (1 + exp(z)): silu's z = -g; tanh-GELU's 0.5 g (1 + tanh(y)) is
// g * sigmoid(2y), y = sqrt(2 / pi) (g + 0.044715 g^3), so z = -g (c1 + c2 g^2).
template <bool GELU>
inline f8 activation_exponent(f8 g) {
  if constexpr (GELU) {
    constexpr float c1 = 1.5957691216057308f;  // 2 sqrt(2 / pi)
    constexpr float c2 = 0.0713548162726009f;  // c1 * 0.044715
    return -(g * (c1 + c2 * g * g));
  } else {
    return -g;
  }
}

template <typename T, bool GELU>
void glu_rows(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t n = gate_up.size(0), inner = out.size(1), whole = inner / kLanes * kLanes;
  const T* in = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * 2 * inner;
      const T* up = gate + inner;
      T* dst = o + r * inner;
      int64_t i = 0;
      for (; i + 4 * kLanes <= whole; i += 4 * kLanes) {  // four exps in flight (vec.h)
        f8 g[4], e[4];
        for (int j = 0; j < 4; ++j) {
          g[j] = load8(gate + i + j * kLanes);
          e[j] = activation_exponent<GELU>(g[j]);
        }
        prefixgate::exp8n(e);
        for (int j = 0; j < 4; ++j)
          store8(dst + i + j * kLanes, round8<T>(g[j] / (1.f + e[j])) * load8(up + i + j * kLanes));
      }
      for (; i < whole; i += kLanes) {
        const f8 g = load8(gate + i);
        store8(dst + i, round8<T>(g / (1.f + exp8(activation_exponent<GELU>(g)))) * load8(up + i));
      }
      for (int64_t i = whole; i < inner; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float z = activation_exponent<GELU>(splat8(g))[0];
        dst[i] = static_cast<T>(round1<T>(g / (1.f + exp1(z))) * static_cast<float>(up[i]));
      }
    }
  };
  if (n <= kRowsPerTask) {
    rows(0, n);
  } else {
    at::parallel_for(0, n, kRowsPerTask, rows);
  }
}

template <bool GELU>
at::Tensor glu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up: a contiguous [rows, 2 * intermediate] tensor");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    glu_rows<c10::BFloat16, GELU>(gate_up, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "bfloat16 or float32 only");
    glu_rows<float, GELU>(gate_up, out);
  }
  return out;
}

// n values into the cache's storage type (rounded to nearest even where it is narrower).
template <typename T, typename KV>
void store_row(const T* src, KV* dst, int64_t n) {
  if constexpr (std::is_same_v<T, KV>) {
    std::copy(src, src + n, dst);
  } else {
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) store8(dst + i, load8(src + i));
    for (; i < n; ++i) dst[i] = static_cast<KV>(static_cast<float>(src[i]));
  }
}

// One token: x * cos + rotate_half(x) * sin over the first `rot` dims of each q and k head
// (the rest pass as they are), rounded as torch rounds each product and the sum; then the k
// and v heads stored at the token's cache slot.
template <typename T, typename KV>
void rope_cache_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                     int64_t num_heads) {
  const int64_t n = qkv.size(0), d = qkv.size(2), rot = cos.size(-1), half = rot / 2;
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t row = qkv.size(1) * d, kv_row = num_kv_heads * d;
  T* x = qkv.data_ptr<T>();
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  KV* k_ptr = k_cache.data_ptr<KV>();
  KV* v_ptr = v_cache.data_ptr<KV>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto rows = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos_ptr + t * rot;
      const T* s = sin_ptr + t * rot;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        T* head = x + t * row + h * d;
        int64_t i = 0;
        for (; i + kLanes <= half; i += kLanes) {
          const f8 x1 = load8(head + i), x2 = load8(head + i + half);
          const f8 c1 = load8(c + i), c2 = load8(c + i + half);
          const f8 s1 = load8(s + i), s2 = load8(s + i + half);
          store8(head + i, round8<T>(x1 * c1) + round8<T>(-x2 * s1));
          store8(head + i + half, round8<T>(x2 * c2) + round8<T>(x1 * s2));
        }
        for (; i < half; ++i) {
          const float x1 = static_cast<float>(head[i]), x2 = static_cast<float>(head[i + half]);
          const float c1 = static_cast<float>(c[i]), c2 = static_cast<float>(c[i + half]);
          const float s1 = static_cast<float>(s[i]), s2 = static_cast<float>(s[i + half]);
          head[i] = static_cast<T>(round1<T>(x1 * c1) + round1<T>(-x2 * s1));
          head[i + half] = static_cast<T>(round1<T>(x2 * c2) + round1<T>(x1 * s2));
        }
      }
      const int64_t offset = slots[t] * kv_row;  // the cache is [blocks * block_size] rows
      const T* k = x + t * row + num_heads * d;
      store_row(k, k_ptr + offset, kv_row);
      store_row(k + kv_row, v_ptr + offset, kv_row);
    }
  };
  if (n <= kRowsPerTask) {
    rows(0, n);
  } else {
    at::parallel_for(0, n, kRowsPerTask, rows);
  }
}

template <typename T>
void rope_cache_typed(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                      int64_t num_heads) {
  switch (k_cache.scalar_type()) {
    case at::kHalf:
      return rope_cache_rows<T, at::Half>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
    case at::kBFloat16:
      return rope_cache_rows<T, c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
    case at::kFloat:
      return rope_cache_rows<T, float>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
    default:
      TORCH_CHECK(false, "rope_and_cache: the cache must be float32, bfloat16 or float16");
  }
}

}  // namespace

namespace prefixgate::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    norm_rows<c10::BFloat16>(x, nullptr, weight, eps, out, nullptr);
  } else {
    norm_rows<float>(x, nullptr, weight, eps, out, nullptr);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous());
  TORCH_CHECK(residual.scalar_type() == x.scalar_type());
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  if (x.scalar_type() == at::kBFloat16) {
    norm_rows<c10::BFloat16>(x, &residual, weight, eps, out, &sum);
  } else {
    norm_rows<float>(x, &residual, weight, eps, out, &sum);
  }
  return {out, sum};
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) { return glu_and_mul<false>(gate_up); }

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) { return glu_and_mul<true>(gate_up); }

void rope_and_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    int64_t num_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "qkv: contiguous [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.size(3) == qkv.size(2));
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * k_cache.size(2), "qkv holds q, k and v heads");
  const int64_t n = qkv.size(0), rot = cos.size(-1);
  TORCH_CHECK(rot % 2 == 0 && rot <= qkv.size(2), "rotary dims: even, at most head_dim");
  for (const at::Tensor* table : {&cos, &sin})
    TORCH_CHECK(table->is_contiguous() && table->numel() == n * rot && table->size(-1) == rot,
                "cos/sin: [tokens, 1, rotary dims]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == n);
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "one dtype for qkv and RoPE");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "one dtype for K and V");
  const at::Tensor slots = slot_mapping.contiguous();
  if (qkv.scalar_type() == at::kBFloat16) {
    rope_cache_typed<c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kFloat, "bfloat16 or float32 only");
    rope_cache_typed<float>(qkv, cos, sin, k_cache, v_cache, slots, num_heads);
  }
}

}  // namespace prefixgate::ops
