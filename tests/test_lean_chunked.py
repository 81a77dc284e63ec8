"""The lean update of a large matrix in row blocks (`keras_mp.lean.chunked`, issue 54 lever 2).

Bit for bit the unchunked update: the same weights, moments and averages after two
AdamW steps (compiled, as `fit` runs them: on JAX eager op-by-op arithmetic may differ
from a compiled loop's by an ulp), with the default state (stochastic rounding, 4-bit
first moment, factored second) and with Kahan weights and 4-bit second moments, whose
second step has a NaN (skipped alike). The chunking is forced on small matrices by
`KERAS_MP_LEAN_CHUNK`.
"""

import keras
import numpy as np
import pytest

import keras_mp as kmp
from keras_mp.lean import chunked
from keras_mp.lean import codecs as lean_codecs
from keras_mp.lean.rule import Static


def _run(monkeypatch, chunk: int, moments: str, rounding: str, nan_step=None):
    monkeypatch.setenv(chunked.CHUNK_ENV, str(chunk))
    rng = np.random.default_rng(0)
    shapes = [(128, 512)]  # 65,536 values: factored, not packed
    variables = [
        keras.Variable(rng.normal(size=s).astype("float32"), dtype="bfloat16", name=f"w{i}")
        for i, s in enumerate(shapes)
    ]
    opt = kmp.LeanOptimizer(
        keras.optimizers.AdamW(1e-2, weight_decay=0.01), moments=moments, rounding=rounding
    )
    opt.build(variables)
    for step in range(2):
        grads = [rng.normal(size=s).astype("float32") * 1e-2 for s in shapes]
        if step == nan_step:
            grads[0][3, 7] = np.nan
        grads = [keras.ops.convert_to_tensor(g) for g in grads]
        if keras.backend.backend() == "jax":  # as `fit` runs it: one compiled step
            import jax

            step = jax.jit(opt.stateless_apply)
            new_vars, new_opt = step(
                [v.value for v in opt.variables], grads, [v.value for v in variables]
            )
            for v, x in zip(opt.variables, new_opt):
                v.assign(x)
            for v, x in zip(variables, new_vars):
                v.assign(x)
        else:
            opt.apply_gradients(zip(grads, variables))
    state = [v.value for v in variables] + [v.value for v in opt.variables]
    return [np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32"))) for x in state]


@pytest.mark.parametrize(
    "moments,rounding,nan_step",
    [("int4_factored", "stochastic", None), ("int4", "kahan", 1)],
)
def test_chunked_update_is_bit_identical(monkeypatch, moments, rounding, nan_step):
    """Bit for bit; the second case's second step has a NaN: skipped alike."""
    whole = _run(monkeypatch, 0, moments, rounding, nan_step)
    blocks = _run(monkeypatch, 8192, moments, rounding, nan_step)  # 16 rows a block
    assert len(whole) == len(blocks)
    for a, b in zip(whole, blocks):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(a != 0) for a in whole[2:])  # the moments moved


def test_chunk_rows_choice(monkeypatch):
    blocks = lean_codecs.blocks_for((128256, 4096), 128)
    static = Static((128256, 4096), "bfloat16", "int4", "factored", blocks)
    assert chunked.chunk_rows(static, 1 << 24) == 4008  # 32 blocks of whole rows
    tall = Static((4096, 128256), "bfloat16", "int4", "factored", blocks)
    assert chunked.chunk_rows(tall, 1 << 24) == 128
    assert chunked.chunk_rows(static, 0) is None  # off
    tested = Static(
        (128, 512), "bfloat16", "int4", "factored", lean_codecs.blocks_for((128, 512), 128)
    )
    assert chunked.chunk_rows(tested, 8192) == 16  # the test above runs 8 row blocks
    small = Static((64, 64), "bfloat16", "int4", "factored", lean_codecs.blocks_for((64, 64), 128))
    assert chunked.chunk_rows(small, 1 << 24) is None
    monkeypatch.setenv(chunked.CHUNK_ENV, "lots")
    with pytest.raises(ValueError, match="KERAS_MP_LEAN_CHUNK"):
        chunked.chunk_values()
