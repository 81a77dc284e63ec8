#!/usr/bin/env bash
# The next device check of issue 34.2 on one H200 (JAX), about 3 minutes (timeout_s=220):
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
. benchmarks/gpu_setup.sh   # $OUT, PY, the Keras wheels, PYTHONPATH, the JAX backend
timeout 110 $PY benchmarks/lean_codec_parts.py --values "${VALUES:-64M}" 2>&1 \
  | grep -v '^WARNING\|^I0000\|^W0000' | tee "$OUT/lean_codec_parts.txt"
# shellcheck disable=SC2086
timeout 80 $PY benchmarks/lean_formats.py ${FORMATS_ARGS:-} 2>&1 \
  | grep -v '^WARNING\|^I0000\|^W0000' | tee "$OUT/lean_formats.txt"
