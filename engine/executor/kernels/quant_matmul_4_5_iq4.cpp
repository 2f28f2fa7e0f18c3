// quant_matmul's kernel for 4- and 5-bit codes and IQ4 level indices (quant_matmul_kernel.h):
// the code widths share two sources, so that a cold build compiles them side by side.

#include "quant_matmul_kernel.h"

namespace prefixgate::qmm {
PREFIXGATE_QMM_WIDTH(, 4)
PREFIXGATE_QMM_WIDTH(, 5)
PREFIXGATE_QMM_WIDTH(, kLevels)
}  // namespace prefixgate::qmm
