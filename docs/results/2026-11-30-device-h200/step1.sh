#!/bin/bash
# Device step 1 (carry .dev/scripts .dev/p1): install the wheels the image lacks, stash the
# model's first half, record the machine, build the CPU kernels once (timed), then the CUDA
# tests, the executor tests and the batch-invariance tests. Timeouts add up to ~6 min.
source .dev/scripts/env.sh
stamp "step1 start"
mkdir -p /root/stash && cp .dev/p1/model.part.aa /root/stash/ || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .dev/p1/wheels/*.whl 2>&1 | grep -v WARNING | tail -3
timeout 60 python3 -c "import pydantic, pydantic_core, starlette, sse_starlette, uvicorn, llguidance, gguf, anyio, typing_extensions as t; print('p1 ok: pydantic', pydantic.VERSION, 'starlette', starlette.__version__)" || exit 3
stamp "wheels installed"
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|L2 cache|L3 cache|Thread|^Model:|CPU family"
  grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E "avx512|amx|vnni|avx2|f16c|^fma" | tr '\n' ' '; echo
  timeout 60 python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.cuda.get_device_name())"
  c++ --version | head -1; nproc; echo "git $(cat .dev/scripts/rev.txt)"
} 2>&1 | tee $OUT/machine.txt
stamp "kernel build start"
timeout 170 python3 -c "
import logging, time; from pathlib import Path
logging.basicConfig(level=logging.INFO, format='%(message)s')
from engine.executor.kernels import build_cpu_kernels
t = time.perf_counter(); b = build_cpu_kernels(Path('/tmp/pgcache'))
print('KERNELS', b.describe(), 'first build %.1f s' % (time.perf_counter() - t))
" 2>&1 | tee $OUT/kernel-build.txt | tail -4
stamp "pytest start"
timeout 230 python3 -m pytest -q -p no:cacheprovider --timeout 200 --durations=15 \
  tests/engine/test_cuda.py tests/engine/executor/ tests/engine/test_batch_invariance.py \
  2>&1 | tee $OUT/pytest-device.log | tail -30
gzip -9 $OUT/pytest-device.log
stamp "step1 done"
