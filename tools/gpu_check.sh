#!/usr/bin/env bash
# The GPU check pack (bench/gpu_check.py) as one command on a bare, offline GPU box: one H100/H200 with a Python
# that has torch + CUDA, transformers and safetensors, no package index. What else the project needs (megatron-core,
# hydra/omegaconf, math-verify and their small dependencies) comes as wheels carried beside the checkout, made on a
# machine with an index by `make gpu-wheels` (.gpu_wheels/, about 3.5 MiB). Takes about 5 minutes on an H200.
#   bash tools/gpu_check.sh [--out PATH] [--steps N]   -> bench/results/gpu_check_<card>.json
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${GPU_CHECK_WHEELS:-.gpu_wheels}
PY=${PYTHON:-python3}
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check: no wheels in $WHEELS (run 'make gpu-wheels' where pip reaches an index, and carry the folder)" >&2
    exit 2
fi
SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py "$@"
