# Sourced by the prepared device scripts (gpu_h200.sh, gpu_lean.sh, gpu_lean_parts.sh), in
# the repository root, after they set OUT: makes $OUT, sets PY (default python3), installs
# the carried Keras wheels (WHEELS, default .whl: keras, namex, optree for Python 3.12; the
# device has no Keras; WHEELS=none skips it) into /tmp/site, puts this working tree's
# keras_mp on PYTHONPATH, selects the JAX backend and writes $OUT/env.txt (the machine,
# the versions, the commit).
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"   # keras_mp from this working tree
export KERAS_BACKEND=jax PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1
  $PY -c "import sys, jax, keras; print(sys.version.split()[0], 'jax', jax.__version__, \
'keras', keras.__version__, jax.devices())" 2>&1 | tail -1
  git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
} > "$OUT/env.txt"
cat "$OUT/env.txt"
