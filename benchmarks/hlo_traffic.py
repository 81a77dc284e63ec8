"""Kernels of a compiled XLA module and the bytes each one reads and writes.

Element-wise work on a GPU runs at memory speed: the bytes its kernels move, over the
memory bandwidth (4.8 TB/s on an H200), bound its time from below. This reads the optimized
HLO text of a compiled step (`compiled.as_text()`) and counts, for each top-level kernel
(fusion, custom call, copy, ...), its operands' and its output's bytes, by kind:
`gemm` (matmuls: cuBLAS calls, GEMM fusions, XLA:CPU's dots), `conv` (cuDNN or XLA:CPU
convolutions), `attention` (cuDNN flash attention) and `other` (everything else:
element-wise and reduction fusions, copies). A `conditional` counts its costliest branch, a
`while` its body once. Numbers are upper bounds for kernels that read only part of an
operand (a dynamic slice), and ignore caches.

Example:

```python
traffic = kernel_traffic(jax.jit(step).lower(*args).compile().as_text())
traffic["other"]["gib"], traffic["other"]["kernels"], traffic["copies"]
```
"""

from __future__ import annotations

import math
import re

__all__ = ["KINDS", "dot_flops", "kernel_traffic", "origin"]

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
_CALLEES = re.compile(
    r"branch_computations=\{[^}]*\}|true_computation=%[\w.\-]+, false_computation=%[\w.\-]+"
    r"|body=%[\w.\-]+|to_apply=%[\w.\-]+"
)
_FREE = {
    "parameter", "tuple", "get-tuple-element", "bitcast", "constant", "opt-barrier",
    "after-all", "partition-id", "replica-id",
}  # fmt: skip
KINDS = ("gemm", "conv", "attention", "other")


def _nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _BYTES[dtype]
    return total


def _computations(text: str) -> tuple[dict, str]:
    bodies, entry, name = {}, None, None
    for line in text.splitlines():
        header = re.match(r"^(ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            name = header.group(2)
            bodies[name] = []
            entry = name if header.group(1) else entry
        elif line.startswith("}"):
            name = None
        elif name:
            bodies[name].append(line)
    return bodies, entry


def _kind(bodies: dict, opcode: str, rest: str) -> str:
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    target = target.group(1) if target else ""
    inside = ""
    if opcode == "fusion" and "kind=kCustom" in rest:  # GEMM fusions (GPU), dot fusions (CPU)
        callee = re.search(r"calls=%([\w.\-]+)", rest)
        inside = "\n".join(bodies.get(callee.group(1), ())) if callee else ""
    if "fmha" in target:
        return "attention"
    if "cudnn$conv" in target or opcode == "convolution" or " convolution(" in inside:
        return "conv"
    if "gemm" in target or "atmul" in target or opcode == "dot" or " dot(" in inside:
        return "gemm"
    return "other"


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYER = re.compile(r"jvp\(([\w.\-]+)\)")


def origin(op_name: str, fused=()) -> str:
    """Where a kernel comes from, read off its root's `op_name` metadata (and, where that
    names no layer, the `op_name`s `fused` into it): `forward <layer kind>` or `backward
    <layer kind>` (the Keras layer's name, block number dropped: `ln_attn`, `ffn_in`,
    `compile_loss`, ...), `update` (the optimizer's scope: a skip's select fused into an
    update counts here), `finite check` (the test and skip of a non-finite step on its
    own), or `other`."""
    layer = _LAYER.search(op_name)
    if layer:
        phase = "backward" if "transpose(" in op_name else "forward"
        kind = re.sub(r"_\d+$", "", layer.group(1))
        return f"{phase} {kind}"
    joined = " ".join([op_name, *fused])
    if re.search(r"adam|lean|loss_scale|sgd|optimizer|iteration", joined, re.I):
        return "update"
    if re.search(r"is_finite|reduce_and|select_n|_where|isfinite|nonfinite", joined):
        return "finite check"
    return "other"


def _count(bodies: dict, computation: str, by_origin: dict | None = None) -> dict:
    totals = {kind: [0, 0] for kind in KINDS} | {"copies": 0, "conditionals": 0}
    sizes = {}
    for line in bodies[computation]:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, opcode, operands, rest = match.groups()
        sizes[name] = _nbytes(shape)
        if opcode in _FREE:
            continue
        if opcode in ("conditional", "while", "call"):
            callees = re.findall(r"%([\w.\-]+)", _CALLEES.search(rest).group(0))
            inner = max(
                (_count(bodies, c, by_origin) for c in callees),
                key=lambda t: sum(t[k][1] for k in KINDS),
            )
            for key, value in inner.items():
                if key in KINDS:
                    totals[key] = [a + b for a, b in zip(totals[key], value)]
                else:
                    totals[key] += value
            totals["conditionals"] += opcode == "conditional"
            continue
        read = sum(sizes.get(o.strip().lstrip("%"), 0) for o in operands.split(","))
        kind = _kind(bodies, opcode, rest)
        totals[kind][0] += 1
        totals[kind][1] += read + sizes[name]
        totals["copies"] += opcode == "copy"
        if by_origin is not None and kind == "other":
            root = _OP_NAME.search(rest)
            callee = re.search(r"calls=%([\w.\-]+)", rest)
            body = bodies.get(callee.group(1), ()) if callee else ()
            fused = [n for line in body for n in _OP_NAME.findall(line)]
            group = by_origin.setdefault(origin(root.group(1) if root else "", fused), [0, 0])
            group[0] += 1
            group[1] += read + sizes[name]
    return totals


def kernel_traffic(hlo_text: str) -> dict:
    """Kernels and bytes moved by a compiled module, by kind.

    Args:
        hlo_text: The optimized HLO of a compiled computation (`compiled.as_text()`).

    Returns:
        `{"gemm" | "conv" | "attention" | "other": {"kernels": int, "gib": float}, "copies": int,
        "conditionals": int, "other_by_origin": {origin: {"kernels": int, "gib": float}}}`:
        kernel counts and GiB read + written per execution, with each conditional's
        costliest branch; the `other` kernels also by `origin`, largest traffic first (there
        a conditional's branches all count: an upper bound).
    """
    bodies, entry = _computations(hlo_text)
    groups: dict = {}
    totals = _count(bodies, entry, groups)
    out = {k: {"kernels": totals[k][0], "gib": round(totals[k][1] / 2**30, 3)} for k in KINDS}
    out.update(copies=totals["copies"], conditionals=totals["conditionals"])
    ordered = sorted(groups.items(), key=lambda kv: -kv[1][1])
    out["other_by_origin"] = {
        k: {"kernels": n, "gib": round(b / 2**30, 3)} for k, (n, b) in ordered
    }
    return out


def dot_flops(hlo_text: str) -> float:
    """The matmul FLOPs of a compiled module: `2 × output elements × contracted size` of
    every `dot` reached from the entry (inside GEMM fusions too; a `while` body once). Sees
    what XLA's optimisations add (its rematerialisation's recomputed matmuls), which the
    cost analysis of the lowered module does not; cuDNN/cuBLAS custom calls count 0.

    Args:
        hlo_text: `compiled.as_text()`.

    Returns:
        FLOPs (float).
    """
    bodies, entry = _computations(hlo_text)
    shapes = {}
    for lines in bodies.values():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m:
                shapes[m.group(1)] = m.group(2)

    def dims(shape: str) -> list:
        found = _ARRAY.search(shape)
        return [int(d) for d in found.group(2).split(",") if d] if found else []

    def flops(name: str, seen: tuple) -> float:
        total = 0.0
        for line in bodies.get(name, ()):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            _, shape, opcode, operands, rest = m.groups()
            if opcode == "dot":
                lhs = re.findall(r"%([\w.\-]+)", operands)
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
                if lhs and contracting and lhs[0] in shapes:
                    size = dims(shapes[lhs[0]])
                    k = math.prod(size[int(i)] for i in contracting.group(1).split(",") if i)
                    total += 2.0 * math.prod(dims(shape)) * k
            for callee in re.findall(r"(?:calls|body)=%([\w.\-]+)", rest):
                if callee not in seen:
                    total += flops(callee, (*seen, callee))
        return total

    return flops(entry, (entry,))
