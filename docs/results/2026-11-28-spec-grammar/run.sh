#!/bin/bash
cd /work/main
OUT=/tmp/spg/res2
mkdir -p $OUT
run() { local label=$1 flags=$2 modes=$3
  rm -rf /tmp/spg/kv-$label
  SYSTEMS=registry LABEL=$label PREFIXGATE_FLAGS="$flags --kv-snapshot-dir /tmp/spg/kv-$label" tools/compare_servers.sh $OUT "$modes" > $OUT/driver$label.txt 2>&1
}
# contract/: MODES="contract contract8 copy" (OUT=/tmp/spg/res), 05:53-05:55 UTC
# copyjson/: MODES="copyjson copy" (OUT=/tmp/spg/res2), 05:55-05:58 UTC
# mixed/: MODES="decode multiturn c8" (OUT=/tmp/spg/res3), 05:59-06:03 UTC, 60cf08b
# decode/: MODES="decode decode" (OUT=/tmp/spg/res4), 06:05-06:09 UTC, 3e032a2
MODES="copyjson copy"
date -u > $OUT/times.txt
run -on-r1 "" "$MODES"; date -u >> $OUT/times.txt
run -off-r1 "--speculative off" "$MODES"; date -u >> $OUT/times.txt
run -off-r2 "--speculative off" "$MODES"; date -u >> $OUT/times.txt
run -on-r2 "" "$MODES"; date -u >> $OUT/times.txt
echo done >> $OUT/times.txt
