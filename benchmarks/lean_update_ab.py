"""The lean update's two paths, side by side: the packed update against the one before it.

    KERAS_BACKEND=tensorflow python benchmarks/lean_update_ab.py compare 8
    KERAS_BACKEND=jax python benchmarks/lean_update_ab.py 0.13M 8

One process: keras_mp `mixed_bfloat16`, `lean_bfloat16` with the update as it ran before
`keras_mp.lean.packing` (`Before`: one `lean_rule` per variable; on TensorFlow the small
variables' rules in one XLA computation, each large one in its own), and `lean_bfloat16` as
it runs now (packed), on one of `lean_speed.py`'s models (batch 16). Each round times 4
`train_on_batch` calls per configuration, the order reversed every other round; prints the
median step of each and the median (min-max) of the rounds' lean/mixed ratios.
"""

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras  # noqa: E402
import lean_speed as ls  # noqa: E402

import keras_mp as kmp  # noqa: E402
from keras_mp.lean.optimizer import LeanOptimizer  # noqa: E402
from keras_mp.lean.packed_step import SMALL as _SMALL  # noqa: E402
from keras_mp.lean.rule import lean_rule  # noqa: E402


class Before(LeanOptimizer):
    """c7b53f3's _backend_update_step (TF: small variables' rules in one XLA computation)."""

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if keras.backend.backend() != "tensorflow":
            return keras.optimizers.Optimizer._backend_update_step(
                self, grads, trainable_variables, learning_rate
            )
        import tensorflow as tf

        small = []
        for g, v in zip(grads, trainable_variables):
            if math.prod(v.shape) >= _SMALL:
                self.update_step(g, v, learning_rate)
            else:
                small.append(self._inputs(g, v, learning_rate))
        if not small:
            return
        statics = tuple(p[0] for p in small)
        cache = self.__dict__.setdefault("_before_rules", {})
        if statics not in cache:
            hyper = self._hyper()

            def rule_all(values):
                return [lean_rule(st, hyper, v) for st, v in zip(statics, values)]

            cache[statics] = tf.function(rule_all, jit_compile=True, autograph=False)
        for new, (_, _, writes) in zip(cache[statics]([p[1] for p in small]), small):
            self._write(new, writes)


class A:
    batch = 16
    length = 128


size = sys.argv[1]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
base, x, y, mk = ls._workload(size, A)
models = {}
for name in ("mixed", "lean_before", "lean_packed"):
    m = kmp.convert(base, "mixed_bfloat16" if name == "mixed" else "lean_bfloat16")
    opt = mk()
    if name == "lean_before":
        opt = Before(opt)
    elif name == "lean_packed":
        opt = LeanOptimizer(opt)
    m.compile(optimizer=opt, loss=kmp.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(3):
        m.train_on_batch(x, y)
    models[name] = m
names = list(models)
per = {k: [] for k in names}
for r in range(reps):
    for k in names if r % 2 == 0 else names[::-1]:
        ts = []
        for _ in range(4):
            s = time.perf_counter()
            models[k].train_on_batch(x, y)
            ts.append(time.perf_counter() - s)
        per[k].append(statistics.median(ts))
rt = [a / b for a, b in zip(per["lean_before"], per["mixed"])]
rp = [a / b for a, b in zip(per["lean_packed"], per["mixed"])]
print(
    keras.backend.backend(),
    size,
    {k: round(1e3 * statistics.median(v), 2) for k, v in per.items()},
    f"before/mixed {statistics.median(rt):.3f} ({min(rt):.2f}-{max(rt):.2f})",
    f"packed/mixed {statistics.median(rp):.3f} ({min(rp):.2f}-{max(rp):.2f})",
    flush=True,
)
