#!/bin/bash
# Device step 1: stash half the model, install the carried wheels, record the machine, probe
# the TORCH_CHECK crash, run the CUDA tests and the kernel tests (native, AVX2 and portable).
source .dev/scripts/env.sh
mkdir -p /root/stash && cp .dev/p1/model.part.aa /root/stash/ || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .dev/p1/wheels/*.whl 2>&1 | grep -v WARNING | tail -3
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|L2 cache|L3 cache|Thread|^Model:|CPU family"
  grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E "avx512|amx|vnni|avx2|f16c|^fma" | tr '\n' ' '; echo
  python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.cuda.get_device_name())"
  c++ --version | head -1; nproc; git log --oneline -1
} 2>&1 | tee $OUT/machine.txt
timeout 100 python3 .dev/scripts/check_probe.py 2>&1 | tail -12 | tee $OUT/probe.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/executor/test_quantization.py -k rejects_a_layout 2>&1 | tail -3
timeout 330 python3 -m pytest -q -p no:cacheprovider --durations=12 \
  tests/engine/test_cuda.py tests/engine/executor/ tests/engine/test_batch_invariance.py \
  --deselect tests/engine/executor/test_quantization.py::test_the_kernel_rejects_a_layout_it_does_not_know \
  2>&1 | tee $OUT/pytest-device.log | tail -40
echo "step1 done $(date -u)"
