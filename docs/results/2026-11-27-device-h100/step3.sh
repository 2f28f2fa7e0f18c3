#!/bin/bash
# Device step 3: Ray; a killed replica's replacement timed; single process vs one Ray replica.
source .dev/scripts/env.sh
tar -xJf .dev/p3/ray312.tar.xz -C /tmp/site || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .dev/p3/grpcio_reflection*.whl 2>&1 | tail -1; rm -rf /tmp/site/grpcio_reflection-1.85*; python3 -c "import ray, ray.serve; print('ray', ray.__version__)" || exit 3
F='tok/s\]|it/s\]'
timeout 100 python3 tools/bench_replica_replacement.py --kills 2 --server-flags "--num-threads 4" --out $OUT/replacement/replacement.json 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -8
timeout 125 python3 tools/bench_replicas.py --qps 1 --num-requests 24 --only single-process ray-1-replica \
  --server-flags "--num-threads 8" --out-dir $OUT/replicas 2>&1 | tr "\r" "\n" | grep -v -E "$F" | tail -12
echo "step3 done $(date -u)"
