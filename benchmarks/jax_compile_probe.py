"""Where a JAX train step's compile time and host memory go (issue 34.3), one policy per run.

For a harness workload under a harness policy (`keras_mp.cli.measure`) on the local device:

- `rss`: the process's resident memory sampled every 50 ms, per phase (import, build,
  first step = trace + compile + run, later steps), and `ru_maxrss`;
- `compiles`: every XLA compilation JAX logs (`jax_log_compiles`), by phase and name, and
  the train step's tracing, lowering and XLA compile seconds;
- `step`: the compiled step's `memory_analysis()` (arguments, temporaries, outputs,
  aliased: donated buffers reused), its StableHLO and optimized-HLO sizes and the `copy`
  instructions at its entry (a donated buffer XLA must copy is not reused);
- `update`: the optimizer's `stateless_apply` compiled alone (its HLO size, compile seconds
  and temporaries): the update's share of the step.

    KERAS_BACKEND=jax python benchmarks/jax_compile_probe.py --model cpu_gpt \
        --policy keras_mp_lean_bfloat16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import resource
import sys
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


_TIMING = (
    r"Finished (tracing \+ transforming|tracing|jaxpr to MLIR module conversion|XLA compilation)"
    r" (?:of )?(?:jit\()?train_step\)? .*?in ([\d.]+) sec"
)


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _entry_copies(text: str) -> int:
    entry = text[text.index("\nENTRY") :]
    return len(re.findall(r"= \S+ copy\(%", entry))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cpu_gpt")
    parser.add_argument("--policy", default="keras_mp_lean_bfloat16")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    phase, samples, start = ["import"], [], time.perf_counter()

    def sample():
        while True:
            samples.append((phase[0], _rss_gib()))
            time.sleep(0.05)

    threading.Thread(target=sample, daemon=True).start()
    import jax
    import numpy as np

    compiles = []

    class Log(logging.Handler):
        def emit(self, record):
            compiles.append((phase[0], record.getMessage()))

    jax.config.update("jax_log_compiles", True)
    logger = logging.getLogger("jax")
    logger.addHandler(Log())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    from xla_memory import _abstract

    from keras_mp.cli.measure import model_and_batch
    from keras_mp.cli.workloads import WORKLOADS

    phase[0] = "build"
    model, x, y = model_and_batch(WORKLOADS[args.model], args.policy, True)
    phase[0] = "first_step"
    t = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - t
    phase[0] = "steps"
    for _ in range(args.steps):
        model.train_on_batch(x, y)
    phase[0] = "analysis"

    seconds = {}
    for p, message in compiles:
        m = re.search(_TIMING, message)
        if m and p == "first_step":
            seconds[m.group(1)] = round(float(m.group(2)), 2)
    xla = [(p, m.split(" in ")[0].split("of ")[-1]) for p, m in compiles if "Finished XLA" in m]
    by_phase = {}
    for p, name in xla:
        by_phase.setdefault(p, {}).setdefault(name, 0)
        by_phase[p][name] += 1
    rss = {}
    for p, r in samples:
        rss.setdefault(p, []).append(r)

    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    data = (*_abstract((np.asarray(x), np.asarray(y)), None), None)
    lowered = jax.jit(model.train_step, donate_argnums=0).lower(_abstract(state, None), data)
    compiled = lowered.compile()
    memory, text = compiled.memory_analysis(), compiled.as_text()
    opt = model.optimizer
    tv = [v.value for v in model.trainable_variables]
    grads = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in tv]
    t = time.perf_counter()
    update = (
        jax.jit(lambda o, g, w: opt.stateless_apply(o, g, w), donate_argnums=(0, 2))
        .lower(_abstract([v.value for v in opt.variables], None), grads, _abstract(tv, None))
        .compile()
    )
    update_s = time.perf_counter() - t
    record = {
        "model": args.model,
        "policy": args.policy,
        "first_step_s": round(first, 2),
        "train_step_s": seconds,
        "xla_compiles": by_phase,
        "rss_gib": {p: {"max": round(max(v), 3), "end": round(v[-1], 3)} for p, v in rss.items()},
        "maxrss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "step": {
            "argument_bytes": int(memory.argument_size_in_bytes),
            "temp_bytes": int(memory.temp_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes),
            "alias_bytes": int(memory.alias_size_in_bytes),
            "stablehlo_lines": lowered.as_text().count("\n"),
            "hlo_instructions": text.count(" = "),
            "entry_copies": _entry_copies(text),
        },
        "update": {
            "compile_s": round(update_s, 2),
            "hlo_instructions": update.as_text().count(" = "),
            "temp_bytes": int(update.memory_analysis().temp_size_in_bytes),
        },
        "variables": len(model.trainable_variables),
        "optimizer_variables": len(opt.variables),
        "jax": jax.__version__,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
