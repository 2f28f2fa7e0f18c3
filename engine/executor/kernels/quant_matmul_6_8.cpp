// quant_matmul's kernel for 6- and 8-bit codes (quant_matmul_kernel.h): the code widths share
// two sources, so that a cold build compiles them side by side.

#include "quant_matmul_kernel.h"

namespace prefixgate::qmm {
PREFIXGATE_QMM_WIDTH(, 6)
PREFIXGATE_QMM_WIDTH(, 8)
}  // namespace prefixgate::qmm
