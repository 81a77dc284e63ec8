#!/usr/bin/env bash
# The prepared GPU benchmark of issue 8: one H200, JAX backend (XLA), about 8 minutes
# (TOTAL_BUDGET=480 s; run it with timeout_s=570).
#
# On the device machine (repository root; Keras wheels carried in .whl, see BENCHMARKS.md):
#   bash benchmarks/gpu_h200.sh               # JSON lines and a log under $OUT
# Dry run at tiny sizes on a CPU (no wheels, no torch anchor without CUDA):
#   PYTHON=/work/venv/bin/python WHEELS=none OUT=runs/gpu-dry GPT_MODEL=tiny_gpt RESNET_MODEL=tiny_resnet \
#     GPT_POLICIES=float32,stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_mixed_bfloat16@remat \
#     RESNET_POLICIES=float32,keras_mp_mixed_bfloat16 STEPS=2 bash benchmarks/gpu_h200.sh
#
# Order = priority: the GPT workload under every policy (one harness invocation, so the
# speedups vs float32 and vs stock Keras are side by side; stock_mixed_float16_kmp_scaler is
# stock FP16 with keras_mp's loss scaler: the scaler's own cost; @remat: XLA's
# rematerialization given a memory limit, the memory target's row), then ResNet-50, then the
# PyTorch AMP anchor (torch.compile, bf16), then the compile-only memory analysis of the step,
# then profiles of the GPT and ResNet-50 steps (kernels by kind). Each harness invocation starts no configuration once its
# --budget is spent; TOTAL_BUDGET (seconds) bounds the whole script.
set -u
OUT=${OUT:-runs/gpu}
. benchmarks/gpu_setup.sh   # $OUT, PY, the Keras wheels, PYTHONPATH, the JAX backend
GPT_MODEL=${GPT_MODEL:-gpt}
RESNET_MODEL=${RESNET_MODEL:-resnet50}
GPT_POLICIES=${GPT_POLICIES:-float32,stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_mixed_bfloat16@remat,stock_mixed_float16,keras_mp_mixed_float16,stock_mixed_float16_kmp_scaler,keras_mp_float8,keras_mp_lean_bfloat16,float32_strict}
RESNET_POLICIES=${RESNET_POLICIES:-float32,stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_lean_bfloat16,stock_mixed_float16,keras_mp_mixed_float16}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
TOTAL=${TOTAL_BUDGET:-480}
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) )); }


bench() {  # bench MODEL POLICIES BUDGET
  $PY benchmarks/run.py --backend jax --models "$1" --policies "$2" --steps "$STEPS" \
    --warmup "$WARMUP" --timeout 240 --budget "$3" --out "$OUT/bench.jsonl" \
    2>&1 | grep -v '^WARNING\|^I0000\|^W0000' | tee -a "$OUT/log.txt"
}

# Seconds left for the later steps: the torch anchor, the on-device compile, the profile.
TAIL=${TAIL:-200}
bench "$GPT_MODEL" "$GPT_POLICIES" $(( TOTAL * 45 / 100 ))
bench "$RESNET_MODEL" "$RESNET_POLICIES" $(( $(left) - TAIL > 10 ? $(left) - TAIL : 10 ))
upto() { local s=$(( $(left) - $1 )); echo $(( s < $2 ? s : $2 )); }  # left minus $1, at most $2

if [ "$(left)" -gt 100 ] && $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  timeout "$(upto 100 100)" $PY benchmarks/anchors/anchor_torch.py --policy bf16 --compile \
    --steps "$STEPS" 2>&1 | grep '^RESULT ' | sed 's/^RESULT //' | tee -a "$OUT/torch.jsonl"
else
  echo "torch anchor skipped: $(left) s left or no CUDA torch" | tee -a "$OUT/log.txt"
fi
# Compile-only XLA:GPU buffer assignment of the GPT step on this GPU (stock and keras_mp
# bf16), to set beside the peaks measured above: calibrates the estimates that
# `xla_memory.py --target h200` gives without a GPU (BENCHMARKS.md section 9).
if [ "$(left)" -gt 60 ]; then
  timeout "$(upto 40 60)" $PY benchmarks/xla_memory.py --models "$GPT_MODEL" \
    --policies stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_mixed_bfloat16@remat \
    --out "$OUT/xla_memory.jsonl" 2>&1 | grep '^{' | tee -a "$OUT/log.txt"
fi
# Where the steps' time goes: kernels by kind, busy vs idle (benchmarks/jax_profile.py);
# keras_mp's GPT and ResNet-50 bf16 steps, then stock's GPT step, as far as time goes.
profile() {  # profile MODEL POLICY
  [ "$(left)" -gt 30 ] || return 0
  timeout "$(left)" $PY benchmarks/jax_profile.py --models "$1" --policies "$2" --steps 5 \
    --out "$OUT/profile.jsonl" 2>&1 | grep '^{' | cut -c1-400 | tee -a "$OUT/log.txt"
}
profile "$GPT_MODEL" keras_mp_mixed_bfloat16
profile "$RESNET_MODEL" keras_mp_mixed_bfloat16
profile "$GPT_MODEL" stock_mixed_bfloat16
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/log.txt"
