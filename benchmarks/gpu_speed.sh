#!/usr/bin/env bash
# Issue 49's (and 48.1's) device check on one GPU (H100 or H200), JAX backend, about 8
# minutes (TOTAL_BUDGET=470 s; run it with timeout_s=560). Records under $OUT.
#
# On the device machine (repository root; Keras wheels carried in .whl, see BENCHMARKS.md):
#   bash benchmarks/gpu_speed.sh
# Dry run at tiny sizes on a CPU (no wheels, no torch anchor without CUDA):
#   PYTHON=.venv/bin/python WHEELS=none OUT=runs/speed-dry GPT_MODEL=tiny_gpt BIG_MODEL=tiny_gpt \
#     STEPS=2 FIT_STEPS=16 bash benchmarks/gpu_speed.sh
#
# Order = priority, each part bounded by what is left of TOTAL_BUDGET:
# 1. the GPT step (168M, 16 x 1024 tokens) as the harness times it (train_on_batch): stock
#    and keras_mp mixed_bfloat16, lean; the baseline on this card;
# 2. 48.1: lean + kmp.recompute_elementwise: its time and measured peak (compiled for an
#    H200 without one: 4.10 GiB vs stock's 9.29, BENCHMARKS 19);
# 3. 49.1: model.fit at steps_per_execution 1 and 16, stock vs keras_mp mixed
#    (benchmarks/fit_steps.py): the host's share of a step;
# 4. 49.2: lean with the Pallas update kernel (KERAS_MP_LEAN_KERNEL=pallas);
# 5. 49.4: a ~1.3B GPT (gpt_1b3, 24 x 2048-wide blocks), stock bf16 vs keras_mp float8;
# 6. the PyTorch anchor (torch.compile, bf16, the same GPT);
# 7. 49.3: compile-only kernel counts and bytes of the GPT step on this GPU, stock vs keras_mp.
set -u
OUT=${OUT:-runs/gpu-speed}
. benchmarks/gpu_setup.sh   # $OUT, PY, the Keras wheels, PYTHONPATH, the JAX backend
GPT_MODEL=${GPT_MODEL:-gpt}
BIG_MODEL=${BIG_MODEL:-gpt_1b3}
STEPS=${STEPS:-10}
FIT_STEPS=${FIT_STEPS:-64}
TOTAL=${TOTAL_BUDGET:-470}
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
quiet() { grep -v '^WARNING\|^I0000\|^W0000'; }
bench() {  # bench MODEL POLICIES BUDGET [harness flags...]
  local model=$1 policies=$2 budget=$3
  shift 3
  [ "$(left)" -gt 20 ] || { echo "skipped $model $policies: no time left" | tee -a "$OUT/log.txt"; return; }
  timeout "$(left)" $PY benchmarks/run.py --backend jax --models "$model" --policies "$policies" \
    --steps "$STEPS" --warmup 2 --timeout 200 --budget "$budget" --out "$OUT/bench.jsonl" "$@" \
    2>&1 | quiet | tee -a "$OUT/log.txt"
}
bench "$GPT_MODEL" stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_lean_bfloat16 120
bench "$GPT_MODEL" keras_mp_lean_bfloat16 40 --recompute
if [ "$(left)" -gt 60 ]; then
  timeout "$(( $(left) - 30 < 120 ? $(left) - 30 : 120 ))" $PY benchmarks/fit_steps.py \
    --models "$GPT_MODEL" --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16 \
    --steps-per-execution 1,16 --steps "$FIT_STEPS" --out "$OUT/fit.jsonl" 2>&1 | quiet \
    | grep '^{' | tee -a "$OUT/log.txt"
fi
KERAS_MP_LEAN_KERNEL=pallas bench "$GPT_MODEL" keras_mp_lean_bfloat16 40
bench "$BIG_MODEL" stock_mixed_bfloat16,keras_mp_float8 100
if [ "$(left)" -gt 60 ] && $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  timeout 60 $PY benchmarks/anchors/anchor_torch.py --policy bf16 --compile --steps "$STEPS" \
    2>&1 | grep '^RESULT ' | sed 's/^RESULT //' | tee -a "$OUT/torch.jsonl"
else
  echo "torch anchor skipped: $(left) s left or no CUDA torch" | tee -a "$OUT/log.txt"
fi
if [ "$(left)" -gt 40 ]; then
  timeout "$(( $(left) - 5 ))" $PY benchmarks/xla_memory.py --models "$GPT_MODEL" \
    --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16 --out "$OUT/xla_memory.jsonl" \
    2>&1 | grep '^{' | cut -c1-600 | tee -a "$OUT/log.txt"
fi
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/log.txt"
