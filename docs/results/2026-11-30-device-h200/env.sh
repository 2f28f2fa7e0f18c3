# Sourced from the repository root by step1.sh-step3.sh on the lent device machine.
# /tmp/site: the carried wheels (step1), the default-model package (step2), Ray (step3);
# $PWD: the working tree, so `engine`, `gateway`, `prefixgate`, `tools`, `tests` import.
export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
# Everything built once per machine (GGUF conversion, kernels, config cache, responses db).
export PREFIXGATE_CACHE_DIR=/tmp/pgcache
# No network there: never try a hub.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
# Ray: no usage-stats upload (no network); its console scripts (step3's tar) on PATH.
export RAY_USAGE_STATS_ENABLED=0
export PATH=/tmp/site/bin:$PATH
export TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/site "$PREFIXGATE_CACHE_DIR"
F='tok/s\]|it/s\]'   # tqdm progress lines, filtered out of what is printed
stamp() { echo "== $(date -u +%H:%M:%S) $*"; }
