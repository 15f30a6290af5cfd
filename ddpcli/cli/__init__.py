"""The command line: one module per command, each a thin layer from flags to a validated
config to the engine. `app` holds the Typer app and the error funnel; `options` builds the
options from the config schemas; `train_options` declares `train`'s, one module per help
panel. Importing this package registers every command.

May import any part of ddpcli; no other part imports it. Nothing here imports torch at
module level: `ddpcli --help` answers at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

from ddpcli.cli import barrier, checkenv, checkpoint, data, eval, launch, plot, train
from ddpcli.cli.app import app

__all__ = [
    "adopt_legacy_local_rank", "app", "barrier", "checkenv", "checkpoint", "data", "eval",
    "launch", "main", "plot", "train",
]  # fmt: skip

LEGACY_LOCAL_RANK = ("--local-rank", "--local_rank")


def adopt_legacy_local_rank(argv: list[str], environ: MutableMapping[str, str]) -> list[str]:
    """`python -m torch.distributed.launch` passes `--local-rank=N` (older: `--local_rank N`)
    before our arguments. Recent launchers also set LOCAL_RANK; older ones do not, so the
    value moves there, where the launcher environment is read, and leaves argv."""
    kept, index = [], 0
    while index < len(argv):
        arg = argv[index]
        name, _, value = arg.partition("=")
        if name in LEGACY_LOCAL_RANK:
            if not value and index + 1 < len(argv):
                index, value = index + 1, argv[index + 1]
            environ.setdefault("LOCAL_RANK", value)
        else:
            kept.append(arg)
        index += 1
    return kept


def main() -> None:
    from ddpcli.interrupts import hold_interrupts_while_importing
    from ddpcli.process import collect_then_freeze, whole_lines

    hold_interrupts_while_importing("torch")  # else a Ctrl-C can be lost in it (interrupts.py)
    whole_lines()
    sys.argv = adopt_legacy_local_rank(sys.argv, os.environ)
    try:
        app()
    finally:
        collect_then_freeze()
