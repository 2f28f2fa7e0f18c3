// Decode attention over the paged KV cache, read in place through each sequence's block
// table: no gather of the context into a contiguous copy (which cost as much as the attention
// itself), one pass over K and one over V per chunk of a sequence, every query head of a GQA
// group served by the same read. float32 accumulation, bf16 or float32 storage; head_dim a
// multiple of 8.
//
// Registered as torch.ops.prefixgate.paged_decode_attention; parallel over (sequence, chunk
// of 128 tokens) on torch's own thread pool. Compiled at run time by engine/kernels/__init__.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using prefixgate::dot;
using prefixgate::exp1;

// A row as float32 (n a multiple of 8): float32 storage is read in place, bf16 widened into
// `buffer`.
inline const float* float_row(const float* src, float*, int64_t) { return src; }

inline const float* float_row(const c10::BFloat16* src, float* buffer, int64_t n) {
  for (int64_t d = 0; d < n; d += 8) prefixgate::store8(buffer + d, prefixgate::load8(src + d));
  return buffer;
}

// Tokens of one work item: a sequence's context is cut into chunks attended separately and
// merged by their log-sum-exp (split-K, "flash decoding"), so one long sequence keeps every
// thread busy. A multiple of any block size up to 128.
constexpr int64_t kChunkTokens = 128;

// HEAD_DIM > 0 fixes the row length at compile time (fully unrolled, vectorized loops);
// 0 reads it at run time.
template <typename T, int64_t HEAD_DIM>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
            at::Tensor& out, at::Tensor& lse) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1);
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t block_stride = k_cache.stride(0), token_stride = k_cache.stride(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_cache.data_ptr<T>();
  const T* v_ptr = v_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  float* lse_ptr = lse.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t chunk = std::max<int64_t>(block_size, kChunkTokens / block_size * block_size);
  int64_t max_len = 0;
  for (int64_t i = 0; i < num_seqs; ++i) max_len = std::max(max_len, lens[i]);
  const int64_t num_chunks = (max_len + chunk - 1) / chunk;
  // An item is one chunk of one sequence, all its KV heads: the chunk's token rows (every KV
  // head side by side) are then read front to back, one sequential stream per pass, which the
  // hardware prefetcher follows; an item per KV head read a third of each row and stalled.
  const int64_t num_items = num_seqs * num_chunks;
  // Per item and query head: the unnormalized output, then the running max and sum.
  std::vector<float> part_acc(num_items * num_heads * head_dim);
  std::vector<float> part_max(num_items * num_heads), part_sum(num_items * num_heads);

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(num_heads * head_dim), row(head_dim), probs(num_heads * chunk);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_chunks;
      const int64_t start = item % num_chunks * chunk;
      const int64_t len = std::min(chunk, lens[seq] - start);
      float* acc = part_acc.data() + item * num_heads * head_dim;
      std::fill(acc, acc + num_heads * head_dim, 0.f);
      if (len <= 0) {  // past this sequence's end: an empty part
        std::fill(part_max.begin() + item * num_heads, part_max.begin() + (item + 1) * num_heads,
                  -std::numeric_limits<float>::infinity());
        std::fill(part_sum.begin() + item * num_heads, part_sum.begin() + (item + 1) * num_heads,
                  0.f);
        continue;
      }
      const int64_t* table = tables + seq * max_blocks + start / block_size;
      const float* q_row = float_row(q_ptr + seq * num_heads * head_dim, qf.data(), qf.size());
      for (size_t i = 0; i < qf.size(); ++i) qf[i] = q_row[i] * fscale;
      // Pass 1: every key's score, for every query head. Walked block by block: a division
      // per token cost more than the arithmetic.
      for (int64_t b = 0, t = 0; t < len; ++b) {
        const T* block = k_ptr + table[b] * block_stride;
        for (int64_t i = 0; i < block_size && t < len; ++i, ++t) {
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            const float* r = float_row(block + i * token_stride + h * head_dim, row.data(), head_dim);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t head = h * group + g;
              const float* __restrict qg = qf.data() + head * head_dim;
              probs[head * chunk + t] = dot(qg, r, head_dim);
            }
          }
        }
      }
      // Softmax numerators per query head, with their max and sum for the merge.
      for (int64_t head = 0; head < num_heads; ++head) {
        float* __restrict p = probs.data() + head * chunk;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, p[t]);
        prefixgate::f8 sums{};
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
          const prefixgate::f8 e = prefixgate::exp8(prefixgate::load8(p + t) - m);
          prefixgate::store8(p + t, e);
          sums += e;
        }
        float sum = 0.f;
        for (; t < len; ++t) {
          p[t] = exp1(p[t] - m);
          sum += p[t];
        }
        for (int i = 0; i < 8; ++i) sum += sums[i];
        part_max[item * num_heads + head] = m;
        part_sum[item * num_heads + head] = sum;
      }
      // Pass 2: the numerator-weighted sum of the values.
      for (int64_t b = 0, t = 0; t < len; ++b) {
        const T* block = v_ptr + table[b] * block_stride;
        for (int64_t i = 0; i < block_size && t < len; ++i, ++t) {
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            const float* r = float_row(block + i * token_stride + h * head_dim, row.data(), head_dim);
            for (int64_t g = 0; g < group; ++g) {
              const int64_t head = h * group + g;
              const float w = probs[head * chunk + t];
              float* __restrict a = acc + head * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += w * r[d];
            }
          }
        }
      }
    }
  });

  // Merge each (sequence, query head)'s chunks: out = sum_c acc_c e^(m_c - M) / L.
  at::parallel_for(0, num_seqs * num_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t row_id = begin; row_id < end; ++row_id) {
      const int64_t seq = row_id / num_heads, head = row_id % num_heads;
      const int64_t first = seq * num_chunks;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < num_chunks; ++c)
        m = std::max(m, part_max[(first + c) * num_heads + head]);
      float total = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t item = first + c;
        const float sum = part_sum[item * num_heads + head];
        if (sum == 0.f) continue;
        const float w = exp1(part_max[item * num_heads + head] - m);
        total += sum * w;
        const float* a = part_acc.data() + (item * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += w * a[d];
      }
      T* o = out_ptr + row_id * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(merged[d] / total);
      lse_ptr[row_id] = m + std::log(total);
    }
  });
}

template <typename T>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& context_lens,
                       double scale, at::Tensor& out, at::Tensor& lse) {
  switch (q.size(2)) {
    case 64:
      return decode<T, 64>(q, k_cache, v_cache, block_tables, context_lens, scale, out, lse);
    case 128:
      return decode<T, 128>(q, k_cache, v_cache, block_tables, context_lens, scale, out, lse);
    default:
      return decode<T, 0>(q, k_cache, v_cache, block_tables, context_lens, scale, out, lse);
  }
}

std::tuple<at::Tensor, at::Tensor> paged_decode_attention(
    const at::Tensor& q,             // [num_seqs, num_heads, head_dim]
    const at::Tensor& k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim]
    const at::Tensor& v_cache,       // same
    const at::Tensor& block_tables,  // [num_seqs, max_blocks] int64
    const at::Tensor& context_lens,  // [num_seqs] int64, each >= 1
    double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type());
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3));
  TORCH_CHECK(k_cache.strides() == v_cache.strides());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  TORCH_CHECK(q.size(2) % 8 == 0, "head_dim must be a multiple of 8");
  const at::Tensor qc = q.contiguous(), tables = block_tables.contiguous(),
                   lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kBFloat16) {
    dispatch_head_dim<c10::BFloat16>(qc, k_cache, v_cache, tables, lens, scale, out, lse);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kFloat, "bfloat16 or float32 only");
    dispatch_head_dim<float>(qc, k_cache, v_cache, tables, lens, scale, out, lse);
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(prefixgate, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
