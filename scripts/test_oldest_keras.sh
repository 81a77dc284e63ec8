#!/usr/bin/env bash
# The TensorFlow pass again on the oldest Keras that setup.cfg allows (`keras>=X`, the
# minimum TensorFlow 2.21 declares), for the modules that use Keras' API directly and the
# client examples. scripts/test.sh covers the newest Keras pip resolves. The old Keras goes
# into a second virtual environment that sees the first one's packages (a .pth file) and
# shadows only `keras`: keras_hub 0.32 declares keras>=3.15 but its models used here run on
# the older Keras too. Runs from the virtual environment scripts/test.sh installed into
# (`KMP_TEST_OLDEST_KERAS=1 bash scripts/test.sh` runs it there, after the JAX pass).
# Every other test module gets a fast smoke selection (SMOKE below, ~30 s on 2 cores),
# so each module is imported and exercised on the oldest Keras without a second whole pass.
# Left out: tests/test_examples.py and tests/test_lean_distribute.py (each test starts
# subprocesses: 50-60 s apiece; the client examples above cover the examples' API use).
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
SMOKE=(
  tests/test_benchmark.py::test_run_one_rejects_unknown_names
  tests/test_benchmark.py::test_bad_names_raise_before_anything_runs
  tests/test_boundary.py
  tests/test_cli.py::test_audit_fix_writes_the_calibrated_model
  tests/test_cli.py::test_audit_prints_the_report
  tests/test_cli.py::test_models_are_seeded_and_output_logits
  tests/test_distribute.py::test_local_tf_configs
  tests/test_docs.py::test_docs_index_lists_every_page
  tests/test_docs.py::test_relative_links_resolve
  tests/test_export.py::test_signature_takes_and_returns_float32
  tests/test_export.py::test_float32_clone_has_the_same_weights_in_float32
  tests/test_fingerprint.py::test_recorder_in_a_custom_loop
  tests/test_fingerprint.py::test_diff_errors
  tests/test_formats.py
  tests/test_hardware.py
  tests/test_layout.py
  tests/test_lean.py::test_float32_weights_and_moments_match_keras
  tests/test_lean.py::test_save_load_and_resume_bit_identical
  tests/test_lean.py::test_lean_state_bytes
  tests/test_memory.py
  tests/test_runcheck.py::test_sample_inputs_follow_the_input_specs
  tests/test_runcheck.py::test_layer_without_a_float16_kernel_is_pinned_alone_and_the_model_runs
  tests/test_runcheck.py::test_check_argument_is_validated
  "tests/integration/test_keras_io_examples.py::test_vae_own_losses_add_up_in_float32[mixed_float16]"
  tests/integration/test_zoo.py::test_zoo_registry_is_consistent
  tests/integration/test_convert_models.py::test_convert_transformer_close_and_trains
)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" KERAS_BACKEND=tensorflow "$venv/bin/python" -m pytest \
  -q -p no:cacheprovider "$@" \
  tests/test_activations.py tests/test_layers.py tests/test_loss_scale.py tests/test_losses.py \
  tests/test_callbacks.py tests/test_policies.py tests/test_autoscale.py tests/test_save.py \
  tests/test_audit.py tests/test_calibrate.py tests/test_convert_nested.py tests/test_quiet.py \
  tests/test_model_copy.py tests/test_float8.py tests/integration/test_client_examples.py \
  "${SMOKE[@]}"
