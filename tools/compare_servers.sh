#!/usr/bin/env bash
# Side-by-side serving comparison on this machine, one server at a time (they share 2 cores):
# prefixgate with its registry and with --no-prefix-cache, llama.cpp server with its prompt
# cache on and off, transformers serve with continuous batching.
#   tools/compare_servers.sh [OUT_DIR] [MODES]      MODES: "seq c8" (default), "sweep", "decode",
#                                                  "multiturn", "contract" and "contract8" (intent,
#                                                  c1 and c8, with the entry's label schema), "copy", "copy8",
#                                                  "copyjson" (copy, answers as a JSON quote)
# SYSTEMS picks who runs (default "registry nocache llamacpp llamacpp-nocache transformers");
# DTYPE is prefixgate's --dtype (default auto); PREFIXGATE_FLAGS adds flags to its runs; LABEL
# suffixes every result name (two configurations, or two windows of one, kept apart);
# LLAMA_ISA picks the llama.cpp build (native, or avx2: `tools/peers.py build llama-cpp --isa avx2`) and suffixes
# its result names unless native. MODEL (a .gguf file) is served by prefixgate and llama.cpp
# instead of the embedded model, CHAT_TEMPLATE (a Jinja file) given to both (a base model's
# file has none: tools/chat_templates/); BENCH_FLAGS adds flags to every load run (e.g.
# --ignore-eos, so two servers that answer differently write as many tokens); LLAMA_FLAGS adds
# flags to llama-server (e.g. "--spec-type ngram-simple", its lookup decoding).
# Every server is started on 127.0.0.1 and stopped by PID; every load run is bounded.
# The QPS sweep uses SWEEP for servers that reuse the prefix and SWEEP_SLOW for those that
# cannot (each step sends QPS x 60 s requests, 10 to 40, and stops after 120 s).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results}
MODES=${2:-"seq c8"}
# copyjson: the copy workload's answers as {"quote": "..."} (a grammar that copies from the prompt)
QUOTE_FORMAT='{"response_format": {"type": "json_schema", "json_schema": {"name": "quote", "strict": true, "schema": {"type": "object", "properties": {"quote": {"type": "string"}}, "required": ["quote"], "additionalProperties": false}}}}'

DTYPE=${DTYPE:-auto}
SYSTEMS=${SYSTEMS:-"registry nocache llamacpp llamacpp-nocache transformers"}
read -r -a EXTRA <<< "${PREFIXGATE_FLAGS:-}"
read -r -a BENCH_EXTRA <<< "${BENCH_FLAGS:-}"
MODEL=${MODEL:+$(realpath "$MODEL")}  # absolute: the peers start in their own folder
CHAT_TEMPLATE=${CHAT_TEMPLATE:+$(realpath "$CHAT_TEMPLATE")}
SWEEP=${SWEEP:-0.25,0.5,1,1.5,2,3,4}
SWEEP_SLOW=${SWEEP_SLOW:-0.1,0.25,0.5,1}
PY=.venv/bin/python
mkdir -p "$OUT"
PORT=8090

bench() {  # label extra-args...   (RATES: the sweep's steps, default SWEEP)
  local label=$1; shift
  for mode in $MODES; do
    case $mode in
      seq) $PY tools/bench_serving.py --label "$label" --workload intent --concurrency 1 \
             --num-requests 20 --warmup 2 --max-duration 600 --out "$OUT/$label-seq.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      c8) $PY tools/bench_serving.py --label "$label" --workload intent --concurrency 8 \
             --num-requests 64 --warmup 2 --max-duration 600 --out "$OUT/$label-c8.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      sweep) $PY tools/bench_serving.py --label "$label" --workload intent \
             --sweep-qps "${RATES:-$SWEEP}" --num-requests 40 --step-duration 60 \
             --max-duration 120 --arrival poisson --submit-schedule absolute --warmup 2 \
             --out "$OUT/$label-sweep.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      decode) $PY tools/bench_serving.py --label "$label" --workload decode-heavy \
             --concurrency 32 --num-requests 64 --max-duration 300 --warmup 2 \
             --out "$OUT/$label-decode.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      multiturn) $PY tools/bench_serving.py --label "$label" --workload chat-multi-turn \
             --concurrency 8 --num-requests 48 --max-duration 600 --warmup 2 \
             --out "$OUT/$label-multiturn.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      contract) $PY tools/bench_serving.py --label "$label" --workload intent --concurrency 1 \
             --num-requests 20 --warmup 2 --max-duration 600 --extra-body '{"response_format": null}' \
             --out "$OUT/$label-contract.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      contract8) $PY tools/bench_serving.py --label "$label" --workload intent --concurrency 8 \
             --num-requests 32 --warmup 2 --max-duration 600 --extra-body '{"response_format": null}' \
             --out "$OUT/$label-contract8.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      copy) $PY tools/bench_serving.py --label "$label" --workload copy --concurrency 1 \
             --num-requests 12 --warmup 2 --max-duration 600 \
             --out "$OUT/$label-copy.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      copyjson) $PY tools/bench_serving.py --label "$label" --workload copy --concurrency 1 \
             --num-requests 12 --warmup 2 --max-duration 600 --extra-body "$QUOTE_FORMAT" \
             --out "$OUT/$label-copyjson.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
      copy8) $PY tools/bench_serving.py --label "$label" --workload copy --concurrency 8 \
             --num-requests 32 --warmup 2 --max-duration 600 \
             --out "$OUT/$label-copy8.json" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"} "$@" ;;
    esac
  done
}

prefixgate() {  # label flags...
  local label=$1; shift
  $PY -m prefixgate serve --port $PORT --prefixes prefixes.yaml --dtype "$DTYPE" \
    ${MODEL:+--model "$MODEL"} ${CHAT_TEMPLATE:+--chat-template "$CHAT_TEMPLATE"} \
    ${EXTRA[@]+"${EXTRA[@]}"} "$@" \
    > "$OUT/$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  bench "$label" --base-url "http://127.0.0.1:$PORT/v1"
  # what its engine did over the whole run: tokens forced, drafted and accepted
  curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E '^prefixgate_(forced_tokens|draft_tokens|accepted_draft_tokens|generation_tokens)_total' \
    > "$OUT/$label.metrics.txt" || true
  kill -TERM "$pid"; wait "$pid" || true
}

wants() { [[ " $SYSTEMS " == *" $1 "* ]]; }

if wants registry; then prefixgate "prefixgate-registry-$DTYPE${LABEL:-}"; fi
if wants nocache; then
  RATES=$SWEEP_SLOW prefixgate "prefixgate-nocache-$DTYPE${LABEL:-}" --no-prefix-cache
fi

if wants llamacpp || wants llamacpp-nocache; then
  ISA=${LLAMA_ISA:-native}
  SUFFIX=$([[ $ISA == native ]] || echo "-$ISA")
  read -r -a LLAMA_EXTRA <<< "${LLAMA_FLAGS:-}"
  [[ -n ${CHAT_TEMPLATE:-} ]] && LLAMA_EXTRA+=(--jinja --chat-template-file "$CHAT_TEMPLATE")
  $PY tools/peers.py start llama-cpp --port 8081 --no-build --isa "$ISA" ${MODEL:+--model "$MODEL"} \
    ${LLAMA_EXTRA[@]+-- "${LLAMA_EXTRA[@]}"}
  if wants llamacpp; then
    bench "llama.cpp-cache-on$SUFFIX${LABEL:-}" --base-url http://127.0.0.1:8081/v1 \
      --extra-body '{"cache_prompt": true}'
  fi
  if wants llamacpp-nocache; then
    RATES=$SWEEP_SLOW bench "llama.cpp-cache-off$SUFFIX${LABEL:-}" --base-url http://127.0.0.1:8081/v1 \
      --extra-body '{"cache_prompt": false}'
  fi
  $PY tools/peers.py stop llama-cpp
fi

if wants transformers; then
  # the float32 folder the peer is pinned to (written once by the project's venv)
  MODEL_DIR=$($PY -c "import sys; sys.path.insert(0, 'tools'); import peers; print(peers.find_hf_folder())" | tail -1)
  $PY tools/peers.py start transformers --port 8082 --continuous-batching --no-build
  RATES=$SWEEP_SLOW bench transformers-serve-cb --base-url http://127.0.0.1:8082/v1 --model "$MODEL_DIR" \
    --no-ignore-eos
  $PY tools/peers.py stop transformers
fi
