"""The run check: a converted model must run in its compute dtype; what cannot is pinned.

Some layers cannot run in a low dtype at all: an op without a float16 kernel (keras_hub's
`ESMRotaryEmbedding` builds a `range` in its compute dtype, which TensorFlow has no
float16 kernel for), or a backward pass XLA cannot compile (TensorFlow's XLA gradient of a
bilinear resize in float16/bfloat16). `repair` runs the converted model on one batch with
every layer's `call` watched (`keras_mp.conversion.probe`'s hooks): the innermost layer whose call
raised is pinned to float32, alone (its own math; its sublayers keep their dtype), and the
model is converted and run again. Layers of the same keras_hub/user class are pinned in the
same round (same code, same failure); Keras' own layers one at a time. A pin that makes its
parent fail (a float32 output in a block's low-precision math) is followed by the parent's
pin, so the smallest enclosing layer that runs is what ends up pinned. With `train=True`
one gradient step (XLA on TensorFlow, `jax.jit` on JAX) is compiled and run too; where it
fails, the layers that resize (`interpolation`, not nearest) are pinned, the usual culprit.

Each pin's reason is the first line of the error it fixed; the FLOP shares go in the
plan (`Plan.check`). Nothing here imports TensorFlow at module level.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable

import keras

import keras_mp.keep_list as keep_list
from keras_mp.conversion import calibration
from keras_mp.conversion.trial import (
    RunFailure,
    finite_outputs,
    forward_failure,
    large_ids,
    sample_inputs,
    train_failure,
)
from keras_mp.keras_glue.quiet import ignoring

__all__ = [
    "CHECKS",
    "RunCheck",
    "alone",
    "checked",
    "large_ids",
    "repair",
    "run_check",
    "wants_train_check",
]

CHECKS = ("auto", "forward", "train")
_ROUNDS = 16


@dataclasses.dataclass
class RunCheck:
    """What the run check did (a plan's `check`).

    Attributes:
        mode: "forward" (one eager call) or "train" (also one compiled gradient step).
        inputs: where the batch came from ("calibration batch", "model.inputs").
        pinned: `address -> reason` of the layers the check pinned.
        checked: whether the converted model ran (False: the check could not run; see
            `notes`).
        finite: whether its outputs were finite on the batch (None: not run).
        seconds: the time the check took.
        fp32_flops: share of the model's matmul FLOPs in float32 (every pin).
        check_flops: share of them that the check's pins added.
        notes: what the check could not do.
    """

    mode: str
    inputs: str = ""
    pinned: dict = dataclasses.field(default_factory=dict)
    checked: bool = False
    finite: bool | None = None
    seconds: float = 0.0
    fp32_flops: float | None = None
    check_flops: float | None = None
    notes: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> list:
        lines = [
            f"run check ({self.mode}, {self.inputs or 'no batch'}): "
            + (
                f"{len(self.pinned)} layer(s) pinned because they cannot run in the compute dtype"
                if self.checked
                else "not run"
            )
            + f" ({self.seconds:.1f} s)"
        ]
        if self.pinned and self.fp32_flops is not None:
            lines.append(
                f"cost: {100 * self.fp32_flops:.1f}% of the matmul FLOPs run in float32 "
                f"({100 * (self.check_flops or 0):.1f}% for the run check)"
            )
        return lines + [f"note: {n}" for n in self.notes]


def _resizes(layer) -> bool:
    method = getattr(layer, "interpolation", None)
    return isinstance(method, str) and method != "nearest"


def wants_train_check(model: keras.Model, the_plan) -> list:
    """The addresses of layers that resize bilinearly (or by any interpolation but nearest)
    in the low dtype on TensorFlow, whose gradient TensorFlow's XLA fails to compile in
    float16 and bfloat16 (measured on keras_hub's DeepLabV3, SegFormer and BASNet): what
    makes `check="auto"` compile a gradient step. Empty on other backends."""
    if keras.backend.backend() != "tensorflow":
        return []
    layers, _ = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    return [where[id(x)] for x in layers if _resizes(x) and where[id(x)] not in the_plan.float32]


def _same_kind(layer, layers) -> list:
    """`layer`, and the layers of its class where that class is not Keras' own."""
    if type(layer).__module__.startswith("keras."):
        return [layer]
    return [x for x in layers if type(x) is type(layer)]


_NO_SKIP = (
    " (check=None would only skip this check: the converted model would fail the same way "
    "when called)"
)


def _error(address, error: str, dtype: str, why: str, in_float32: bool = False) -> ValueError:
    if in_float32:  # the layer is float32 already and fails: no pin can fix it
        return ValueError(
            f"convert: the converted model cannot run: {why} at layer {address!r}, which "
            f"fails in float32 too (it is pinned): {error}. This is not a precision problem "
            "that the keep-list can fix; the float32 source model runs on the same batch, so "
            "the conversion left this layer inconsistent (e.g. weights in another dtype than "
            f"it computes in). Please report it with the model{_NO_SKIP}."
        )
    return ValueError(
        f"convert: the converted model cannot run in {dtype}: {why} at layer {address!r}: "
        f"{error}. Pin it with `keep_fp32` (e.g. kmp.Policy(policy, keep_fp32=[*kmp."
        f"DEFAULT_KEEP_FP32, {address!r}])){_NO_SKIP}."
    )


def repair(
    model: keras.Model,
    make_plan: Callable,
    convert: Callable,
    x,
    train: bool = False,
    inputs: str = "",
    pinned: dict | None = None,
) -> tuple:
    """Converts `model`, runs the result on `x`, and pins what fails, until it runs.

    Args:
        model: The source model (float32).
        make_plan: `exact -> Plan`, where `exact` maps source addresses to reasons (layers
            pinned alone, see `keep_list.plan`).
        convert: `Plan -> converted model`.
        x: One batch of inputs.
        train: Also compile and run one gradient step.
        inputs: Where `x` came from (for the report).
        pinned: Pins already found (address -> reason), kept.

    Returns:
        `(plan, converted model, RunCheck)`; the plan's `check` is the RunCheck.

    Raises:
        ValueError: naming the layer and the option, when a failure cannot be pinned
            away (it is not in a layer, pinning did not fix it, or float32 fails too).
    """
    began = time.perf_counter()
    result = RunCheck("train" if train else "forward", inputs)
    exact = dict(pinned or {})
    layers, parents = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    source = {where[id(x_)]: x_ for x_ in layers}
    the_plan = make_plan(exact)
    new = convert(the_plan)
    dtype = the_plan.policy.compute_dtype
    fp32_ok = None
    trained = not train
    for _ in range(_ROUNDS):
        finite = []
        failure = forward_failure(new, x, finite)
        stage = "its forward pass fails"
        if failure is None and not trained:
            error = train_failure(new, x)
            if error is None:
                trained = True
            else:
                stage = "its compiled gradient step fails"
                failure = RunFailure(None, None, error)
        if failure is None:
            result.checked, result.finite = True, finite[-1]
            break
        if fp32_ok is None:  # a batch float32 cannot run either says nothing about dtypes
            fp32_ok = forward_failure(model, x) is None and (
                stage.startswith("its forward") or train_failure(model, x) is None
            )
            if not fp32_ok:
                result.notes.append(f"the float32 model fails on this batch too ({failure.error})")
                break
        if failure.address is None and stage.startswith("its compiled"):
            low = [
                a for a, layer in source.items() if _resizes(layer) and a not in the_plan.float32
            ]
            if not low:
                raise _error(model.name, failure.error, dtype, stage)
            for a in low:
                exact[a] = f"run check: gradient step fails in {dtype} ({failure.error[:100]})"
        else:
            target = source.get(failure.address)
            if target is None:
                raise _error(failure.address or model.name, failure.error, dtype, stage)
            if failure.address in the_plan.float32:  # pinned already: its parent next
                target = parents.get(id(target))
                if (
                    target is None
                    or isinstance(target, keras.Model)
                    or (where[id(target)] in the_plan.float32)
                ):
                    raise _error(failure.address, failure.error, dtype, stage, in_float32=True)
            for layer in _same_kind(target, layers):
                a = where[id(layer)]
                if a not in the_plan.float32:
                    exact[a] = f"run check: {failure.error[:120]}"
        the_plan = make_plan(exact)
        new = convert(the_plan)
    else:
        layer = source.get(failure.address)
        kind = f" ({type(layer).__name__}; the class name pins all of them)" if layer else ""
        raise _error(
            failure.address or model.name,
            f"{failure.error}; {len(exact)} layer(s) pinned in {_ROUNDS} rounds and it still "
            f"fails{kind}",
            dtype,
            stage,
        )
    result.pinned = {a: r for a, r in exact.items() if a in the_plan.float32}
    result.seconds = time.perf_counter() - began
    the_plan.check = result
    new.precision_plan = the_plan
    return the_plan, new, result


def checked(
    model, the_plan, x, inputs: str, train: bool, convert: Callable, pinned: dict | None = None
) -> keras.Model:
    """`convert(the_plan)`, run on `x`, with the pins `repair` finds added to the plan and
    their FLOP shares measured (on the calibration's ranges, else one traced call).

    Args:
        model: The source model.
        the_plan: The keep-list's (or calibrated) plan.
        x: One batch of inputs.
        inputs: Where `x` came from (for the report).
        train: Also compile and run one gradient step.
        convert: `Plan -> converted model`.
        pinned: Run-check pins found before (address -> reason), kept.

    Returns:
        The converted model; its `precision_plan.check` is the `RunCheck`.
    """
    policy, cal = the_plan.policy, the_plan.calibration
    layers, _ = keep_list.layer_tree(model)
    where = keep_list.addresses(model)
    layer_at = {where[id(layer)]: layer for layer in layers}
    extra = [(layer_at[a], r) for a, r in (cal.pinned if cal else {}).items() if a in layer_at]
    tight = dict(cal.tight) if cal else {}

    def make_plan(exact: dict):
        if not exact:
            return the_plan
        exact = {**tight, **exact}
        result = keep_list.plan(
            model, policy, extra=extra, exact=[(layer_at[a], r) for a, r in exact.items()]
        )
        result.calibration, result.notes = cal, [*the_plan.notes, *result.notes]
        return result

    with ignoring(UserWarning):  # warned once already (keeps Keras' show-once record)
        new_plan, new, check = repair(
            model, make_plan, convert, x, train=train, inputs=inputs, pinned=pinned
        )
    if check.pinned or cal is not None:  # each pin's share of the FLOPs
        ranges = cal.ranges if cal is not None else calibration.measure(model, [(x, None)])
        new_plan.pins = [_with_cost(p, ranges, new_plan.float32) for p in new_plan.pins]
    if check.pinned:
        check.fp32_flops, check.check_flops = calibration.flop_shares(
            ranges, new_plan.float32, set(check.pinned)
        )
        if cal is not None:
            base = keep_list.plan(model, policy).float32
            cal.fp32_flops, cal.range_flops = calibration.flop_shares(
                ranges, new_plan.float32, new_plan.float32 - base - set(check.pinned)
            )
    return new


def _with_cost(pin, ranges: dict, float32: set):
    """`pin` with its share of the matmul FLOPs (the layer, and its pinned sublayers)."""
    total = sum(r.flops for r in ranges.values())
    if not total:
        return pin
    own = [pin.path] + (
        [] if pin.note == keep_list.ALONE else [a for a in float32 if a.startswith(pin.path + "/")]
    )
    return dataclasses.replace(pin, cost=sum(ranges[a].flops for a in own if a in ranges) / total)


def run_check(
    model,
    the_plan,
    new,
    x,
    inputs: str,
    check: str,
    convert: Callable,
    recalibrate: Callable | None,
) -> keras.Model:
    """What `convert(..., check=check)` does after planning.

    Args:
        model: The source model.
        the_plan: The plan so far (keep-list, calibration).
        new: The model converted under it, if calibration made one (else None).
        x: The first calibration batch, or None (a batch is made from `model.inputs`).
        inputs: Where `x` came from.
        check: "auto", "forward" or "train".
        convert: `Plan -> converted model`.
        recalibrate: `batch -> calibrated plan`, used when the converted model's outputs
            are non-finite in float16 on the check's batch though float32's are finite
            (None: the user calibrated already).

    Returns:
        The converted, checked model.
    """
    policy = the_plan.policy
    if x is None:
        x, inputs = large_ids(model, sample_inputs(model)), "made from model.inputs"
    if x is None:
        the_plan.notes.append(
            "run check skipped: the model has no input specs; pass a batch as `calibrate`"
        )
        return new if new is not None else convert(the_plan)
    resizing = wants_train_check(model, the_plan)
    if check == "forward" and resizing:
        the_plan.notes.append(
            f"{resizing[:3]} resize in {policy.compute_dtype}: TensorFlow's XLA may fail to "
            "compile their gradient; convert(..., check='train') checks and pins them"
        )
    train = check == "train" or (check == "auto" and bool(resizing))
    new = checked(model, the_plan, x, inputs, train, convert)
    if (
        recalibrate is not None
        and policy.compute_dtype == "float16"
        and new.precision_plan.check.finite is False
        and finite_outputs(model, x)
    ):
        found = new.precision_plan.check.pinned
        the_plan = recalibrate(x)
        the_plan.notes.append(
            f"non-finite outputs in float16 on the run check's batch ({inputs}): calibrated "
            "on it; pass your own batches as `calibrate`"
        )
        new = checked(model, the_plan, x, inputs, train, convert, pinned=found)
    return new


def alone(pmap, the_plan: keep_list.Plan, model: keras.Model):
    """`pmap` for the pins of a layer's own math only: no `"path/.*"` key (nested pins'
    patterns would both match), and an exact key for each sublayer with a path, saved with
    the model, so that a loaded model does not take the pin for its whole subtree."""
    alone = [p.path for p in the_plan.pins if p.note == keep_list.ALONE]
    if not alone:
        return pmap
    for key in [k for k in pmap._policy_map if k.endswith("/.*")]:
        if any(re.fullmatch(key[:-3], a) for a in alone):
            del pmap._policy_map[key]
    where = keep_list.addresses(model)
    base = keras.DTypePolicy(the_plan.policy.base.name)
    for layer in keep_list.layer_tree(model)[0]:
        a = where[id(layer)]
        if layer.path and a not in the_plan.float32 and any(a.startswith(p + "/") for p in alone):
            pmap[re.escape(layer.path)] = base
    return pmap
