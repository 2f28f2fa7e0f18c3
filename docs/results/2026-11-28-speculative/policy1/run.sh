#!/bin/bash
# speculative on/off in turns; then fast-forward off too (contract); then llama.cpp with/without ngram lookup on copy
cd /work/main
OUT=/tmp/spb/res
mkdir -p $OUT
run() { # label flags modes
  local label=$1 flags=$2 modes=$3
  rm -rf /tmp/spb/kv-$label
  SYSTEMS=registry LABEL=$label PREFIXGATE_FLAGS="$flags --kv-snapshot-dir /tmp/spb/kv-$label" tools/compare_servers.sh $OUT "$modes" > $OUT/driver$label.txt 2>&1
  curl -s http://127.0.0.1:8090/metrics > /dev/null 2>&1
}
MODES="contract copy copy8 multiturn decode seq c8"
date -u > $OUT/times.txt
run -on-r1 "" "$MODES"; date -u >> $OUT/times.txt
run -off-r1 "--speculative off" "$MODES"; date -u >> $OUT/times.txt
run -off-r2 "--speculative off" "$MODES"; date -u >> $OUT/times.txt
run -on-r2 "" "$MODES"; date -u >> $OUT/times.txt
run -noff-r1 "--speculative off --no-grammar-fast-forward" "contract"; date -u >> $OUT/times.txt
SYSTEMS=llamacpp LLAMA_ISA=avx512 tools/compare_servers.sh $OUT "copy copy8" > $OUT/driver-llama.txt 2>&1
for f in $OUT/llama.cpp-cache-on-avx512-copy*.json; do mv $f ${f/cache-on/cache-on-nolookup}; done
SYSTEMS=llamacpp LLAMA_ISA=avx512 LLAMA_FLAGS="--spec-type ngram-simple" tools/compare_servers.sh $OUT "copy copy8" > $OUT/driver-llama-ngram.txt 2>&1
date -u >> $OUT/times.txt
echo done >> $OUT/times.txt
