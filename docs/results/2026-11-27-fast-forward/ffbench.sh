#!/bin/bash
# usage: ffbench.sh OUTDIR ROUND MODE(on|off)
cd /work/main
OUT=$1; R=$2; MODE=$3
FLAG=""; [ "$MODE" = off ] && FLAG="--no-grammar-fast-forward"
mkdir -p $OUT
.venv/bin/python -m prefixgate serve --host 127.0.0.1 --port 8112 --prefixes prefixes.yaml --kv-snapshot-dir /tmp/rs/kv-ff $FLAG > $OUT/server-$MODE-$R.log 2>&1 &
PID=$!
for i in $(seq 1 600); do curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:8112/health 2>/dev/null | grep -q 200 && break; sleep 0.2; done
for c in 1 8; do
  n=20; [ $c = 8 ] && n=48
  .venv/bin/python tools/bench_serving.py --label ff-$MODE-c$c-r$R --workload intent --concurrency $c --num-requests $n --warmup 2 --max-duration 300 --base-url http://127.0.0.1:8112/v1 --extra-body '{"response_format": null}' --out $OUT/ff-$MODE-c$c-r$R.json > $OUT/client-$MODE-c$c-r$R.txt 2>&1
done
curl -s http://127.0.0.1:8112/metrics | grep -E "^prefixgate_forced_tokens_total|^prefixgate_generation_tokens_total" > $OUT/metrics-$MODE-$R.txt
kill $PID; wait $PID
