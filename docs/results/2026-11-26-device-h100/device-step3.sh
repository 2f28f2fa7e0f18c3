#!/bin/bash
# Device step 3: Ray, then bench_replicas (single process vs one Ray Serve replica) on 16 cores.
source .dev/scripts/env.sh
true
tar -xJf .dev/p3/ray312.tar.xz -C /tmp/site || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .dev/p3/grpcio_reflection*.whl 2>&1 | tail -1
python3 -c "import ray, ray.serve; print('ray', ray.__version__)" || exit 3
timeout 540 python3 tools/bench_replicas.py --qps 1 --num-requests 64 --only single-process ray-1-replica \
  --server-flags "--num-threads 8" --out-dir $OUT/replicas 2>&1 | tr "\r" "\n" | grep -v -E "tok/s\]|it/s\]" | tail -40
echo "step3 done $(date -u)"
