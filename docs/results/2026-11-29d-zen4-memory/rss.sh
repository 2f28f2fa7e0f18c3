#!/bin/bash
# usage: rss.sh MODEL PORT [extra flags]; prints VmHWM/VmRSS and smaps_rollup after 3 chat requests
MODEL=$1; PORT=$2; shift 2
cd /work/main
M="--model $MODEL"; [ "$MODEL" = default ] && M=""
(exec .venv/bin/prefixgate serve $M --port $PORT --kv-cache-memory 128MiB "$@" > /tmp/rss-$PORT.log 2>&1) &
sleep 1
PID=$(pgrep -f -- "prefixgate serve.*--port $PORT" | head -1)
for i in $(seq 120); do sleep 1; curl -sf 127.0.0.1:$PORT/health >/dev/null && break; done
MID=$(curl -s 127.0.0.1:$PORT/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
grep -E "VmHWM|VmRSS" /proc/$PID/status | tr '\n' ' '; echo " (ready)"
for i in 1 2 3; do curl -s 127.0.0.1:$PORT/v1/chat/completions -H 'Content-Type: application/json' -d "{\"model\":\"$MID\",\"messages\":[{\"role\":\"user\",\"content\":\"Tell me about the sea number $i\"}],\"max_tokens\":40}" > /dev/null; done
grep -E "VmHWM|VmRSS|RssAnon|RssFile" /proc/$PID/status | tr '\n' ' '; echo
grep -E "^(Rss|Pss_Anon|Pss_File|Anonymous|AnonHugePages)" /proc/$PID/smaps_rollup | tr '\n' ' '; echo
cp /proc/$PID/smaps /tmp/smaps-$PORT.txt
kill $PID; sleep 2
