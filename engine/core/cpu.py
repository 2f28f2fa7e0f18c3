"""What this CPU can do, read once at run time: the dtype and kernels depend on it.

Machines of the same kind differ: one has AVX-512 with BF16, the next AVX2 only. Where bf16
has no hardware support torch emulates it and a prefill runs ~3x slower than in float32, while
bf16 decode still wins (it reads half the bytes). So compute runs in bf16 only where the CPU
has it natively, and decode's weights are 4-bit either way (`engine.quantization`).

`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` makes an AVX-512 machine choose as an
AVX2-only one would, which is how the AVX2 path is tested here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # torch's kernel dispatch level: AVX512, AVX2, DEFAULT, ...
    has_avx512_bf16: bool
    has_amx: bool
    has_onednn_bf16: bool  # oneDNN will run bf16 GEMMs natively

    @property
    def has_native_bf16(self) -> bool:
        return (
            self.capability.startswith("AVX512")
            and (self.has_avx512_bf16 or self.has_amx)
            and self.has_onednn_bf16
        )

    def describe(self) -> str:
        extras = [
            name
            for name, on in (("AVX512_BF16", self.has_avx512_bf16), ("AMX", self.has_amx))
            if on
        ]
        native = "native bf16" if self.has_native_bf16 else "no native bf16"
        return f"{self.capability}{'+' + '+'.join(extras) if extras else ''} ({native})"


@cache
def cpu_features() -> CpuFeatures:
    return CpuFeatures(
        capability=torch.backends.cpu.get_cpu_capability(),
        has_avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        has_amx=bool(torch.cpu._is_amx_tile_supported()),
        has_onednn_bf16=bool(
            torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ),
    )


def auto_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA and on CPUs that compute it natively, float32 elsewhere."""
    if device.type != "cpu" or cpu_features().has_native_bf16:
        return torch.bfloat16
    return torch.float32


def auto_kv_dtype(device: torch.device, compute: torch.dtype) -> torch.dtype:
    """The KV cache's storage: 16 bits where they are cheap to widen. bf16 where compute is
    bf16; float16 on CPUs with F16C (torch's AVX2 and AVX-512 levels imply it: one
    instruction widens 8 values), which keeps 3 more mantissa bits than bf16; else the
    compute dtype."""
    if compute != torch.float32 or device.type != "cpu":
        return compute
    return torch.float16 if cpu_features().capability.startswith("AVX") else compute
