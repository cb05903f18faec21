"""The package layout's dependency direction (issue 14): imports only go down the layers, and no module cycles.

commands → loop → callbacks → learner / rollout → distributed / measure → core / tasks → objectives / sandbox /
models. Every import counts, function-level (lazy) ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "tslightning"

LAYER = {
    "objectives": 0,
    "measure": 2,
    "sandbox": 0,
    "models": 0,
    "core": 1,
    "tasks": 1,
    "distributed": 2,
    "learner": 3,
    "rollout": 3,
    "callbacks": 4,
    "loop": 5,
    "commands": 6,
    "cli": 7,
    "__init__": 7,
}
"""Rank of each top-level package (or top-level module): a package may import its own modules and lower ranks."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every tslightning module ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] == "tslightning")
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py") if "library" not in p.parts}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            while imported not in modules and "." in imported:  # `from pkg.mod import name` names a module or not
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _graph()}
    assert packages <= set(LAYER), f"give these a layer in LAYER: {sorted(packages - set(LAYER))}"


def test_imports_only_go_down_the_layers():
    upward = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if _package(target) != _package(module)
        and LAYER[_package(target)] >= LAYER[_package(module)]
        and target != "tslightning"
    ]
    assert not upward, "imports that go up or sideways:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(" → ".join(path[path.index(target) :] + [module, target]) if target in path else target)
            elif target not in state:
                visit(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_flat_modules_left_at_the_top_level():
    flat = sorted(p.name for p in ROOT.glob("*.py"))
    assert flat == ["__init__.py", "cli.py"]


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these (one concept per module): {long}"
