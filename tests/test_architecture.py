"""The package's shape, checked: imports run one way, between parts as between modules (no
cycle, counting the imports inside functions); README.md's Layout has a line for every part;
the paths the docs name exist; and the modules `--help` loads never import torch at module
level."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "ddpcli"
PACKAGES = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
# What `ddpcli --help` imports: none of it may import torch or torchvision at module level.
# The modules that `python -m ddpcli` reaches through module-level imports are added below.
# `ddpcli plot` reads runs with outputs/, which draws with matplotlib/plotext only when it draws.
LIGHT_PACKAGES = ("ddpcli.cli", "ddpcli.config", "ddpcli.environments", "ddpcli.outputs")
LIGHT_MODULES = (
    "ddpcli.errors", "ddpcli.ui", "ddpcli.machine", "ddpcli.factories", "ddpcli.models.archs",
)  # fmt: skip
HEAVY = (
    "torch", "torchvision", "numpy", "matplotlib", "plotext", "tensorboard", "mlflow", "wandb",
)  # fmt: skip


def parts(names: str) -> set[str]:
    return set(names.split())


# The parts of ddpcli, and the parts each may import besides itself. A part is a package, or,
# for the modules at the top: `errors` (the error type users see, beneath everything) and
# `shared` (every other top-level module). Read top-down, each row names only rows above it:
# the parts are layers (test_the_allowed_imports_are_layers). The comment says why each arrow.
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "errors": set(),
    # who started this process: launcher variables read, bad ones said as errors
    "environments": parts("errors"),
    # dist takes its world from environments' LauncherEnv
    "shared": parts("errors environments"),
    # what --arch names and builds; a user's own model through factories
    "models": parts("errors shared"),
    # PET_ variables as flag defaults (environments.pods); --arch names checked (models.archs)
    "config": parts("errors shared environments models"),
    # sets, augmentation and batches, built from the validated config
    "data": parts("errors shared config"),
    # a run folder records the run's config and who restarted it (environments)
    "outputs": parts("errors shared environments config"),
    # the flight recorder's evidence: each rank's record, gathered, and the verdict on it
    "collectives": parts("errors shared"),
    # a checkpoint holds the data position (data.resharding); verify rebuilds the model
    "checkpoint": parts("errors shared config data models"),
    # one rank's work: its world, data and model, checkpoints saved, the run's files written
    "training": parts(
        "errors shared environments config models data checkpoint outputs collectives"
    ),
    # a run planned against this machine (data, models, training.precision, the resume file
    # checked: checkpoint), its run folder claimed, training's worker started in each rank
    "launcher": parts(
        "errors shared environments config models data outputs checkpoint collectives training"
    ),
    # the two instruments start their ranks, and check the machine, as the launcher does
    "barrier": parts("errors shared environments config launcher"),
    "checkenv": parts("errors shared environments config launcher"),
    # `ddpcli eval`: a checkpoint's model rebuilt (checkpoint, models), its data viewed as
    # validation saw it (data), autocast as training ran (training), ranks started (launcher)
    "evaluation": parts(
        "errors shared environments config models data checkpoint collectives training launcher"
    ),
    # a command is a thin layer over the engine: it may call any part of it
    "cli": parts(
        "errors shared environments config models data outputs checkpoint collectives training "
        "launcher barrier checkenv evaluation"
    ),
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


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


@functools.cache
def import_graph(*, module_level_only: bool = False) -> dict[str, set[str]]:
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        package = package_of(name, path)
        targets = set(imported_names(tree, package, module_level_only=module_level_only))
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


def part_of(module: str) -> str:
    """The part of ddpcli a module belongs to (`python -m ddpcli` is the command line's)."""
    top = module.split(".")[1] if "." in module else ""
    if top == "__main__":
        return "cli"
    if top in PACKAGES or top == "errors":
        return top
    return "shared"


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from one part into another that ALLOWED_IMPORTS does not allow."""
    found = []
    for module, targets in sorted(graph.items()):
        part = part_of(module)
        allowed = ALLOWED_IMPORTS.get(part, set()) | {part}
        found += [
            f"{module} imports {target}: {part} may not import {part_of(target)}"
            for target in sorted(targets)
            if part_of(target) not in allowed
        ]
    return found


def test_every_part_of_ddpcli_has_a_row_of_allowed_imports():
    assert set(ALLOWED_IMPORTS) == {*PACKAGES, "errors", "shared"}


def test_the_allowed_imports_are_layers():
    arrows = {part: allowed - {part} for part, allowed in ALLOWED_IMPORTS.items()}
    assert set().union(*arrows.values()) <= set(arrows)
    cycle = find_cycle(arrows)
    assert cycle is None, "the allowed imports go round: " + " -> ".join(cycle or [])


def test_a_forbidden_import_is_found():
    graph = {
        "ddpcli.training.loop": {"ddpcli.launcher.engine", "ddpcli.data.pipeline"},
        "ddpcli.config.train": {"ddpcli.cli.app", "ddpcli.models.archs"},
        "ddpcli.dist": {"ddpcli.environments", "ddpcli.training.precision"},
        "ddpcli.environments.world": {"ddpcli.errors", "ddpcli.ui"},
        "ddpcli.__main__": {"ddpcli.cli"},
    }
    assert forbidden_imports(graph) == [
        "ddpcli.config.train imports ddpcli.cli.app: config may not import cli",
        "ddpcli.dist imports ddpcli.training.precision: shared may not import training",
        "ddpcli.environments.world imports ddpcli.ui: environments may not import shared",
        "ddpcli.training.loop imports ddpcli.launcher.engine: training may not import launcher",
    ]


def test_imports_between_the_parts_of_ddpcli_go_the_allowed_way():
    assert forbidden_imports(import_graph()) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_says_what_lives_there_and_what_it_may_import(package):
    init = PACKAGE / package / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert len(docstring.split()) >= 12 and "import" in docstring, (
        f"ddpcli/{package}/__init__.py: its docstring should say what lives in the package "
        "and what it may import"
    )


def layout_section(readme: str) -> str:
    return readme.split("\n## Layout", 1)[1].split("\n## ", 1)[0]


def missing_from_layout(names: list[str], layout: str) -> list[str]:
    """The top-level modules and packages (`dist.py`, `launcher/`) that no `ddpcli/NAME`
    in the layout names."""
    return [
        name
        for name in names
        if not re.search(rf"(?<![\w/])ddpcli/{re.escape(name)}(?![\w/])", layout)
    ]


def test_a_module_missing_from_the_layout_is_found():
    layout = "ddpcli/dist.py    process groups\nddpcli/launcher/resolve.py   exit 2 early\n"
    names = ["dist.py", "distances.py", "launcher/", "launcher/resolve.py"]
    assert missing_from_layout(names, layout) == ["distances.py", "launcher/"]


def test_every_top_level_module_and_package_has_a_line_in_the_readme_layout():
    names = [path.name for path in PACKAGE.glob("*.py") if not path.name.startswith("__")]
    names += [f"{package}/" for package in PACKAGES]
    layout = layout_section((REPO / "README.md").read_text())
    missing = missing_from_layout(sorted(names), layout)
    assert missing == [], f"README.md's Layout has no line for ddpcli/{', ddpcli/'.join(missing)}"


def documents() -> list[Path]:
    """What readers follow to the code: the README, the docs, the examples, the benchmarks."""
    found = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    for folder in ("examples", "benchmarks"):
        found += [path for path in (REPO / folder).rglob("*") if path.suffix in (".py", ".sh")]
    return sorted(found)


def names_defined(source: Path) -> set[str]:
    """The names a module defines or imports at its top level (inside if/try too)."""
    names, nodes = set(), list(ast.parse(source.read_text()).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {leaf.id for leaf in ast.walk(target) if isinstance(leaf, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            nodes += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            nodes += [child for handler in getattr(node, "handlers", []) for child in handler.body]
    return names


def resolves(dotted: str) -> bool:
    """Whether `ddpcli.a.b` (or `ddpcli.a.b.name`) names a module of the package (and a name
    that module defines), read from the source without importing it."""
    names = dotted.split(".")
    for end in range(len(names), 0, -1):
        base = REPO.joinpath(*names[:end])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            return end == len(names) or names[end] in names_defined(source)
    return False


def named_in(text: str, is_python: bool) -> list[str]:
    """The paths (`ddpcli/launcher/resolve.py`) and import paths (`ddpcli.dist.zero_first`)
    a document names; a Python file's `from ddpcli.x import y` names `ddpcli.x.y`."""
    found = re.findall(r"(?<![\w.-])ddpcli/(?!ddpcli/)[\w/]*\w(?:\.py)?", text)
    found += re.findall(r"(?<![\w./-])ddpcli(?:\.(?!md\b|py\b)\w+)+", text)
    if is_python:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpcli"):
                found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def missing_names(text: str, is_python: bool = False) -> list[str]:
    return [
        name
        for name in named_in(text, is_python)
        if not ((REPO / name).exists() if "/" in name else resolves(name))
    ]


def test_a_path_that_no_longer_exists_is_found():
    text = (
        "see `ddpcli/launcher/resolve.py`, ddpcli/resolve.py, ddpcli/launcher/, ddpcli.dist,\n"
        'ddpcli.dist.zero_first and ddpcli.dist.zero_last; File "/opt/ddpcli/ddpcli/data.py"'
    )
    assert missing_names(text) == ["ddpcli/resolve.py", "ddpcli/data.py", "ddpcli.dist.zero_last"]
    code = "from ddpcli.models.build import build_model, build_modle\nfrom ddpcli.archs import x\n"
    assert missing_names(code, is_python=True) == [
        "ddpcli.archs", "ddpcli.models.build.build_modle", "ddpcli.archs.x",
    ]  # fmt: skip


def test_the_paths_the_docs_name_exist():
    missing = {
        str(path.relative_to(REPO)): found
        for path in documents()
        if (found := missing_names(path.read_text(), is_python=path.suffix == ".py"))
    }
    assert missing == {}, f"these name no file (or no name) of ddpcli any more: {missing}"


def module_level_reach(start: str) -> set[str]:
    """The modules that importing START runs: its module-level imports, their packages'
    __init__ files, and theirs in turn."""
    graph = import_graph(module_level_only=True)
    reached, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            parents = [".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 1)]
            todo += [*graph[name], *parents]
    return reached


def test_the_light_module_lists_name_modules_that_exist():
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    assert {*LIGHT_PACKAGES, *LIGHT_MODULES} - modules == set()


def light_modules() -> list[Path]:
    reached_by_help = module_level_reach("ddpcli.__main__")
    paths = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        listed = name in LIGHT_MODULES or name.startswith(LIGHT_PACKAGES)
        if listed or name in reached_by_help:
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


# --- One plan per run ----------------------------------------------------------------------
# The request (TrainConfig) is built by cli/ from the flags and the recipe, and planned by one
# function that cli/ calls (launcher/plan.py:plan_run); the plan (RunPlan) is made there and,
# for what only a rank can know, in training/settle.py. Nothing below cli/ rewrites either.
PLANNER_CALLERS = ("ddpcli/cli/",)
PLAN_MAKERS = ("ddpcli/launcher/plan.py", "ddpcli/training/settle.py")
RUN_SETTINGS = ("TrainConfig", "RunPlan")


def calls_to(tree: ast.AST, name: str) -> list[int]:
    """Lines that call NAME, or NAME.something (`RunPlan.model_validate`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            target = node.func
            while isinstance(target, ast.Attribute) and not isinstance(target.value, ast.Name):
                target = target.value
            base = target.value if isinstance(target, ast.Attribute) else target
            if isinstance(base, ast.Name) and base.id == name:
                lines.append(node.lineno)
    return lines


def settings_copied(tree: ast.AST) -> list[int]:
    """Lines where a function copies a parameter typed as the request or the plan with
    `model_copy` (pydantic does not validate the copy)."""
    lines = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        typed = {
            argument.arg
            for argument in [*function.args.args, *function.args.kwonlyargs]
            if argument.annotation is not None
            and any(name in ast.unparse(argument.annotation) for name in RUN_SETTINGS)
        }
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "model_copy"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in typed
            ):
                lines.append(node.lineno)
    return lines


def where(predicate) -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if lines := predicate(relative, ast.parse(path.read_text())):
            found[relative] = lines
    return found


def test_only_the_command_line_calls_the_planner():
    callers = where(
        lambda path, tree: [] if path.startswith(PLANNER_CALLERS) else calls_to(tree, "plan_run")
    )
    assert callers == {}, f"plan_run is cli/'s to call: {callers}"


def test_only_the_planner_and_the_ranks_settlement_make_a_plan():
    makers = where(
        lambda path, tree: (
            []
            if path in PLAN_MAKERS
            else [line for line in calls_to(tree, "RunPlan") if line not in json_reads(tree)]
        )
    )
    assert makers == {}, (
        f"a RunPlan is made by launcher/plan.py or training/settle.py only: {makers}"
    )


def json_reads(tree: ast.AST) -> set[int]:
    """`RunPlan.model_validate_json(...)`: a worker reading the plan it was handed."""
    return {
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "model_validate_json"
    }


def test_nothing_rewrites_the_request_or_the_plan():
    copies = where(lambda path, tree: settings_copied(tree))
    assert copies == {}, f"the request and the plan are never copied with changes: {copies}"
    from ddpcli.config import TrainConfig

    with pytest.raises(ValueError, match="frozen"):
        TrainConfig().epochs = 3  # type: ignore[misc]


def test_a_plan_made_or_copied_elsewhere_is_found():
    tree = ast.parse(
        "def f(cfg: TrainConfig):\n    return cfg.model_copy(update={'lr': 1})\n"
        "def g(values):\n    return RunPlan.model_validate(values)\n"
        "def h(path):\n    return RunPlan.model_validate_json(path.read_text())\n"
    )
    assert settings_copied(tree) == [2]
    assert calls_to(tree, "RunPlan") == [4, 6] and json_reads(tree) == {6}
