#!/usr/bin/env bash
# The TensorFlow pass again on another Keras, for what differs between Keras versions: the
# modules that reach Keras' API beyond its public surface (keras_mp/keras_glue/keras_internals.py
# and the features built on it: policies, loss scaling, lean, losses, layers, float8, saving,
# conversion). scripts/test.sh covers the newest Keras pip resolves.
#
#   bash scripts/test_other_keras.sh oldest    # the oldest Keras setup.cfg allows (keras>=X)
#   bash scripts/test_other_keras.sh nightly   # the next Keras: keras-nightly (NIGHTLY below)
#
# The other Keras goes into a second virtual environment that sees the first one's packages
# (a .pth file) and shadows only `keras` (installed with --no-deps: keras-hub and the rest
# stay). keras_hub 0.32 declares keras>=3.15 but its models used here run on the older Keras;
# it does not import on 3.16 (a mask helper moved), so tests that need it skip there, naming
# why (tests/conftest.py). Runs from the virtual environment scripts/test.sh installed into
# (`KMP_TEST_OTHER_KERAS="oldest nightly" bash scripts/test.sh` runs both after the JAX pass).
set -euo pipefail
cd "$(dirname "$0")/.."
which="${1:?usage: test_other_keras.sh oldest|nightly [pytest args]}"
shift
# The nightly checked last (SUPPORTED_KERAS in keras_mp/keras_glue/keras_internals.py reaches
# it); set KMP_KERAS_NIGHTLY=latest for the newest one on the index.
NIGHTLY="${KMP_KERAS_NIGHTLY:-3.16.0.dev2026102704}"
case "$which" in
  oldest)
    oldest="$(sed -n 's/^ *keras>=\([0-9.]*\).*/\1/p' setup.cfg | head -1)"
    [ -n "$oldest" ] || { echo "setup.cfg declares no keras>= lower bound" >&2; exit 1; }
    package="keras==$oldest.0"
    expect="$oldest."
    ;;
  nightly)
    if [ "$NIGHTLY" = latest ]; then package="keras-nightly"; else package="keras-nightly==$NIGHTLY"; fi
    expect=""
    ;;
  *) echo "test_other_keras.sh: unknown Keras '$which' (oldest or nightly)" >&2; exit 2 ;;
esac
venv="$(mktemp -d)/venv-keras-$which"
python -m venv "$venv"
python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
  > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_main.pth"
"$venv/bin/python" -m pip install -q --no-deps --pre "$package"
"$venv/bin/python" -c "import keras, sys; v = keras.__version__; print('Keras', v); sys.exit(not v.startswith('$expect'))"
# What reaches Keras' internals, whole; the rest of the suite is the same code on any Keras.
MODULES=(
  tests/test_keras_internals.py tests/test_layout.py
  tests/test_policies.py tests/test_autoscale.py tests/test_loss_scale.py tests/test_losses.py
  tests/test_layers.py tests/test_float8.py tests/test_save.py tests/test_model_copy.py
  tests/test_convert_nested.py tests/test_boundary.py tests/test_lean.py tests/test_nonfinite_steps.py
)
if [ "$which" = oldest ]; then
  # The oldest Keras is a fixed release: the modules of keras_mp's own arithmetic on
  # keras.ops (losses, layers, float8, the non-finite step) run whole on the nightly only;
  # here a case or two each (below), with the modules that reach Keras' internals whole
  # (CI time, 2026-12-06: the two other-Keras passes make the second lane the longer one).
  MODULES=(
    tests/test_keras_internals.py tests/test_layout.py
    tests/test_policies.py tests/test_autoscale.py tests/test_loss_scale.py tests/test_save.py
    tests/test_model_copy.py tests/test_convert_nested.py tests/test_boundary.py tests/test_lean.py
    tests/test_losses.py::test_equal_to_keras_on_float32_inputs
    tests/test_losses.py::test_serialization_round_trip
    tests/test_layers.py::test_mha_is_stock_mha_with_float32_softmax
    tests/test_float8.py::test_save_and_load_keep_scales_histories_and_recipe
    tests/test_nonfinite_steps.py::test_lean_skipped_step_is_counted_where_float16_counts_its_skips
  )
fi
# One case of each other module that touches Keras objects, so that each imports and runs.
SMOKE=(
  tests/test_callbacks.py::test_monitor_logs_are_the_optimizer_scale_step_by_step
  tests/test_runcheck.py::test_check_argument_is_validated
  tests/test_export.py::test_signature_takes_and_returns_float32
  tests/test_fingerprint.py::test_recorder_in_a_custom_loop
  tests/test_lean_general.py::test_non_finite_gradient_changes_nothing
  tests/test_lean_packing.py::test_packed_state_layout_and_config
  tests/test_formats.py
  "tests/integration/test_keras_io_examples.py::test_vae_own_losses_add_up_in_float32[mixed_float16]"
  tests/integration/test_convert_models.py::test_convert_transformer_close_and_trains
)
# Numerics over many steps that no Keras version changes (the same keras_mp arithmetic on
# keras.ops), the longest cases of the modules above: the main pass runs them.
SAME_ON_ANY_KERAS=(
  --deselect tests/test_float8.py::test_float8_training_tracks_mixed_bfloat16
  --deselect tests/test_lean.py::test_int8_moments_follow_a_slow_average
  --deselect tests/test_lean.py::test_small_updates_accumulate_under_kahan_not_under_nearest
  --deselect tests/test_lean.py::test_int8_moments_stay_close_to_keras_adamw
  --deselect tests/test_loss_scale.py::test_rule_matches_reference_on_thousands_of_sequences
  --deselect tests/test_lean.py::test_bfloat16_weights_follow_mixed_bfloat16_training
  --deselect tests/test_layers.py::test_layer_norm_trains_in_graph_and_xla_with_optional_parameters
  --deselect "tests/test_nonfinite_steps.py::test_converting_a_lean_model_gives_float32_master_weights[mixed"
  # the longest end-to-end runs, on the newest Keras only (CI time, 2026-12-06: the two
  # other-Keras passes are in the second lane, the longer one; these took 55 s of each
  # on the project's CPU): lean under a MirroredStrategy, keras_hub models (keras_hub does
  # not import on the nightly anyway)
  --deselect tests/test_lean.py::test_mirrored_strategy_keeps_each_variables_own_state
  --deselect tests/test_lean.py::test_keras_hub_gpt2_trains_lean
  --deselect tests/test_policies.py::test_moe_router_runs_in_float32_and_keras_hub_mixtral_trains
)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$which" = nightly ]; then
  # Keras 3.16 runs JAX's steps_per_execution as one on-device lax.scan: keras_mp's per-step
  # state (loss scale, skip counts, the lean update) inside it. recompute_elementwise runs a
  # functional graph stretch by stretch (JAX only): Keras' graph internals, on the next Keras.
  KERAS_BACKEND=jax "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" \
    tests/test_keras_internals.py tests/test_steps_per_execution.py tests/test_recompute.py
fi
KERAS_BACKEND=tensorflow "$venv/bin/python" -m pytest \
  -q -p no:cacheprovider "${SAME_ON_ANY_KERAS[@]}" "$@" "${MODULES[@]}" "${SMOKE[@]}"
