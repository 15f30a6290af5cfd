"""The package's shape, checked: imports run one way (no cycle, counting the imports inside
functions), and the modules `--help` loads never import torch at module level."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "ddpcli"
# What `ddpcli --help` imports: none of it may import torch or torchvision at module level.
LIGHT_PACKAGES = ("ddpcli.cli", "ddpcli.config", "ddpcli.environments")
LIGHT_MODULES = ("ddpcli.errors", "ddpcli.ui", "ddpcli.machine", "ddpcli.models.archs")
# `ddpcli plot` reads runs with these, and draws with matplotlib/plotext only when it draws.
PLOT_MODULES = ("ddpcli.outputs.curves", "ddpcli.outputs.steplog", "ddpcli.outputs.tbwriter")
HEAVY = ("torch", "torchvision", "numpy", "matplotlib", "plotext", "tensorboard")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_names(tree: ast.AST, package: str, *, module_level_only: bool = False):
    """Every module name an import statement names, with relative imports made absolute.
    `from a import b` names both `a` and `a.b` (b may be a module)."""
    nodes = tree.body if module_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        targets = set(imported_names(tree, package_of(name, path)))
        graph[name] = {target for target in targets if target in files and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that ends where it starts, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, iterators = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while iterators:
            nxt = next(iterators[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iterators.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iterators.append(iter(sorted(graph[nxt])))
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_of_ddpcli_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def light_modules() -> list[Path]:
    paths = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name in (*LIGHT_MODULES, *PLOT_MODULES) or name.startswith(LIGHT_PACKAGES):
            paths.append(path)
    return sorted(paths)


@pytest.mark.parametrize("path", light_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_modules_help_loads_do_not_import_torch_at_module_level(path):
    tree = ast.parse(path.read_text())
    heavy = {
        name
        for name in imported_names(
            tree, package_of(module_name(path), path), module_level_only=True
        )
        if name.split(".")[0] in HEAVY
    }
    assert not heavy, f"{path.name} imports {sorted(heavy)} at module level"
