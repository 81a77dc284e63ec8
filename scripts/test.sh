#!/usr/bin/env bash
# Installs keras_mp with its test extras and runs the suite: every test on the
# TensorFlow backend and, at the same time in a second process, the backend-neutral ones
# again on JAX (CPU); the JAX pass's output follows the TensorFlow one.
# KMP_TEST_SERIAL=1 runs the two passes one after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,plot]"
ruff check .
jax_pass() {
  KERAS_BACKEND=jax python -m pytest -q -p no:cacheprovider -m "not slow and not tf_only" "$@"
}
tf_pass() {
  KERAS_BACKEND=tensorflow python -m pytest -q -p no:cacheprovider "$@"
}
if [ "${KMP_TEST_SERIAL:-0}" = "1" ]; then
  tf_pass "$@"
  jax_pass "$@"
  exit 0
fi
jax_log="$(mktemp)"
trap 'rm -f "$jax_log"' EXIT
jax_pass "$@" > "$jax_log" 2>&1 &
jax_pid=$!
tf_rc=0
tf_pass "$@" || tf_rc=$?
jax_rc=0
wait "$jax_pid" || jax_rc=$?
echo "=== JAX pass (exit $jax_rc) ==="
cat "$jax_log"
echo "=== TensorFlow pass: exit $tf_rc; JAX pass: exit $jax_rc ==="
[ "$tf_rc" -eq 0 ] && [ "$jax_rc" -eq 0 ]
