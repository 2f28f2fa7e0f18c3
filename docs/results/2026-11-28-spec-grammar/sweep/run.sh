#!/bin/bash
cd /work/main
OUT=/tmp/sw/res
mkdir -p $OUT
run() { local label=$1 flags=$2
  rm -rf /tmp/sw/kv-$label
  SYSTEMS=registry LABEL=$label SWEEP=3,4,5,6 BENCH_FLAGS="--num-requests 120" PREFIXGATE_FLAGS="$flags --kv-snapshot-dir /tmp/sw/kv-$label" tools/compare_servers.sh $OUT sweep > $OUT/driver$label.txt 2>&1
}
date -u > $OUT/times.txt
run -on-r1 ""; date -u >> $OUT/times.txt
run -off-r1 "--speculative off"; date -u >> $OUT/times.txt
run -on-r2 ""; date -u >> $OUT/times.txt
echo done >> $OUT/times.txt
