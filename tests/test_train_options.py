"""`ddpcli train`'s options: each declared once, in the module of the help panel it shows in
(ddpcli/cli/train_options/), and each reaching the config under its own name."""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import get_args

from conftest import run_cli

from ddpcli.cli import train
from ddpcli.cli.train_options import (
    command,
    data,
    ingredients,
    model,
    nodes,
    outputs,
    processes,
)
from ddpcli.config import TrainConfig

PANEL_MODULES = (data, model, processes, nodes, outputs, ingredients)


def train_parameters() -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(train.train, eval_str=True).parameters)


def declaring_modules(annotation: object) -> list[ModuleType]:
    return [
        module
        for module in (command, *PANEL_MODULES)
        if any(alias is annotation for alias in vars(module).values())
    ]


def test_each_train_option_is_declared_once_in_its_panels_module():
    for name, parameter in train_parameters().items():
        modules = declaring_modules(parameter.annotation)
        assert len(modules) == 1, f"{name}: declared in {modules}, not in one panel's module"
        option = get_args(parameter.annotation)[1]
        panel = getattr(modules[0], "PANEL", None)  # command's: Typer's default Options panel
        assert option.rich_help_panel == panel, f"{name} shows in {option.rich_help_panel!r}"


def test_each_train_setting_reaches_the_config_under_its_name():
    """A parameter named otherwise would give its flag's value to no setting."""
    settings = set(train_parameters()) - set(train.COMMAND_OWN)
    assert settings <= set(TrainConfig.model_fields), settings - set(TrainConfig.model_fields)
    assert set(train.COMMAND_OWN) <= set(train_parameters())


def test_train_help_shows_the_panels_in_the_modules_order():
    result = run_cli("train", "--help", timeout=60, env={"COLUMNS": "200"})
    titles = [
        line.removeprefix("╭─ ").split(" ─")[0]
        for line in result.stdout.splitlines()
        if line.startswith("╭─ ")
    ]
    assert titles == ["Options", *(module.PANEL for module in PANEL_MODULES)]
