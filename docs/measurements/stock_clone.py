"""Stock Keras' route to a mixed model vs `kmp.convert`, on every keras_hub model of the zoo.

Keras has no conversion of a built model. Its closest route: `keras.models.clone_model`
with a `clone_function` that rebuilds each layer from its config with
`dtype="mixed_float16"` (where the config has a dtype and accepts it), then `set_weights`
from the float32 model. For each keras_hub backbone and task of `tests/integration/zoo.py`
(tiny, download-free; TensorFlow backend) this builds the float32 model and records whether
the stock route and `kmp.convert(model, "mixed_float16")` produce a model that runs, and
max |output - float32| / max |float32| of each. One JSON line per model, then a summary.

    KERAS_BACKEND=tensorflow python docs/measurements/stock_clone.py runs/stock_clone.jsonl

Took ~15 minutes on a 2-core CPU. Result of 2026-12-02: stock_clone_2026-12-02.jsonl.
"""

import json
import os
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

import convert_stages  # noqa: E402
import keras  # noqa: E402
import zoo  # noqa: E402

import keras_mp as kmp  # noqa: E402


def first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def mixed_float16(layer):
    """Keras' clone_function: the layer rebuilt from its config under mixed_float16."""
    config = layer.get_config()
    if "dtype" in config:
        try:
            return layer.__class__.from_config({**config, "dtype": "mixed_float16"})
        except Exception:  # noqa: BLE001 - e.g. a functional op layer without a dtype argument
            pass
    return layer.__class__.from_config(config)


def main(out_path: str) -> None:
    warnings.simplefilter("ignore")
    rows = []
    with open(out_path, "a") as out:
        for entry in zoo.ENTRIES:
            if not entry.name.startswith("hub.") or "tensorflow" not in entry.backends:
                continue
            row, start = {"entry": entry.name, "kind": entry.kind}, time.time()
            try:
                model = entry.build()
                x = entry.inputs(2)
                reference = model.predict_on_batch(x)
            except Exception as e:  # noqa: BLE001 - not a conversion failure
                row["build"] = first_line(e)
                print(json.dumps(row), file=out, flush=True)
                continue
            try:
                clone = keras.models.clone_model(model, clone_function=mixed_float16)
                clone.set_weights(model.get_weights())
                row["stock_low"] = sum(  # layers computing in float16
                    layer.compute_dtype == "float16"
                    for layer in clone._flatten_layers(include_self=False))
                got = clone.predict_on_batch(x)
                row["stock_err"] = convert_stages.relative_error(reference, got)
                row["stock"] = "ok"
            except Exception as e:  # noqa: BLE001
                row["stock"] = first_line(e)
            try:
                converted = kmp.convert(model, "mixed_float16")
                row["kmp_err"] = convert_stages.relative_error(
                    reference, converted.predict_on_batch(x))
                row["kmp"] = "ok"
            except Exception as e:  # noqa: BLE001
                row["kmp"] = first_line(e)
            row["s"] = round(time.time() - start, 1)
            print(json.dumps(row), file=out, flush=True)
            rows.append(row)
            keras.backend.clear_session(free_memory=False)
    for name in ("stock", "kmp"):
        runs = sum(r.get(name) == "ok" for r in rows)
        print(f"{name}: runs on {runs} of {len(rows)} models")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "stock_clone.jsonl")
