#!/usr/bin/env bash
# The next device check of issue 34.2 on one H200 (JAX), about 2 minutes (timeout_s=200):
# where the 4-bit moments' update spends its time (BENCHMARKS.md 16.4), part by part, then
# the state formats' updates side by side. Records under $OUT.
#
# On the device machine (repository root; Keras wheels carried in .whl, see BENCHMARKS.md):
#   bash benchmarks/gpu_lean_parts.sh
# Dry run on a CPU (JAX; no wheels), tiny sizes:
#   PYTHON=.venv/bin/python WHEELS=none OUT=runs/parts-dry VALUES=1M \
#     FORMATS_ARGS="--vocab 2048 --width 128 --rounds 2 --steps 3" bash benchmarks/gpu_lean_parts.sh
set -u
OUT=${OUT:-runs/gpu-lean-parts}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
(nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1; git rev-parse HEAD 2>/dev/null) > "$OUT/env.txt"
timeout 90 $PY benchmarks/lean_codec_parts.py --values "${VALUES:-64M}" 2>&1 \
  | grep -v '^WARNING\|^I0000\|^W0000' | tee "$OUT/lean_codec_parts.txt"
# shellcheck disable=SC2086
timeout 80 $PY benchmarks/lean_formats.py ${FORMATS_ARGS:-} 2>&1 \
  | grep -v '^WARNING\|^I0000\|^W0000' | tee "$OUT/lean_formats.txt"
