"""The classification behind `kmp.fingerprint.diff`: bounds, events and causes.

Private; the criterion is stated in `keras_mp.fingerprint`'s docstring and in
`docs/reproducibility.md`. Numpy only.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["Run", "classify"]


def _per_step(records: list, key: str) -> dict:
    out = {}
    for r in records:
        values = r.get(key) or []
        for i, v in enumerate(values):
            out[r["step"] - len(values) + 1 + i] = v
    return out


class Run:
    """One fingerprint, indexed for comparison."""

    def __init__(self, data: dict):
        self.meta = data.get("meta", {})
        self.records = {r["step"]: r for r in data["records"]}
        self.losses = _per_step(data["records"], "losses")
        tracked = all(r.get("skipped") is not None for r in data["records"])
        self.skips = (
            {s for r in data["records"] for s in r.get("skipped_steps", [])} if tracked else None
        )

    def sketch(self, step: int) -> np.ndarray:
        return np.array([v[4] for v in self.records[step]["vars"]], dtype=np.float64)


def _spread(A: Run, B: Run) -> float:
    """Median |loss(s) - loss(s-1)| over both runs: how much a batch changes the loss."""
    steps = []
    for run in (A, B):
        ls = run.losses
        steps += [
            abs(ls[s] - ls[s - 1])
            for s in ls
            if ls.get(s) is not None and ls.get(s - 1) is not None
        ]
    return float(np.median(steps)) if steps else 0.0


class _State:
    """What the comparison has seen so far."""

    def __init__(self, n: int):
        self.s2 = np.zeros(n)  # sum over records of the squared motion, per variable
        self.prev = None  # (sketch A, sketch B, step, distances)
        self.identical = True
        self.worst = None  # (ratio, fields) of the record closest to the bound
        self.ratios: list = []  # the model's distance / bound per record
        self.loss_gap = 0.0  # the largest |loss difference| / tolerance so far


def _distances(A, B, k, st, size, u_c, u_w, factor):
    """Per variable and for the whole model: (same, distance, bound, model distance, bound)."""
    ra, rb = A.records[k], B.records[k]
    za, zb = A.sketch(k), B.sketch(k)
    same = np.array([x[0] == y[0] for x, y in zip(ra["vars"], rb["vars"])])
    with np.errstate(all="ignore"):
        dist = np.where(same, 0.0, np.linalg.norm(za - zb, axis=1))
        if st.prev is not None:
            motion = np.maximum(
                np.linalg.norm(za - st.prev[0], axis=1), np.linalg.norm(zb - st.prev[1], axis=1)
            )
            st.s2 += np.nan_to_num(motion, nan=0.0, posinf=0.0) ** 2
        norm = np.array([max(x[2], y[2]) for x, y in zip(ra["vars"], rb["vars"])])
        norm2 = np.nan_to_num(norm**2 * size, nan=0.0, posinf=0.0)
        stored = u_w**2 * max(k, 1) * norm2
        bound = factor * np.sqrt(u_c * st.s2 + stored)
        floats = u_w > 0  # integer variables (seed states): any difference counts
        dist = np.where(~same & (~floats | ~np.isfinite(dist)), np.inf, dist)
        total = float(np.sqrt(np.sum(dist**2)))
        total_bound = float(factor * np.sqrt(u_c * st.s2.sum() + stored.sum()))
    st.prev_sketches = (za, zb)
    return same, dist, bound, total, total_bound


def classify(
    A: Run,
    B: Run,
    common: list,
    variables: list,
    u_c: float,
    u_w,
    size,
    factor: float,
    loss_factor: float,
    recipe: list,
) -> dict:
    """Walks the common records in order; returns the fields of a `DiffReport`."""
    spread = _spread(A, B)
    st = _State(len(variables))
    for n, k in enumerate(common):
        lo = st.prev[2] + 1 if st.prev else 0
        event = _first_event(A, B, lo, k, spread, u_c, loss_factor, st)
        same, dist, bound, total, total_bound = _distances(A, B, k, st, size, u_c, u_w, factor)
        ra, rb = A.records[k], B.records[k]
        scale_split = ra.get("scale") != rb.get("scale")
        drift = ra.get("replica_drift") or rb.get("replica_drift")
        if not (
            same.all()
            and ra["optimizer_hash"] == rb["optimizer_hash"]
            and not scale_split
            and all(A.losses.get(s) == B.losses.get(s) for s in range(lo, k + 1))
        ):
            st.identical = False
        beyond = not same.all() and (k == 0 or bool(recipe) or total > total_bound)
        if event or beyond or scale_split or drift:
            return _diverged(
                A,
                B,
                k,
                st,
                variables,
                same,
                dist,
                bound,
                total,
                total_bound,
                event,
                scale_split,
                drift,
                recipe,
                n + 1,
                spread,
            )
        ratio = total / total_bound if total_bound > 0 else 0.0
        st.ratios.append(ratio)
        if total > 0 and (st.worst is None or ratio > st.worst[0]):
            st.worst = (
                ratio,
                {
                    "distance": total,
                    "bound": total_bound,
                    "record_step": k,
                    **_variable_fields(variables, same, dist, bound, closest=True),
                },
            )
        st.prev = (*st.prev_sketches, k, dist)
    if st.identical:
        return {"verdict": "identical", "record_step": common[-1], "steps_compared": len(common)}
    evidence = []
    gap = _largest_loss_gap(A, B, common[-1])
    if gap is not None:
        evidence.append(
            f"largest loss difference: {gap:.3g} ({st.loss_gap:.2g}x its tolerance; "
            f"median step-to-step loss change {spread:.3g})"
        )
    if st.worst is None:
        evidence.append("the weights agree bit for bit; only the losses or optimizer state differ")
    return {
        "verdict": "rounding",
        **(st.worst[1] if st.worst else {}),
        "evidence": tuple(evidence),
        "steps_compared": len(common),
    }


def _variable_fields(variables, same, dist, bound, closest=False, onset=False) -> dict:
    """The variable to name. `onset` (the weights agreed bit for bit at the record before):
    the first in model order that differs; else the first beyond its own bound, or else
    the one closest to it (always the closest with `closest`)."""
    if same.all():
        return {}
    with np.errstate(all="ignore"):
        ratios = np.where(same, -1.0, np.where(bound > 0, dist / bound, np.inf))
    if onset and not closest:
        i = int(np.argmax(~same))
    elif (ratios > 1).any() and not closest:
        i = int(np.argmax(ratios > 1))
    else:
        i = int(np.argmax(ratios))
    return {
        "variable": variables[i]["path"],
        "variable_distance": float(dist[i]),
        "variable_bound": float(bound[i]),
    }


def _loss_tolerance(a: float, b: float, spread: float, u_c: float, loss_factor: float) -> float:
    # Rounding moves a loss by about a unit roundoff of it; another batch, by about the
    # loss' own step-to-step spread.
    return max(loss_factor * spread, u_c * max(abs(a), abs(b)))


def _first_event(A, B, lo, k, spread, u_c, loss_factor, st):
    """The first step in [lo, k] with a skip or loss that differs: (kind, step) or None."""
    for s in range(max(lo, 1), k + 1):
        if A.skips is not None and B.skips is not None and (s in A.skips) != (s in B.skips):
            return ("skip", s)
        la, lb = A.losses.get(s), B.losses.get(s)
        if (la is None) != (lb is None) and s in A.losses and s in B.losses:
            return ("nonfinite", s)
        if la is not None and lb is not None:
            tol = _loss_tolerance(la, lb, spread, u_c, loss_factor)
            gap = abs(la - lb) / tol if tol > 0 else (0.0 if la == lb else math.inf)
            if gap > 1:
                return ("loss", s)
            st.loss_gap = max(st.loss_gap, gap)
    return None


def _largest_loss_gap(A: Run, B: Run, last: int):
    gaps = [
        abs(A.losses[s] - B.losses[s])
        for s in A.losses
        if s <= last and A.losses.get(s) is not None and B.losses.get(s) is not None
    ]
    return max(gaps) if gaps else None


def _steps(steps) -> str:
    steps = sorted(steps)
    return ", ".join(map(str, steps[:5])) + (" ..." if len(steps) > 5 else "")


def _diverged(
    A,
    B,
    k,
    st,
    variables,
    same,
    dist,
    bound,
    total,
    total_bound,
    event,
    scale_split,
    drift,
    recipe,
    compared,
    spread,
):
    lo = st.prev[2] + 1 if st.prev else 0
    evidence, causes = [], []
    step = event[1] if event else k
    if k == 0 and not same.all():
        causes.append("different initial weights (another seed or initialization)")
    if event and event[0] == "skip":
        only_a = sorted(s for s in A.skips - B.skips if s <= k)
        only_b = sorted(s for s in B.skips - A.skips if s <= k)
        text = "; ".join(
            [f"step {_steps(only_a)} skipped in A only"] * bool(only_a)
            + [f"step {_steps(only_b)} skipped in B only"] * bool(only_b)
        )
        causes.append(f"a skipped step in one run only ({text}: non-finite gradients in one run)")
    if event and event[0] == "nonfinite":
        which = "A" if A.losses.get(step) is None else "B"
        causes.append(f"a non-finite loss at step {step} in {which} only (a bad batch in one run)")
    if recipe:
        causes.append("different training settings: " + "; ".join(recipe))
        if event and event[0] == "loss":  # settings act on updates: the one before differed
            step = max(step - 1, lo)
    if scale_split:
        causes.append(
            f"the loss-scale path split: scale {A.records[k].get('scale')} in A, "
            f"{B.records[k].get('scale')} in B at step {k}"
        )
    if drift:
        names = ", ".join(variables[i]["path"] for i in drift[:3])
        causes.append(f"replicas disagree within a run at step {k} on {names} (a replica drifted)")
    gradual = bool(st.ratios) and st.ratios[-1] >= 0.25 or st.loss_gap >= 0.25
    if event and event[0] == "loss":
        la, lb = A.losses[step], B.losses[step]
        text = (
            f"the loss of step {step} differs: {la:.6g} in A, {lb:.6g} in B "
            f"(median step-to-step change {spread:.3g})"
        )
        agreed = st.prev is not None and not (st.prev[3] > 0).any()
        if step == lo and agreed:
            why = (
                "different first batch (data order, shuffling or preprocessing)"
                if step == 1
                else f"the batch of step {step} differs (data order, or a different shard)"
            )
            causes.append(f"{why}: {text}, with identical weights before it")
        elif step == lo or not gradual:
            causes.append(
                f"the batch of step {step} differs, or the update of step {step - 1} did: {text}"
            )
        else:
            evidence.append(text)
    if not causes:
        if gradual:
            causes.append(
                "no discrete event: the runs differed at rounding level before and grew apart "
                f"gradually (at step {st.prev[2]}: weights {st.ratios[-1]:.2g}x their bound, "
                f"losses {st.loss_gap:.2g}x their tolerance): rounding amplified by training "
                "(expected in long runs), or a nondeterministic op"
            )
        else:
            causes.append(
                f"the update of a step in {lo}-{k} differs while the losses agree (a lost or "
                "different update: learning rate, optimizer state, gradient)"
            )
    return {
        "verdict": "diverged",
        "step": step,
        "cause": causes[0] if causes else evidence[0],
        "record_step": k,
        "loss_step": step if event and event[0] == "loss" else None,
        "evidence": tuple(causes[1:] + evidence),
        "steps_compared": compared,
        "distance": total,
        "bound": total_bound,
        **_variable_fields(
            variables, same, dist, bound, onset=st.prev is None or not (st.prev[3] > 0).any()
        ),
    }
