"""`ddpcli train`'s options, one module per help panel: data, model (and optimisation),
processes (and devices), nodes, outputs (and checkpoints), ingredients (of the recipe), and
the command's own (command). Each option is declared once, as an `Annotated` alias that
`ddpcli.cli.train`'s signature names (`data_dir: data.DataDir = None`), so the command reads
as a list and each panel can be read, and added to, in one place.

Each alias is bound to its parameter's name: the parameter must be called as the TrainConfig
field it sets (`data.DataDir` is `data_dir`), the name the value reaches the config under.
Nothing here imports torch: `ddpcli train --help` answers at once.
"""

from __future__ import annotations

from typing import Any

from ddpcli.cli.options import setting
from ddpcli.config import TrainConfig


def train_option(
    name: str,
    help: str | None = None,
    panel: str | None = None,
    default: str | None = None,
    metavar: str | None = None,
) -> Any:
    """`--NAME` for TrainConfig's field NAME: help shows its default (or DEFAULT, in words)."""
    return setting(TrainConfig, name, help, panel=panel, default=default, metavar=metavar)
