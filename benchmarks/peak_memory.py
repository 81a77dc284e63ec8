"""What is live at a compiled step's peak: XLA's live-range dump, sorted into kinds.

`dump_buffer_assignments()` (before JAX starts) makes XLA write, for each program it
compiles, the buffer assignment and `*-live-range.txt`, whose "Live ranges at N (peak)"
lists every value live at the peak with its bytes. `peak_buffer_record(dump_dir, shapes,
hlo_text)` reads the newest train step's list and sorts each value by the instruction that
made it (the optimised HLO's `op_name`, shapes) into:

- `peak_arguments_gib`: parameters of the step (weights, optimizer state, batch);
- `peak_weight_gradients_gib`: values of the backward pass (`transpose(` in the op name,
  JAX's reverse mode) with as many elements as some trainable variable: the gradients
  held for the update;
- `peak_backward_other_gib`: the other backward values (gradients of activations);
- `peak_forward_saved_gib`: forward values (`jvp(`) kept for the backward pass;
- `peak_other_gib`: the rest (the update's own buffers, constants).

The five add up to the dump's peak. `peak_without_held_gradients_gib` replays the dump's
live ranges with each weight gradient freed where it is made (as an update applied inside
the backward pass, as soon as its gradient is ready, would free it): the step's peak if no
gradient were held for a separate update, everything else as compiled. Used by
`gemma_memory.py --peak-buffers`.
"""

from __future__ import annotations

import glob
import math
import os
import re
import tempfile

__all__ = [
    "dump_buffer_assignments",
    "forward_level",
    "peak_buffer_record",
    "peak_values",
    "phase_peaks",
]

GIB = 2**30
_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):\s*$")
_VALUE = re.compile(r"^\s+(\S+?)\{([0-9,]*)\}: (\d+) bytes")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S.*?) [\w\-]+\(")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*)\[([0-9,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_RANGE = re.compile(r"^\s+(\S+?)\{([0-9,]*)\}:(\d+)-(\d+)\s*$")
_ITEMSIZE = {"pred": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f64": 8, "s64": 8, "u64": 8}


def dump_buffer_assignments(directory: str | None = None) -> str:
    """Makes XLA dump each program's buffer assignment and live ranges to a directory.

    Must run before JAX compiles anything (XLA reads `XLA_FLAGS` once).

    Args:
        directory: where to dump; a new temporary directory when None.

    Returns:
        The directory.
    """
    directory = directory or tempfile.mkdtemp(prefix="xla_peak_")
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_dump_to={directory} --xla_dump_hlo_module_re=.*train_step.*"
    ).strip()
    return directory


def peak_values(live_range_text: str) -> list:
    """`[(value name, tuple index, bytes)]` live at the peak of a `*-live-range.txt`."""
    values, inside = [], False
    for line in live_range_text.splitlines():
        if _PEAK.match(line):
            inside = True
            continue
        if inside:
            found = _VALUE.match(line)
            if not found:
                break
            values.append((found.group(1), found.group(2), int(found.group(3))))
    return values


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    return 1 if dtype.startswith(("f8", "s8", "u8", "s4", "u4")) else 4


def _instructions(hlo_text: str) -> dict:
    """`{name: ([(element count, bytes) of the result's arrays], op_name)}` of a module."""
    found = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        counts = []
        for dtype, dims in _ARRAY.findall(match.group(2)):
            count = math.prod(int(d) for d in dims.split(",") if d)
            counts.append((count, count * _itemsize(dtype)))
        op_name = _OP_NAME.search(line)
        found[match.group(1)] = (counts, op_name.group(1) if op_name else "")
    return found


def peak_buffer_record(dump_dir: str, shapes: list, hlo_text: str) -> dict:
    """The newest train step's peak, sorted into kinds (see the module docstring).

    Args:
        dump_dir: the directory `dump_buffer_assignments` returned.
        shapes: the trainable variables' shapes (per device as the HLO has them).
        hlo_text: the compiled (optimised) module's text, `compiled.as_text()`.

    Returns:
        A dict of GiB per kind, the peak's position and its total.
    """
    files = glob.glob(os.path.join(dump_dir, "*train_step*live-range.txt"))
    if not files:
        raise RuntimeError(f"no *train_step*live-range.txt in {dump_dir}")
    newest = max(files, key=lambda path: int(re.search(r"module_(\d+)", path).group(1)))
    with open(newest) as f:
        text = f.read()
    position = next(int(m.group(1)) for m in map(_PEAK.match, text.splitlines()) if m)
    sizes = {math.prod(shape) for shape in shapes}
    instructions = _instructions(hlo_text)
    kinds = dict.fromkeys(
        ("arguments", "weight_gradients", "backward_other", "forward_saved", "other"), 0
    )
    for name, index, size in peak_values(text):
        kinds[_kind(name, index, instructions, sizes)[0]] += size
    record = {f"peak_{kind}_gib": round(size / GIB, 3) for kind, size in kinds.items()}
    record["peak_position"] = position
    record["peak_live_gib"] = round(sum(kinds.values()) / GIB, 3)
    replayed, held = _replay(text, instructions, sizes)
    # check: within ~1 GiB of memory_analysis()'s peak (each value live from its
    # definition through its last use, no buffer sharing between values)
    record["peak_replayed_gib"] = round(replayed / GIB, 3)
    record["peak_without_held_gradients_gib"] = round(held / GIB, 3)
    return record


def _live_ranges(dump_dir: str) -> str:
    """The newest train step's live-range dump in `dump_dir` (XLA's buffer assignment)."""
    files = glob.glob(os.path.join(dump_dir, "*train_step*live-range.txt"))
    newest = max(files, key=lambda path: int(re.search(r"module_(\d+)", path).group(1)))
    with open(newest) as f:
        return f.read()


def phase_peaks(dump_dir: str, shapes: list, hlo_text: str) -> dict:
    """The replay's peaks by phase of the newest train step: before the first backward-pass
    value (`forward`), up to the last one made (`backward`), after it (`update`); each with
    the weight gradients held (`_held`) and freed where made (`_freed`). GiB. The split
    is at the first value whose `op_name` is the backward pass's: where XLA schedules a
    small one early (the loss's, on a tiny model; stock's 8B step) the forward phase is cut
    short, so read the phases against the peak's kinds.

    Args:
        dump_dir: the directory `dump_buffer_assignments` returned.
        shapes: the trainable variables' shapes (per device).
        hlo_text: the compiled module's text.

    Returns:
        A dict of GiB, keys `phase_{forward,backward,update}_{held,freed}_gib`.
    """
    text = _live_ranges(dump_dir)
    sizes = {math.prod(shape) for shape in shapes}
    instructions = _instructions(hlo_text)
    values = []
    for line in text.splitlines():
        found = _RANGE.match(line)
        if found:
            name, index, start, end = found.groups()
            kind, size = _kind(name, index, instructions, sizes)
            if size:
                backward = "transpose(" in instructions.get(name, ([], ""))[1]
                values.append((int(start), int(end), kind, size, backward))
    first = min(v[0] for v in values if v[4])
    last = max(v[0] for v in values if v[4])
    total = max(v[1] for v in values) + 2
    phases = {"forward": (0, first), "backward": (first, last + 1), "update": (last + 1, total)}
    record = {}
    for held in (True, False):
        live = [0] * (total + 1)
        for start, end, kind, size, _ in values:
            stop = start + 1 if kind == "weight_gradients" and not held else end + 1
            live[start] += size
            live[stop] -= size
        for t in range(1, total + 1):
            live[t] += live[t - 1]
        for phase, (a, b) in phases.items():
            key = f"phase_{phase}_{'held' if held else 'freed'}_gib"
            record[key] = round(max(live[a:b], default=0) / GIB, 3)
    return record


def forward_level(
    dump_dir: str, shapes: list, hlo_text: str, backward=r"transpose\(jvp\(\w*backbone"
) -> float:
    """The replay's highest level (GiB) before the first value whose `op_name` matches
    `backward` (default: the backward pass of a keras_hub backbone, not the loss's, which
    the fused loss makes at the end of the forward pass): the weights and state plus what
    the forward pass keeps for the backward pass, with the loss's own buffers. Where
    `phase_peaks`' forward phase is cut short by an early loss value, this is not.

    Args:
        dump_dir: the directory `dump_buffer_assignments` returned.
        shapes: the trainable variables' shapes (per device).
        hlo_text: the compiled module's text.
        backward: a regular expression for the first backward value's `op_name`.

    Returns:
        GiB.
    """
    text = _live_ranges(dump_dir)
    sizes = {math.prod(shape) for shape in shapes}
    instructions = _instructions(hlo_text)
    pattern = re.compile(backward)
    values, first = [], None
    for line in text.splitlines():
        found = _RANGE.match(line)
        if found:
            name, index, start, end = found.groups()
            _, size = _kind(name, index, instructions, sizes)
            if size:
                values.append((int(start), int(end), size))
                if pattern.search(instructions.get(name, ([], ""))[1]):
                    first = int(start) if first is None else min(first, int(start))
    if first is None:
        return 0.0
    live = [0] * (max(v[1] for v in values) + 2)
    for start, end, size in values:
        live[start] += size
        live[end + 1] -= size
    for t in range(1, len(live)):
        live[t] += live[t - 1]
    return round(max(live[:first], default=0) / GIB, 3)


def _kind(name: str, index: str, instructions: dict, sizes: set) -> tuple:
    """`(kind, bytes or None)` of value `name{index}` (bytes from its HLO shape)."""
    arrays, op_name = instructions.get(name, ([], ""))
    position = int(index.split(",")[0]) if index else 0
    count, size = arrays[position] if position < len(arrays) else (None, None)
    if name.startswith(("state_", "data_")) or op_name.startswith(("state[", "data[")):
        return "arguments", size
    if "transpose(" in op_name:
        return ("weight_gradients" if count in sizes else "backward_other"), size
    if "jvp(" in op_name:
        return "forward_saved", size
    return "other", size


def _replay(text: str, instructions: dict, sizes: set) -> tuple:
    """`(peak, peak with each weight gradient live only where it is made)`, in bytes,
    from the dump's live ranges and the values' HLO shapes."""
    starts, ends = {}, {}
    as_made = {}
    for line in text.splitlines():
        found = _RANGE.match(line)
        if not found:
            continue
        name, index, start, end = found.groups()
        kind, size = _kind(name, index, instructions, sizes)
        if not size:
            continue
        start, end = int(start), int(end)
        starts[start] = starts.get(start, 0) + size
        ends[end + 1] = ends.get(end + 1, 0) + size
        if kind == "weight_gradients" and end > start:
            as_made[start + 1] = as_made.get(start + 1, 0) - size
            as_made[end + 1] = as_made.get(end + 1, 0) + size
    peak = held = live = freed = 0
    for t in sorted(set(starts) | set(ends) | set(as_made)):
        live += starts.get(t, 0) - ends.get(t, 0)
        freed += as_made.get(t, 0)
        peak, held = max(peak, live), max(held, live + freed)
    return peak, held
