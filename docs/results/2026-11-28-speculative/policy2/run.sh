#!/bin/bash
cd /work/main
OUT=/tmp/spb/res2
mkdir -p $OUT
run() { local label=$1 flags=$2 modes=$3
  rm -rf /tmp/spb/kv-$label
  SYSTEMS=registry LABEL=$label PREFIXGATE_FLAGS="$flags --kv-snapshot-dir /tmp/spb/kv-$label" tools/compare_servers.sh $OUT "$modes" > $OUT/driver$label.txt 2>&1
}
MODES="seq c8 copy copy8 multiturn decode contract"
date -u > $OUT/times.txt
run -on-r1 "" "$MODES"; date -u >> $OUT/times.txt
run -off-r1 "--speculative off" "$MODES"; date -u >> $OUT/times.txt
run -off-r2 "--speculative off" "$MODES"; date -u >> $OUT/times.txt
run -on-r2 "" "$MODES"; date -u >> $OUT/times.txt
SYSTEMS=llamacpp LLAMA_ISA=avx512 LLAMA_FLAGS="--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8" tools/compare_servers.sh $OUT "copy" > $OUT/driver-llama-ngram3.txt 2>&1
date -u >> $OUT/times.txt; echo done >> $OUT/times.txt
