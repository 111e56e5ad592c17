"""The package's import graph: which module imports which, its cycles, and its wings' rules.

    python tools/import_graph.py [PACKAGE_DIR]   # arrows, cycles and broken rules, printed

Every ``import`` and ``from ... import`` of a ``stepkernels`` module counts, at the top of a
module or inside a function (an import done late is still a dependency). ``from stepkernels.ops
import long_rows`` is an arrow to ``stepkernels.ops.long_rows``. ``tests/test_architecture.py``
holds the package to the rules below; this script prints the same facts for a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path
import sys

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "stepkernels"

# What each wing may import (besides itself). The top level (``stepkernels``, its
# ``__init__`` and the command-line shims) is the public face: it may import the library.
ALLOWED = {
    "runtime": {"runtime"},
    "ops": {"runtime", "ops"},
    "models": {"runtime", "ops", "models"},
    "lessons": {"runtime", "ops", "models", "lessons", "top"},
    "top": {"runtime", "ops", "models", "top"},
}


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_of(package: Path) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # a name imported from a package may be a module of it
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in known:
                found.add(name)
    return found


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = modules_of(package)
    known = set(modules)
    edges = {}
    for name, path in modules.items():
        targets = imports_of(path, known) - {name}
        # "from stepkernels.ops import long_rows" names the package too; keep the module alone
        edges[name] = {t for t in targets if not any(o.startswith(t + ".") for o in targets)}
    return edges


def wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else "top"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def broken_rules(edges: dict[str, set[str]]) -> list[str]:
    """Arrows that go against the wings' direction."""
    return [
        f"{source} -> {target}"
        for source, targets in sorted(edges.items())
        for target in sorted(targets)
        if wing(target) not in ALLOWED.get(wing(source), set())
    ]


def main(package: str | None = None) -> None:
    edges = graph(Path(package) if package else PACKAGE)
    arrows = sum(len(targets) for targets in edges.values())
    print(f"{len(edges)} modules, {arrows} import arrows")
    for component in cycles(edges):
        print("cycle:", " <-> ".join(component))
    for arrow in broken_rules(edges):
        print("against the wings:", arrow)


if __name__ == "__main__":
    main(*sys.argv[1:])
