#!/usr/bin/env bash
# Installs keras_mp with its test extras and runs the suite: every test on the
# TensorFlow backend and, at the same time in a second process, the backend-neutral ones
# again on JAX (CPU); the JAX pass's output follows the TensorFlow one.
# KMP_TEST_SERIAL=1 runs the two passes one after the other. KMP_TEST_OTHER_KERAS="oldest
# nightly" (CI) also runs scripts/test_other_keras.sh for each Keras named (the oldest
# setup.cfg allows, the next one), in the second lane after the JAX pass, where a core is
# free while the longer TensorFlow pass goes on.
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
other_keras_pass() {
  local which rc failed=0
  for which in ${KMP_TEST_OTHER_KERAS:-}; do
    rc=0
    bash scripts/test_other_keras.sh "$which" "$@" || rc=$?
    echo "=== Keras '$which' pass: exit $rc (its lane at ${SECONDS}s) ==="
    [ "$rc" -eq 0 ] || failed=1
  done
  return "$failed"
}
# The second lane: the JAX pass, then (CI) the other Keras versions' passes; its exit status
# is 0 only when all passed, and it names which failed.
second_lane() {
  local jax_rc=0 other_rc=0
  jax_pass "$@" || jax_rc=$?
  echo "=== JAX pass: exit $jax_rc (second lane at ${SECONDS}s) ==="
  other_keras_pass "$@" || other_rc=$?
  [ "$jax_rc" -eq 0 ] && [ "$other_rc" -eq 0 ]
}
if [ "${KMP_TEST_SERIAL:-0}" = "1" ]; then
  tf_pass "$@"
  jax_pass "$@"
  other_keras_pass "$@"
  exit 0
fi
lane_log="$(mktemp)"
trap 'rm -f "$lane_log"' EXIT
second_lane "$@" > "$lane_log" 2>&1 &
lane_pid=$!
tf_rc=0
tf_pass "$@" || tf_rc=$?
tf_done=$SECONDS
lane_rc=0
wait "$lane_pid" || lane_rc=$?
echo "=== second lane (JAX pass, then any other-Keras passes) ==="
cat "$lane_log"
echo "=== TensorFlow pass: exit $tf_rc (at ${tf_done}s); second lane: exit $lane_rc (both at ${SECONDS}s) ==="
[ "$tf_rc" -eq 0 ] && [ "$lane_rc" -eq 0 ]
