"""The Typer app every command registers on, and the one funnel that turns a command's
errors into a short message and an exit code (2 bad input, 1 run-time failure, 130 Ctrl-C).

Nothing here imports torch: `ddpcli --help` answers at once.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Annotated

import typer

from ddpcli import ui
from ddpcli.cli.options import App
from ddpcli.errors import DdpcliError, debug_requested

app = App(
    name="ddpcli",
    help="PyTorch DistributedDataParallel training on several GPUs or machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
checkpoint_app = App(help="Inspect, verify and convert checkpoints, safely.", no_args_is_help=True)
app.add_typer(checkpoint_app, name="checkpoint")
data_app = App(
    help="Pack a data set into tar shards, and verify them.",
    no_args_is_help=True,
)
app.add_typer(data_app, name="data")

_state = {"debug": False}


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    _state["debug"] = debug


def run_command(action: Callable[[], None]) -> None:
    """Run an engine call; turn our errors into a short message and their exit code."""
    try:
        action()
    except DdpcliError as error:
        if debug_requested(_state["debug"]):
            traceback.print_exc()
        ui.error(error.message)
        raise typer.Exit(error.exit_code) from None
    except KeyboardInterrupt:
        ui.error("interrupted")
        raise typer.Exit(130) from None
    except BrokenPipeError:  # `ddpcli ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(0) from None
    except Exception as error:  # an unexpected failure: one line, traceback on request
        if debug_requested(_state["debug"]):
            traceback.print_exc()
        ui.error(f"{type(error).__name__}: {error}".splitlines()[0])
        ui.error("run again with --debug (or DDPCLI_DEBUG=1) for the traceback")
        raise typer.Exit(1) from None
