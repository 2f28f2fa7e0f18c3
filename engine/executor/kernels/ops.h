// The kernels' entry points, one declaration each: every kernel source defines its own and
// register_ops.cpp registers them all under torch.ops.prefixgate (with their schemas).
//
// Why a header instead of registering in each source: <torch/library.h> and <ATen/ATen.h>
// cost a translation unit ~17 s of parsing at -O3 on a 2-core CPU, more than a small
// kernel's own code; with one registering source, the kernels include only the tensor type,
// the parallel loop and the two or three factory functions they call.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace prefixgate::ops {

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up);
void rope_and_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    int64_t num_heads);

// paged_attention.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_plan(const at::Tensor& block_tables,
                                                              const at::Tensor& seq_rows,
                                                              const at::Tensor& positions,
                                                              int64_t block_size, int64_t window);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_rows, const at::Tensor& positions,
                           const at::Tensor& items, const at::Tensor& members,
                           const at::Tensor& part_start, double scale, int64_t window);
std::string attention_path();

// quant_matmul.cpp
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        int64_t bits, int64_t n, const std::optional<at::Tensor>& factors,
                        bool halves, bool float_out);
at::Tensor dequantize_rows(const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                           int64_t n, const at::Tensor& ids,
                           const std::optional<at::Tensor>& factors, bool halves);
std::string quant_matmul_path();

// sampling_ops.cpp
at::Tensor argmax_rows(const at::Tensor& logits);

}  // namespace prefixgate::ops
