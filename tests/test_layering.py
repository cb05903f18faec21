"""The package layout: imports only go down the layers, no module cycles, and each second-level folder's rule.

commands → loop → callbacks → learner / rollout → distributed / measure → core / tasks → objectives / sandbox /
models. Every import counts, function-level (lazy) ones included. Inside ``rollout/`` and ``tasks/`` each folder
states its rule in its docstring (``Rule:``) and the tests below check it: vLLM and Ray only under the vLLM
backends, the CLI and the settings importable without either, the harness programs on the standard library alone,
Harbor's readers free of anything that builds or runs, the gateway below the harness.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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
    return {name for name in _imported_names(path) if name.split(".")[0] == "tslightning"}


def _imported_names(path: Path) -> set[str]:
    """Every module name ``path`` imports (and ``module.name`` of each ``from module import name``), at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update([node.module] + [f"{node.module}.{alias.name}" for alias in node.names])
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _modules_under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


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


SECOND_LEVEL = ["rollout/hf", "rollout/vllm_engine", "rollout/vllm_server", "rollout/gateway", "rollout/harness",
                "rollout/harness/programs", "tasks/harbor", "tasks/environment"]  # fmt: skip


@pytest.mark.parametrize("folder", SECOND_LEVEL)
def test_each_second_level_folder_states_its_rule(folder):
    docstring = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())) or ""
    assert "Rule:" in docstring or folder.endswith("programs") and "standard library only" in docstring


def test_no_module_in_rollout_or_tasks_is_over_450_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for folder in ("rollout", "tasks")
        for p in _modules_under(folder)
        if "library" not in p.parts and (n := len(p.read_text().splitlines())) > 450
    }
    assert not long, f"separate the concerns of these: {long}"


def test_vllm_and_ray_are_imported_only_under_the_vllm_backends():
    backends = (ROOT / "rollout" / "vllm_engine", ROOT / "rollout" / "vllm_server")
    outside = sorted(
        f"{path.relative_to(ROOT)} imports {name}"
        for path in ROOT.rglob("*.py")
        if not any(path.is_relative_to(folder) for folder in backends)
        for name in _imported_names(path)
        if name.split(".")[0] in ("vllm", "ray")
    )
    inside = [path for folder in backends for path in folder.rglob("*.py") if "vllm" in _imported_names(path)]
    assert inside  # the scan sees the backends' own imports of vLLM
    assert not outside, "vLLM and Ray belong under rollout/vllm_engine/ and rollout/vllm_server/:\n" + "\n".join(
        outside
    )


def test_the_cli_and_the_settings_import_without_vllm_and_ray():
    """An install without the extras: ``vllm`` and ``ray`` unimportable (``None`` in ``sys.modules`` makes any import
    of them fail), the CLI, its settings and the fit command still import."""
    code = (
        "import sys\n"
        "sys.modules['vllm'] = sys.modules['ray'] = None\n"
        "import tslightning.cli, tslightning.loop.settings, tslightning.loop.fit, tslightning.loop.preflight\n"
        "assert sys.modules['vllm'] is None and sys.modules['ray'] is None\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_harness_programs_import_only_the_standard_library():
    """They run under the harness's own interpreter, with their folder as ``sys.path[0]``: no tslightning there."""
    allowed = set(sys.stdlib_module_names) | {"minisweagent"}  # the harness's own package, imported lazily
    foreign = sorted(
        f"{path.name} imports {name}"
        for path in _modules_under("rollout/harness/programs")
        for name in _imported_names(path)
        if name.split(".")[0] not in allowed and name != "__future__.annotations"
    )
    assert not foreign, "\n".join(foreign)


def test_harbor_readers_import_nothing_that_builds_or_runs():
    """``tasks/harbor/`` reads files: the standard library, YAML, and its own modules; no sandbox, no environment."""
    foreign = sorted(
        f"{path.name} imports {name}"
        for path in _modules_under("tasks/harbor")
        for name in _imported_names(path)
        if name.split(".")[0] not in (set(sys.stdlib_module_names) | {"yaml"})
        and not name.startswith("tslightning.tasks.harbor")
    )
    assert not foreign, "\n".join(foreign)


def test_the_gateway_never_imports_the_harness():
    upward = sorted(
        f"{path.name} imports {name}"
        for path in _modules_under("rollout/gateway")
        for name in _imports(path)
        if name.startswith("tslightning.rollout.harness")
    )
    assert not upward, "\n".join(upward)
