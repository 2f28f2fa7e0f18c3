#!/bin/bash
# run.sh ARCH: both servers on /tmp/arch/ARCH/ARCH-f32.gguf, errors against the HF model, greedy agreement
A=$1; F=/tmp/arch/$A/$A-f32.gguf
cd /work/main
(exec /work/peers/llama.cpp-build/bin/llama-server -m $F --port 18081 -t 2 -c 2048 > /tmp/arch/$A/llama.log 2>&1) &
(PREFIXGATE_CACHE_DIR=/tmp/arch/cache exec .venv/bin/prefixgate serve --model $F --dtype float32 --port 18082 --max-model-len 2048 > /tmp/arch/$A/pg.log 2>&1) &
sleep 1
LP=$(pgrep -f "llama-server -m $F"); PP=$(pgrep -f "prefixgate serve --model $F")
for i in $(seq 120); do sleep 2; curl -sf 127.0.0.1:18081/health >/dev/null && curl -sf 127.0.0.1:18082/health > /dev/null && break; done
MID=$(curl -s 127.0.0.1:18082/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
cd /tmp/sm3
/work/main/.venv/bin/python ref.py /tmp/arch/$A/hf 18082 $MID 2>&1 | tail -1
/work/main/.venv/bin/python ref.py /tmp/arch/$A/hf 18081 x 2>&1 | tail -1
/work/main/.venv/bin/python agree.py 18082 18081 $MID x | tail -11
kill $LP $PP; sleep 2
