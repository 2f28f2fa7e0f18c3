#!/bin/bash
# interleaved: start to /health 200 at the base revision vs HEAD (warm snapshots), shipped prefixes
PY=/work/main/.venv/bin/python
one() {  # dir port extra...
  local dir=$1 port=$2; shift 2
  cd $dir
  local start=$(date +%s.%N)
  $PY -m prefixgate serve --port $port --prefixes prefixes.yaml "$@" > /tmp/snap/ab_$port.log 2>&1 &
  local pid=$!
  until curl -s -o /dev/null -w "%{http_code}" http://127.0.0.1:$port/health 2>/dev/null | grep -q 200; do sleep 0.02; done
  local end=$(date +%s.%N)
  kill -TERM $pid; wait $pid
  echo "$(basename $dir) $(echo "$end - $start" | bc)"
}
mkdir -p /tmp/snap/abkv
for i in 1 2 3; do
  PREFIXGATE_CACHE_DIR=/tmp/basecache one /tmp/base 8771
  one /work/main 8772 --kv-snapshot-dir /tmp/snap/abkv
done
