#!/usr/bin/env bash
# The TensorFlow pass again on the oldest Keras that setup.cfg allows (`keras>=X`, the
# minimum TensorFlow 2.21 declares), for the modules that use Keras' API directly and the
# client examples. scripts/test.sh covers the newest Keras pip resolves. The old Keras goes
# into a second virtual environment that sees the first one's packages (a .pth file) and
# shadows only `keras`: keras_hub 0.32 declares keras>=3.15 but its models used here run on
# the older Keras too. Runs after scripts/test.sh, from the same virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
oldest="$(sed -n 's/^ *keras>=\([0-9.]*\).*/\1/p' setup.cfg | head -1)"
[ -n "$oldest" ] || { echo "setup.cfg declares no keras>= lower bound" >&2; exit 1; }
venv="${KMP_OLD_KERAS_VENV:-$(mktemp -d)/venv-keras-$oldest}"
python -m venv "$venv"
python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_main.pth"
"$venv/bin/python" -m pip install -q --no-deps "keras==$oldest.0"
"$venv/bin/python" -c "import keras, sys; v = keras.__version__; print('Keras', v); sys.exit(not v.startswith('$oldest.'))"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" KERAS_BACKEND=tensorflow "$venv/bin/python" -m pytest \
  -q -p no:cacheprovider "$@" \
  tests/test_activations.py tests/test_layers.py tests/test_loss_scale.py tests/test_losses.py \
  tests/test_callbacks.py tests/test_policies.py tests/test_autoscale.py tests/test_save.py \
  tests/test_audit.py tests/test_calibrate.py tests/test_convert_nested.py tests/test_quiet.py \
  tests/test_model_copy.py tests/test_float8.py tests/integration/test_client_examples.py
