// The sampler's greedy choice over a step's logits rows.
//
// Why: torch's CPU argmax reads one element at a time: over SmolLM2's 49,152-token vocabulary
// it took ~117 us a bf16 row (~55 us float32), ~0.9 ms of a 27 ms decode step at batch 8 and
// ~1.9 ms at 16, more than the step's RMSNorms. Here a row is two vector passes that stay in
// L2: its maximum, then the first index holding it.
//
//   argmax_rows(logits [rows, vocab] float32 | bf16 | float16) -> [rows] int64
//     torch.argmax(logits, dim=-1) exactly: the first index of the row's maximum (-0.0 and
//     +0.0 are equal), and where the row holds a NaN the first NaN's index (torch's max
//     propagates NaN).
//
// Registered under torch.ops.prefixgate by register_ops.cpp.

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using prefixgate::f8;
using prefixgate::i8;

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  constexpr int64_t kLanes = prefixgate::kLanes;
  constexpr int kChains = 4;  // independent maxima: one chain waits on each compare
  const int64_t whole = n / kLanes * kLanes;
  f8 high[kChains];
  i8 nan[kChains];
  for (int c = 0; c < kChains; ++c) {
    high[c] = f8{} - std::numeric_limits<float>::infinity();
    nan[c] = i8{};
  }
  int64_t i = 0;
  for (; i + kChains * kLanes <= whole; i += kChains * kLanes) {
    for (int c = 0; c < kChains; ++c) {
      const f8 v = prefixgate::load8(row + i + c * kLanes);
      nan[c] |= v != v;
      high[c] = v > high[c] ? v : high[c];
    }
  }
  for (; i < whole; i += kLanes) {
    const f8 v = prefixgate::load8(row + i);
    nan[0] |= v != v;
    high[0] = v > high[0] ? v : high[0];
  }
  // The maximum is the same whichever order the lanes are taken in (NaN aside, handled
  // below; -0.0 and +0.0 compare equal in the search after).
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
  for (int c = 0; c < kChains; ++c) {
    for (int lane = 0; lane < kLanes; ++lane) {
      best = std::max(best, high[c][lane]);
      any_nan = any_nan || nan[c][lane] != 0;
    }
  }
  for (i = whole; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    any_nan = any_nan || std::isnan(v);
    best = std::max(best, v);
  }
  if (any_nan) {
    for (i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(row[i]))) return i;
  }
  // The first index equal to the maximum: eight at a time, then the lane.
  const f8 target = f8{} + best;
  for (i = 0; i < whole; i += kLanes) {
    const i8 hit = prefixgate::load8(row + i) == target;
    bool found = false;
    for (int lane = 0; lane < kLanes; ++lane) found = found || hit[lane] != 0;
    if (!found) continue;
    for (int lane = 0; lane < kLanes; ++lane)
      if (hit[lane] != 0) return i + lane;
  }
  for (i = whole; i < n; ++i)
    if (static_cast<float>(row[i]) == best) return i;
  return 0;  // an empty row: torch refuses it before here
}

template <typename T>
void argmax_typed(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* data = logits.data_ptr<T>();
  int64_t* ids = out.data_ptr<int64_t>();
  // A row is ~10 us: one thread takes a few before another is worth waking.
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(data + r * n, n);
  });
}

}  // namespace

namespace prefixgate::ops {

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows: [rows, vocab], vocab > 0");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kFloat: argmax_typed<float>(x, out); break;
    case at::kBFloat16: argmax_typed<c10::BFloat16>(x, out); break;
    case at::kHalf: argmax_typed<c10::Half>(x, out); break;
    default: TORCH_CHECK(false, "argmax_rows: float32, bfloat16 or float16 logits");
  }
  return out;
}

}  // namespace prefixgate::ops
