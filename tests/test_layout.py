"""The package's layout is its architecture: imports go down the floors, never in a circle.

Every import of a keras_mp module is read from the source (those inside functions too), so
a lazy import cannot hide a circle. Importing `keras_mp.a.b` also runs `keras_mp.a`'s
`__init__`, so that edge is counted as well (except within one subpackage, where the face
importing its own modules is the point).
"""

import ast
import pathlib

import keras_mp

ROOT = pathlib.Path(keras_mp.__file__).parent


def _modules() -> dict:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _package(module: str) -> str:
    return module.rsplit(".", 1)[0] if "." in module else module


def _imports(module: str, path, modules: dict) -> set:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            full = [f"{node.module}.{a.name}" for a in node.names]
            names = [n if n in modules else node.module for n in full]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.startswith("keras_mp"):
                found.add(name)
    edges = set()
    for target in found:
        edges.add(target)
        parent = _package(target)  # importing a.b runs a's __init__ first
        while parent.startswith("keras_mp.") and not module.startswith(parent + "."):
            edges.add(parent)
            parent = _package(parent)
    edges.discard(module)
    if module != "keras_mp":
        edges.discard("keras_mp")  # only the root face imports it: checked below
    return edges


def _graph() -> dict:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def test_no_import_circles():
    graph = _graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_only_the_command_line_imports_the_root_package():
    offenders = []
    for module, path in _modules().items():
        if module == "keras_mp" or module.startswith("keras_mp.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "keras_mp" for a in node.names):
                offenders.append(module)
            if isinstance(node, ast.ImportFrom) and node.module == "keras_mp":
                if any(f"keras_mp.{a.name}" not in _modules() for a in node.names):
                    offenders.append(module)  # a name of the face, not a module
    assert offenders == []


def test_tensorflow_is_imported_at_module_level_only_in_keras_mp_tf():
    offenders = []
    for module, path in _modules().items():
        if module.startswith("keras_mp.tf"):
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "tensorflow" or n.startswith("tensorflow.") for n in names):
                offenders.append(module)
    assert offenders == []


SUBPACKAGES = (
    "cli",
    "conversion",
    "fingerprint",
    "float8",
    "hardware",
    "jax",
    "keep_list",
    "keras_glue",
    "lean",
    "memory",
    "numerics",
    "observe",
    "saving",
    "scaling",
    "tf",
)
ROOT_MODULES = {"__init__.py", "formats.py", "policies.py", "version.py"}
MAX_LINES = 460  # "about 450": a module past it is two concepts


def _py() -> list:
    return sorted(ROOT.rglob("*.py"))


def _faced_packages() -> list:
    return sorted(p.parent for p in ROOT.rglob("__init__.py") if p.parent != ROOT)


def test_subpackages_have_a_face_and_no_private_modules():
    found = sorted(str(p.relative_to(ROOT)) for p in _faced_packages())
    assert found == sorted(SUBPACKAGES)  # a new area is added here on purpose
    for package in _faced_packages():
        face = ast.parse((package / "__init__.py").read_text())
        assigned = [
            getattr(t, "id", None)
            for n in face.body
            if isinstance(n, ast.Assign)
            for t in n.targets
        ]
        assert "__all__" in assigned, f"{package.name}/__init__.py has no __all__"
        private = [p.name for p in package.glob("_*.py") if not p.name.endswith("__.py")]
        assert private == [], package
    assert [p.name for p in ROOT.glob("_*.py") if p.name != "__init__.py"] == []


def test_the_root_holds_only_the_face_and_a_few_modules():
    """Everything else lives in a subpackage by concept (issue 53)."""
    root = {p.name for p in ROOT.glob("*.py")}
    assert len(root) <= 6, sorted(root)
    assert root == ROOT_MODULES  # a new root module is added here on purpose


def test_no_module_is_two_concepts_by_size():
    lines = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in _py()}
    assert {path: n for path, n in lines.items() if n > MAX_LINES} == {}


def test_the_old_module_paths_are_the_moved_modules():
    """`keras_mp.loss_scale` & co. (the paths before the regroup, which users' code and
    the `module` field of saved configs name) import the moved modules themselves."""
    import importlib

    import keras_mp as kmp

    assert len(kmp._MOVED) >= 23
    for old, new in kmp._MOVED.items():
        moved = importlib.import_module(f"keras_mp.{new}")
        assert importlib.import_module(f"keras_mp.{old}") is moved, old
        assert getattr(kmp, old) is moved, old
    import keras_mp.keras_internals
    import keras_mp.loss_scale
    import keras_mp.patches
    from keras_mp.layers import Softmax
    from keras_mp.loss_scale import LossScaleOptimizer
    from keras_mp.losses import SparseCategoricalCrossentropy

    assert LossScaleOptimizer is keras_mp.loss_scale.LossScaleOptimizer
    assert keras_mp.loss_scale.LossScaleOptimizer is kmp.scaling.LossScaleOptimizer
    assert kmp.LossScaleOptimizer is kmp.scaling.loss_scale.LossScaleOptimizer
    assert SparseCategoricalCrossentropy is kmp.numerics.losses.SparseCategoricalCrossentropy
    assert Softmax is kmp.numerics.layers.Softmax
    assert kmp.layers is kmp.numerics.layers and kmp.losses is kmp.numerics.losses
    assert kmp.activations is kmp.numerics.activations
    assert keras_mp.patches is kmp.patches is kmp.keras_glue.patches
    assert keras_mp.keras_internals is kmp.keras_glue.keras_internals
    # `keras_mp.saving` and `keras_mp.float8` were modules; their faces keep every name
    assert kmp.saving.load_model is kmp.saving.load.load_model
    assert kmp.saving.save_model is kmp.saving.atomic.save_model
    assert kmp.float8.Float8Recipe is kmp.float8.recipe.Float8Recipe
    assert kmp.float8.apply_float8 is kmp.float8.layers.apply_float8
    assert kmp.float8.float8_speedup_expected is kmp.float8.payoff.float8_speedup_expected
    assert kmp.memory.estimate_memory is kmp.estimate_memory
    assert kmp.FitReport is kmp.memory.fit.FitReport


def test_registered_serialization_names_did_not_move():
    """Saved files find classes by these names; the regroup must not change them."""
    import keras

    import keras_mp as kmp

    names = {
        kmp.LossScaleOptimizer: "keras_mp>LossScaleOptimizer",
        kmp.LeanOptimizer: "keras_mp>LeanOptimizer",
        kmp.losses.SparseCategoricalCrossentropy: "keras_mp>SparseCategoricalCrossentropy",
        kmp.layers.MultiHeadAttention: "keras_mp>MultiHeadAttention",
        kmp.layers.LayerNormalization: "keras_mp>LayerNormalization",
        kmp.layers.Softmax: "keras_mp>Softmax",
        kmp.layers.Float32: "keras_mp>Float32",
        kmp.float8.Float8Recipe: "keras_mp>Float8Recipe",
        kmp.float8.Float8DTypePolicy: "keras_mp>Float8DTypePolicy",
        kmp.float8.Float8Dense: "keras_mp>Float8Dense",
    }
    for cls, name in names.items():
        assert keras.saving.get_registered_name(cls) == name
        assert keras.saving.get_registered_object(name) is cls


def test_keras_mp_imports_moved_modules_by_their_new_paths():
    """Inside keras_mp the old paths are not used: they exist for users and saved files."""
    import keras_mp as kmp

    old = {f"keras_mp.{name}" for name in kmp._MOVED}
    offenders = []
    for module, path in _modules().items():
        if module == "keras_mp":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
                if node.module == "keras_mp":
                    names += [f"keras_mp.{a.name}" for a in node.names]
            hits = [n for n in names if any(n == o or n.startswith(o + ".") for o in old)]
            offenders += [f"{module}:{node.lineno} {n}" for n in hits]
    assert offenders == []


def test_public_names_and_documented_paths_resolve():
    import keras_mp as kmp
    from keras_mp import callbacks, keep_list, layers, losses  # noqa: F401
    from keras_mp.lean import LeanOptimizer, lean_rule, state_bytes  # noqa: F401
    from keras_mp.tf import distribute, export  # noqa: F401

    for name in kmp.__all__:
        assert getattr(kmp, name) is not None, name
    assert kmp.callbacks is kmp.observe.callbacks
    import keras_mp.callbacks
    from keras_mp.callbacks import LossScaleMonitor

    assert keras_mp.callbacks is kmp.observe.callbacks
    assert LossScaleMonitor is kmp.observe.callbacks.LossScaleMonitor
    assert kmp.convert is kmp.conversion.convert


def test_keras_private_api_only_through_keras_internals():
    """`keras.src` moves between Keras releases: one module reaches it (keras_internals)."""
    offenders = []
    for module, path in _modules().items():
        if module == "keras_mp.keras_glue.keras_internals":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Attribute) and node.attr == "src":
                names = ["keras.src"] if getattr(node.value, "id", None) == "keras" else []
            if any(n == "keras.src" or n.startswith("keras.src.") for n in names):
                offenders.append(f"{module}:{node.lineno}")
    assert offenders == []
