"""The house's rules: imports run one way between the package's wings, no import cycles, device
code shared only through the runtime layer, and every lab script still imports."""

import ast
import importlib
import importlib.util
import os
from pathlib import Path
import sys

import pytest
import stepkernels  # noqa: F401  (chooses the interpreter before triton is imported)
import triton
from triton.runtime.interpreter import InterpretedFunction

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import import_graph  # noqa: E402

EDGES = import_graph.graph()
LAB = sorted((ROOT / "lab").glob("*.py"))


def test_every_module_has_a_wing():
    top = {"stepkernels", "stepkernels.train", "stepkernels.data", "stepkernels.sample"}
    homeless = [m for m in EDGES if import_graph.wing(m) == "top" and m not in top]
    assert not homeless, f"modules outside runtime/ops/models/lessons: {homeless}"


def test_imports_run_one_way():
    assert import_graph.broken_rules(EDGES) == []


def test_no_import_cycles():
    assert import_graph.cycles(EDGES) == []


def test_the_rules_catch_what_they_are_for(tmp_path):
    """The checks above fail on a package that breaks them (a cycle, the library importing a
    lesson), so a passing test means something."""
    package = tmp_path / "stepkernels"
    for wing in ("runtime", "ops", "lessons"):
        (package / wing).mkdir(parents=True)
        (package / wing / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "ops" / "a.py").write_text("from stepkernels.ops import b\n")
    (package / "ops" / "b.py").write_text("def f():\n    from stepkernels.ops.a import x\n")
    (package / "runtime" / "core.py").write_text("from stepkernels.lessons import bench\n")
    (package / "lessons" / "bench.py").write_text("")
    edges = import_graph.graph(package)
    assert import_graph.cycles(edges) == [["stepkernels.ops.a", "stepkernels.ops.b"]]
    assert import_graph.broken_rules(edges) == ["stepkernels.runtime.core -> stepkernels.lessons.bench"]


def is_device_code(value) -> bool:
    """A Triton kernel or device function, possibly under autotune, heuristics or lean."""
    # Under the interpreter, @triton.jit makes an InterpretedFunction (which also has .fn)
    device_code = (triton.runtime.JITFunction, InterpretedFunction)
    for _ in range(4):
        if isinstance(value, device_code):
            return True
        value = getattr(value, "kernel", None) or getattr(value, "fn", None)
        if value is None:
            return False
    return False


def test_ops_share_device_code_only_through_the_runtime():
    """An operation may call another's functions (linear calls matmul), never take its
    Triton kernels or device functions: those live in the runtime layer."""
    sideways = []
    for path in sorted((ROOT / "src" / "stepkernels" / "ops").glob("*.py")):
        source = import_graph.module_name(path, ROOT / "src" / "stepkernels")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("stepkernels.ops."):
                if node.module == source:
                    continue
                module = importlib.import_module(node.module)
                sideways += [
                    f"{source} takes {node.module}.{alias.name}"
                    for alias in node.names
                    if is_device_code(getattr(module, alias.name))
                ]
    assert not sideways, sideways


def test_the_library_never_imports_lessons():
    library = [m for m in EDGES if import_graph.wing(m) in ("runtime", "ops", "models", "top")]
    assert not [(m, t) for m in library for t in EDGES[m] if import_graph.wing(t) == "lessons"]


def package_state() -> tuple:
    """Each name of the package's loaded modules with the object it names, and the environment."""
    modules = {name: dict(vars(module)) for name, module in list(sys.modules.items()) if name.startswith("stepkernels")}
    return modules, dict(os.environ)


def changed_since(state: tuple) -> list:
    modules, environ = state
    changed = [f"{name}.{attr}" for name, names in modules.items() for attr, value in names.items()
               if vars(sys.modules[name]).get(attr) is not value]  # fmt: skip
    changed += [
        f"os.environ[{key!r}]" for key in environ.keys() | os.environ.keys() if environ.get(key) != os.environ.get(key)
    ]
    return changed


@pytest.mark.parametrize("script", LAB, ids=[p.name for p in LAB])
def test_lab_script_imports(script, capsys):
    """Importing a lab script runs its imports and definitions, not its measurements: a
    renamed or removed name of the package fails here, not months later on a GPU. It prints
    nothing, and leaves the package and the environment as they were (the tests that follow
    run in this process)."""
    before = package_state()
    sys.path.insert(0, str(script.parent))  # lab scripts import their siblings
    try:
        spec = importlib.util.spec_from_file_location(f"lab_{script.stem}", script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(script.parent))
    assert capsys.readouterr().out == "", "it printed on import: run its work under `if __name__ == '__main__':`"
    assert changed_since(before) == [], "importing it changed the package or the environment"


def is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent is not a package
        return False


def stale_package_names(path: Path) -> list:
    """What a script takes from the package that is not there or is private: modules it
    imports from, names it imports, and attributes it reads of a module of the package that it
    imported (``sm.kernel`` after ``from stepkernels.ops import softmax as sm``), wherever
    they are, in functions that only a GPU runs too."""
    tree = ast.parse(path.read_text())
    modules, used = {}, []  # modules: name in the script -> the package's module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "stepkernels":
            if not is_module(node.module):
                used.append((node.lineno, node.module, None))
                continue
            for alias in node.names:
                if is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                else:
                    used.append((node.lineno, node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "stepkernels":
                    if not is_module(alias.name):
                        used.append((node.lineno, alias.name, None))
                    elif alias.asname or alias.name == "stepkernels":
                        modules[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            used.append((node.lineno, modules[node.value.id], node.attr))
    stale = []
    for line, module, name in sorted(used):
        if name is None or name.startswith("_") or not hasattr(importlib.import_module(module), name):
            stale.append(f"{path.name}:{line} {module}" + (f".{name}" if name else ""))
    return stale


def test_lab_takes_only_public_names_that_exist():
    assert [name for path in LAB for name in stale_package_names(path)] == []


def test_the_lab_name_check_catches_stale_names(tmp_path):
    script = tmp_path / "stale.py"
    script.write_text(
        "from stepkernels.ops import softmax as sm\n"
        "from stepkernels.ops.softmax import _private, softmax_forward\n"
        "import stepkernels.linear\n"
        "def sweep():\n"
        "    from stepkernels.attention import Launch\n"
        "    return sm.no_such_kernel, sm.softmax_backward\n"
    )
    assert stale_package_names(script) == [
        "stale.py:2 stepkernels.ops.softmax._private",
        "stale.py:3 stepkernels.linear",
        "stale.py:5 stepkernels.attention",
        "stale.py:6 stepkernels.ops.softmax.no_such_kernel",
    ]
