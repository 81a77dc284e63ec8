#!/usr/bin/env bash
# The prepared GPU run of issue 34 (the lean state: its step time and the step's peak memory)
# on one H200, JAX backend, TOTAL_BUDGET seconds (default 450; run it with timeout_s=520).
#
# On the device machine (repository root; Keras wheels carried in .whl, see BENCHMARKS.md):
#   bash benchmarks/gpu_lean.sh                 # records and a log under $OUT
# Dry run at tiny sizes on a CPU (JAX; no wheels):
#   PYTHON=.venv/bin/python WHEELS=none OUT=runs/gpu-lean-dry GPT_MODEL=tiny_gpt \
#     SIZES=compare,0.13M ROUNDS=2 STEPS=2 bash benchmarks/gpu_lean.sh
#
# Order = priority, each part bounded so that the later ones still run:
# 1. `benchmarks/lean_speed.py` in one JAX process (its worker, so that `timeout` ends it):
#    lean / mixed_bfloat16 step, packed and `pack_small=False`, side by side in ABCCBA rounds,
#    from `compare`'s 10k-parameter transformer to a 101M byte-level GPT;
# 2. the harness on the 134M-parameter `gpt` workload (16 x 1024 tokens, AdamW, each row its
#    own process): stock and keras_mp `mixed_bfloat16` and `lean_bfloat16`, step time and the
#    device allocator's measured peak; then under `keras.RematScope` over each block's
#    attention and first FFN layer (section 14.2's 0.43x recipe, compiled-only until now) and
#    over the first FFN layer of every block and the attention of blocks 0-2 (0.497x);
# 3. what is left of issue 8's GPT rows (float32, float16, float8), as far as time goes.
set -u
OUT=${OUT:-runs/gpu-lean}
. benchmarks/gpu_setup.sh   # $OUT, PY, the Keras wheels, PYTHONPATH, the JAX backend
GPT_MODEL=${GPT_MODEL:-gpt}
SIZES=${SIZES:-compare,1M,101M,3.3M,0.13M,25M}
ROUNDS=${ROUNDS:-4}
STEPS=${STEPS:-8}
TOTAL=${TOTAL_BUDGET:-450}
START=$(date +%s)
left() { echo $(( TOTAL - ($(date +%s) - START) )); }
upto() { local s=$(( $(left) - $1 )); echo $(( s < $2 ? s : $2 )); }  # left minus $1, at most $2


# 1. lean / mixed step time, small to large (ROW lines as each size ends)
timeout "$(upto 330 120)" $PY benchmarks/lean_speed.py --worker --backends jax --sizes "$SIZES" \
  --unpacked --rounds "$ROUNDS" --steps "$STEPS" --warmup 2 2>&1 \
  | grep '^ROW ' | sed 's/^ROW //' | tee -a "$OUT/lean_speed.jsonl"

bench() {  # bench POLICIES BUDGET [harness options...]
  local policies=$1 budget=$2
  shift 2
  [ "$budget" -gt 10 ] || { echo "skipped $policies $*: $(left) s left" | tee -a "$OUT/log.txt"; return 0; }
  timeout "$(( budget + 60 ))" $PY benchmarks/run.py --backend jax --models "$GPT_MODEL" \
    --policies "$policies" --steps 10 --warmup 2 --timeout 150 --budget "$budget" \
    --out "$OUT/bench.jsonl" "$@" 2>&1 | grep -v '^WARNING\|^I0000\|^W0000' | tee -a "$OUT/log.txt"
}
# 2. the GPT step: time and measured peak, plain, then with recomputation
bench stock_mixed_bfloat16,keras_mp_mixed_bfloat16,keras_mp_lean_bfloat16 "$(upto 200 150)"
bench keras_mp_lean_bfloat16,keras_mp_mixed_bfloat16 "$(upto 120 100)" --remat-layers attn_,ffn_in_
bench keras_mp_lean_bfloat16 "$(upto 80 60)" --remat-layers "ffn_in_,attn_[0-2]"
# 3. issue 8's other GPT rows, as far as time goes
bench float32,stock_mixed_float16,keras_mp_mixed_float16,keras_mp_float8 "$(upto 20 200)"
echo "total $(( $(date +%s) - START )) s" | tee -a "$OUT/log.txt"
