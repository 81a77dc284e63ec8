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


def test_subpackages_have_a_face_and_no_private_modules():
    for package in ("conversion", "lean", "fingerprint", "observe", "hardware", "keep_list"):
        face = ROOT / package / "__init__.py"
        assert face.exists(), package
        assert "__all__" in face.read_text(), package
        private = [p.name for p in (ROOT / package).glob("_*.py") if p.name != "__init__.py"]
        assert private == [], package
    assert [p.name for p in ROOT.glob("_*.py") if p.name != "__init__.py"] == []


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
        if module == "keras_mp.keras_internals":
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
