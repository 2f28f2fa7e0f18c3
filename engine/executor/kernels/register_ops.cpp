// torch.ops.prefixgate: every kernel's schema and its CPU implementation, in one source so
// that only this one pays for <torch/library.h> (see ops.h). The implementations live in
// layer_ops.cpp, paged_attention.cpp, quant_matmul.cpp and sampling_ops.cpp.

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(prefixgate, m) {
  using namespace prefixgate::ops;
  // layer_ops.cpp
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.def(
      "rope_and_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) k_cache, "
      "Tensor(c!) v_cache, Tensor slot_mapping, int num_heads) -> ()");
  // paged_attention.cpp
  m.def(
      "attention_plan(Tensor block_tables, Tensor seq_rows, Tensor positions, int block_size, "
      "int window=0) -> (Tensor, Tensor, Tensor)");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_rows, Tensor positions, Tensor items, Tensor members, Tensor part_start, "
      "float scale, int window=0) -> Tensor");
  m.def("attention_path() -> str", &attention_path);
  // quant_matmul.cpp
  m.def(
      "quant_matmul(Tensor x, Tensor codes, Tensor scales, int bits, int n, Tensor? factors=None, "
      "bool halves=False, bool float_out=False) -> Tensor");
  m.def(
      "dequantize_rows(Tensor codes, Tensor scales, int bits, int n, Tensor rows, "
      "Tensor? factors=None, bool halves=False) -> Tensor");
  m.def("quant_matmul_path() -> str", &quant_matmul_path);
  // sampling_ops.cpp
  m.def("argmax_rows(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixgate, CPU, m) {
  using namespace prefixgate::ops;
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rope_and_cache", &rope_and_cache);
  m.impl("paged_attention", &paged_attention);
  m.impl("quant_matmul", &quant_matmul);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("argmax_rows", &argmax_rows);
}

// Registered as it was beside the attention kernel; it reads CPU index tensors in place.
TORCH_LIBRARY_IMPL(prefixgate, CompositeExplicitAutograd, m) {
  m.impl("attention_plan", &prefixgate::ops::attention_plan);
}
