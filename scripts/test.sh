#!/usr/bin/env bash
# Installs keras_mp with its test extras and runs the suite: every test on the
# TensorFlow backend, then the backend-neutral ones again on JAX (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,plot]"
ruff check .
KERAS_BACKEND=tensorflow python -m pytest -q -p no:cacheprovider "$@"
KERAS_BACKEND=jax python -m pytest -q -p no:cacheprovider -m "not slow and not tf_only" "$@"
