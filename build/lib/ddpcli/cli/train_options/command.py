"""`ddpcli train`'s own options, in Typer's default Options panel: where the settings start
from and what the command prints. Not settings of the run: TrainConfig has no field for them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ddpcli.cli.options import option

Recipe = Annotated[Path | None, option("TOML recipe; flags override it.", default="none")]

DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and exit.")]

JsonOutput = Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")]
