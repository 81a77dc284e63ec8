"""The conversion checks a zoo entry goes through, shared by the tests and the sweep script.

`run(entry, policy)` builds the entry in float32 and checks, stage by stage:

1. `convert`: `kmp.convert(model, policy)` (its run check pins what cannot run in the
   compute dtype); where its outputs on the entry's batch are non-finite though float32's
   are finite (overflow at initialisation, which a made-up batch need not show), or it
   raises on that batch, again with `calibrate=` that batch (the run check then uses it),
   as a user would (`"calibrated": True`); the original
   untouched; master weights bit-identical; the copy's layers in the compute dtype except
   the plan's pins. The pins, their reasons and FLOP shares go in `"pin_detail"`.
2. `forward`: the converted model's outputs within `TOLERANCE[policy]` of the float32
   model's, as max |difference| / max |float32 output| over every floating output.
3. `fit`: three steps with `kmp.LossScaleOptimizer` under mixed_float16 (Adam otherwise),
   the entry's loss (`kmp.losses.SparseCategoricalCrossentropy` for logits), XLA as `jit`
   says (the sweep: always on TensorFlow): every loss finite.
4. `save`: `.keras` save and `keras.saving.load_model` in a fresh Keras session, as another
   process loads it (Keras' name counters restart: a model with auto-named layers, loaded
   in the session that built it, gets other names and paths, which its saved policy map
   does not name): same weights, same compute dtype for
   every layer, same outputs.
5. `audit`: `kmp.audit(converted, (x, y))` runs, probes every layer and gives a verdict.

Each stage's result is "ok", or the first line of its error; a stage after a failure is
"-". Where our stage fails, `stock(entry, policy)` tells whether stock Keras mixed
precision (the model built under the Keras policy, Keras' loss scaler) runs the same
model: a failure stock Keras shares is not counted against keras_mp.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import keras
import numpy as np

import keras_mp as kmp
from keras_mp.conversion.model_copy import copy_model, pair_variables

__all__ = ["SAVE_TOLERANCE", "STAGES", "TOLERANCE", "float32", "relative_error", "run",
           "stock", "stock_error"]

STAGES = ("convert", "forward", "fit", "save", "audit")
# Max |converted - float32| / max |float32| over the outputs. Measured on the zoo (2-core
# CPU): mixed_float16 up to ~1e-2, mixed_bfloat16 up to ~5e-2 (8 mantissa bits, random
# tiny models whose outputs are sums of many small terms).
TOLERANCE = {"mixed_float16": 5e-2, "mixed_bfloat16": 1.5e-1}
# Converted vs loaded model, both eager: the same dtypes, but keras_mp's fused layer-norm
# kernel (in memory) and Keras' (a keras_hub block rebuilt on load) round differently.
SAVE_TOLERANCE = {"mixed_float16": 1e-2, "mixed_bfloat16": 5e-2}
BATCH = 2
STEPS = 3


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:240]


def _floats(tree) -> list:
    out = []
    for leaf in keras.tree.flatten(tree):
        a = np.asarray(keras.ops.convert_to_numpy(leaf))
        if a.dtype.kind in "fV":
            out.append(a.astype("float32"))
    return out


def _finite(tree) -> bool:
    return all(np.isfinite(a).all() for a in _floats(tree))


def relative_error(reference, result) -> float:
    """max |result - reference| / max |reference| over the floating outputs."""
    ref, got = _floats(reference), _floats(result)
    assert len(ref) == len(got), (len(ref), len(got))
    worst = 0.0
    for a, b in zip(ref, got, strict=True):
        if not np.isfinite(b).all():
            return float("inf")
        scale = float(np.abs(a).max()) or 1.0
        worst = max(worst, float(np.abs(b - a).max()) / scale)
    return worst


def _np(variable) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable.value))


def _pairs(a: keras.Model, b: keras.Model) -> list:
    """`(path, value in a, value in b)` for each weight of `a` and its counterpart in `b`:
    by path where the paths agree, else as `kmp.convert` pairs them (a loaded model's paths
    may carry other auto-generated names)."""
    want, got = _weights(a), _weights(b)
    if set(want) == set(got):
        return [(k, want[k], got[k]) for k in want]
    pairs = pair_variables(a, b)
    assert len(pairs) == len(a.weights) == len(b.weights), (
        f"{len(a.weights)} vs {len(b.weights)} weights")
    return [(x.path, _np(x), _np(y)) for x, y in pairs]


def _weights(model) -> dict:
    return {v.path: _np(v) for v in model.weights}


def _compute_dtypes(model, paths_only: bool = False) -> dict:
    """Compute dtype per layer address (per path only: path-less layers get auto-names,
    which a loaded model numbers anew)."""
    where = kmp.keep_list.addresses(model)
    layers, _ = kmp.keep_list.layer_tree(model)
    return {where[id(x)]: x.compute_dtype for x in layers  # models: containers, no math
            if not isinstance(x, (keras.layers.InputLayer, keras.Model))
            and (x.path or not paths_only)}


def _loss(entry):
    loss = entry.loss()
    if isinstance(loss, keras.losses.SparseCategoricalCrossentropy):
        return kmp.losses.SparseCategoricalCrossentropy(from_logits=True)
    return loss


def _optimizer(policy):
    inner = keras.optimizers.Adam(1e-3)
    return kmp.LossScaleOptimizer(inner) if policy == "mixed_float16" else inner


def _fit(model, entry, policy, optimizer, loss, jit) -> list:
    model.compile(optimizer=optimizer, loss=loss, jit_compile=jit)
    x, y = entry.fit_data(model, BATCH)
    losses = []
    for _ in range(STEPS):
        logs = model.train_on_batch(x, y, return_dict=True)
        losses.append(float(logs["loss"]))
    return losses


def run(entry, policy: str, stages=STAGES, jit: bool | None = None) -> dict:
    """Builds `entry` in float32 and runs the conversion stages under `policy`.

    `jit`: `jit_compile` of the fit stage; None: XLA on TensorFlow for mixed_float16 (which
    TensorFlow runs about 5x slower on this CPU without it), Keras' default otherwise.

    Returns:
        `{"entry", "policy", "seconds", "error": {stage: detail}, stage: "ok" | ...}`;
        also `"relative_error"`, `"pins"`, `"losses"` where measured.
    """
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy("float32")
    result: dict = {"entry": entry.name, "policy": policy}
    start = time.perf_counter()
    model = entry.build()
    x = entry.inputs(BATCH)
    failed = False

    def stage(name, fn):
        nonlocal failed
        if name not in stages:
            return None
        if failed:
            result[name] = "-"
            return None
        began = time.perf_counter()
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - reported per stage
            result[name] = _first_line(e)
            failed = True
            return None
        result[name] = "ok"
        result.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - began, 1)
        return value

    reference = model.predict_on_batch(x)
    before = _weights(model)

    def do_convert():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            converted = kmp.convert(model, policy)
            try:
                runs = _finite(converted.predict_on_batch(x))
            except Exception:  # noqa: BLE001 - a path the check's made-up batch did not take
                runs = False
            if not runs and _finite(reference):  # check and calibrate on the entry's batch
                converted = kmp.convert(model, policy, calibrate=x)
                result["calibrated"] = True
        after = _weights(model)
        assert all(np.array_equal(before[k], after[k]) for k in before), "original changed"
        for path, a, b in _pairs(model, converted):
            assert np.array_equal(a, b), f"master weights not bit-identical: {path}"
        low = kmp.Policy(policy).compute_dtype
        dtypes = _compute_dtypes(converted)
        wrong = [a for a, d in dtypes.items()
                 if d != ("float32" if a in converted.precision_plan.float32 else low)]
        assert not wrong, f"layers not as planned: {wrong[:3]}"
        the_plan = converted.precision_plan
        result["pins"] = [p.path for p in the_plan.pins]
        result["pin_detail"] = [
            {"path": p.path, "class": p.class_name, "reason": p.reason[:160], "note": p.note,
             "cost": p.cost} for p in the_plan.pins
            if not p.reason.startswith("keep_fp32")]
        for name, part in (("calibration", the_plan.calibration), ("check", the_plan.check)):
            if part is not None and part.fp32_flops is not None:
                result[f"{name}_fp32_flops"] = part.fp32_flops
        if the_plan.check is not None:
            result["check_seconds"] = round(the_plan.check.seconds, 1)
        return converted

    converted = stage("convert", do_convert)

    def do_forward():
        err = relative_error(reference, converted.predict_on_batch(x))
        result["relative_error"] = err
        if err > TOLERANCE[policy]:  # as bad in stock Keras? (e.g. float16 underflow)
            stock_err = stock_error(entry, policy, reference)
            result["stock_relative_error"] = stock_err
            assert err <= 1.5 * stock_err, (
                f"relative error {err:.3g} > {TOLERANCE[policy]} (stock Keras: {stock_err:.3g})"
            )

    stage("forward", do_forward)

    def do_fit():
        use_jit = jit
        if use_jit is None:
            use_jit = keras.backend.backend() == "tensorflow" and policy == "mixed_float16"
        result["jit"] = use_jit
        losses = _fit(converted, entry, policy, _optimizer(policy), _loss(entry), use_jit)
        result["losses"] = losses
        assert np.all(np.isfinite(losses)), f"non-finite losses {losses}"

    stage("fit", do_fit)

    def fp32_round_trip_problem() -> str | None:
        """What goes wrong when the float32 model itself, as built and then trained as the
        converted one was, goes through .keras, if anything."""
        candidates = [(model, "")]
        try:
            trained = copy_model(model)[0]
            _fit(trained, entry, "float32", keras.optimizers.Adam(1e-3), _loss(entry),
                 bool(result.get("jit")))
            candidates.append((trained, " once trained"))
        except Exception:  # noqa: BLE001 - then only the model as built is checked
            pass
        for fp32, how in candidates:
            with tempfile.TemporaryDirectory() as tmp:
                fp32.save(os.path.join(tmp, "fp32.keras"))
                keras.backend.clear_session(free_memory=False)
                again = keras.saving.load_model(os.path.join(tmp, "fp32.keras"), compile=False)
            try:
                if any(not np.array_equal(a, b) for _, a, b in _pairs(fp32, again)):
                    return "weights differ" + how
            except (AssertionError, ValueError):
                return "weights differ" + how
            err = relative_error(fp32(x, training=False), again(x, training=False))
            if err > 1e-6:
                return f"outputs differ ({err:.3g}){how}"
        return None

    def do_save():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                model.save(os.path.join(tmp, "fp32.keras"))
            except Exception as e:  # noqa: BLE001
                result["save_note"] = f"Keras cannot save the float32 model: {_first_line(e)}"
                return
            path = os.path.join(tmp, "m.keras")
            converted.save(path)
            keras.backend.clear_session(free_memory=False)  # as a new process loads it
            loaded = kmp.saving.load_model(path, compile=False)
        try:
            for path, a, b in _pairs(converted, loaded):
                assert np.array_equal(a, b), f"weights differ after loading: {path}"
            a, b = _compute_dtypes(converted, paths_only=True), _compute_dtypes(loaded, True)
            lost = sorted(k for k in a if k in b and a[k] != b[k])
            assert not lost, f"dtypes differ after loading: {lost[:3]}"
            # Eager calls on both sides (XLA fuses differently from the eager kernels).
            err = relative_error(converted(x, training=False), loaded(x, training=False))
            result["save_error"] = err
            assert err <= SAVE_TOLERANCE[policy], f"outputs differ after loading ({err:.3g})"
        except AssertionError:
            problem = fp32_round_trip_problem()
            if problem is None:
                raise
            result["save_note"] = f"the float32 model does not round-trip either: {problem}"

    stage("save", do_save)

    def do_audit():
        data = entry.fit_data(converted, BATCH)
        report = kmp.audit(converted, data)
        assert report.layers and report.verdict, "empty audit"
        result["audit_layers"] = len(report.layers)

    stage("audit", do_audit)
    result["seconds"] = round(time.perf_counter() - start, 1)
    keras.backend.clear_session(free_memory=False)
    return result


def stock_error(entry, policy: str, reference) -> float:
    """The relative error of the model built under Keras' own mixed policy."""
    keras.utils.set_random_seed(0)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        model = entry.build()
        return relative_error(reference, model.predict_on_batch(entry.inputs(BATCH)))
    except Exception:  # noqa: BLE001
        return float("inf")
    finally:
        keras.config.set_dtype_policy(previous)


def stock(entry, policy: str) -> str:
    """Stock Keras mixed precision on the same model: "ok" or the first line of its error.

    The entry is built under Keras' policy and trained three steps with Keras' own loss
    (and, under mixed_float16, Keras' automatic `LossScaleOptimizer`).
    """
    keras.utils.set_random_seed(0)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        model = entry.build()
        out = model.predict_on_batch(entry.inputs(BATCH))
        assert all(np.isfinite(a).all() for a in _floats(out)), "non-finite outputs"
        jit = keras.backend.backend() == "tensorflow"
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=entry.loss(), jit_compile=jit)
        x, y = entry.fit_data(model, BATCH)
        for _ in range(STEPS):
            logs = model.train_on_batch(x, y, return_dict=True)
            assert np.isfinite(float(logs["loss"])), "non-finite loss"
        return "ok"
    except Exception as e:  # noqa: BLE001
        return _first_line(e)
    finally:
        keras.config.set_dtype_policy(previous)
        keras.backend.clear_session(free_memory=False)


def float32(entry) -> str:
    """The float32 model through the same fit (three steps, XLA on TensorFlow): "ok" or
    the first line of its error. A failure float32 has too is not a precision problem."""
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy("float32")
    try:
        model = entry.build()
        losses = _fit(model, entry, "float32", keras.optimizers.Adam(1e-3), entry.loss(),
                      keras.backend.backend() == "tensorflow")
        assert np.all(np.isfinite(losses)), f"non-finite losses {losses}"
        return "ok"
    except Exception as e:  # noqa: BLE001
        return _first_line(e)
    finally:
        keras.backend.clear_session(free_memory=False)
