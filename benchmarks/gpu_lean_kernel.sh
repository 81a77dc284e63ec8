#!/usr/bin/env bash
# Issue 34.2's next device check on one H200 (JAX), about 5 minutes (timeout_s=420): the
# 4-bit lean update as one Pallas (Triton) kernel a variable (keras_mp/lean/kernel.py,
# BENCHMARKS.md 16.5) against XLA's, from the update alone to the GPT step. Records in $OUT.
#
# On the device machine (repository root; Keras wheels carried in .whl, see BENCHMARKS.md):
#   bash benchmarks/gpu_lean_kernel.sh
# Dry run on a CPU (JAX; Pallas interpreted, tiny sizes; no wheels):
#   PYTHON=.venv/bin/python WHEELS=none OUT=runs/kernel-dry VALUES=256K SIZES=0.13M \
#     FORMATS_ARGS="--vocab 2048 --width 128 --rounds 2 --steps 3" GPT_MODEL=tiny_gpt \
#     bash benchmarks/gpu_lean_kernel.sh
set -u
OUT=${OUT:-runs/gpu-lean-kernel}
. benchmarks/gpu_setup.sh   # $OUT, PY, the Keras wheels, PYTHONPATH, the JAX backend
quiet() { grep -v '^WARNING\|^I0000\|^W0000'; }
# 1. the update alone, 64M values: agreement with XLA's bits, time per (rows x warps)
timeout 100 $PY benchmarks/lean_kernel_check.py --values "${VALUES:-64M}" 2>&1 | quiet \
  | tee "$OUT/lean_kernel_check.jsonl"
# 2. the state formats' updates side by side (BENCHMARKS 16.4), the kernel beside them
# shellcheck disable=SC2086
timeout 80 $PY benchmarks/lean_formats.py ${FORMATS_ARGS:-} \
  --lean stochastic:int4,stochastic:int4:pallas,kahan:int8,stochastic:bfloat16 2>&1 | quiet \
  | tee "$OUT/lean_formats.txt"
# 3. lean / mixed step with and without the kernel (BENCHMARKS 16.1's method)
timeout 120 $PY benchmarks/lean_speed.py --worker --sizes "${SIZES:-101M,1M}" --pallas \
  --rounds 3 --steps 6 --warmup 2 2>&1 | quiet | tee "$OUT/lean_speed.jsonl"
# 4. the GPT step (168M, 16 x 1024 tokens; BENCHMARKS 16.2): lean with XLA's update, then
#    with the kernel, each its own process; the record's env names the kernel
for kernel in xla pallas; do
  KERAS_MP_LEAN_KERNEL=$kernel timeout 170 $PY benchmarks/run.py --backend jax \
    --models "${GPT_MODEL:-gpt}" --policies keras_mp_lean_bfloat16 --steps 10 --warmup 2 \
    --timeout 150 --out "$OUT/gpt.jsonl" 2>&1 | quiet | tail -4
done
echo "done: $OUT"
