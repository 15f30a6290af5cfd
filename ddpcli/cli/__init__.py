"""The Typer app: one small function per command, flags -> config -> engine.

Each command lives in its own module here and registers itself on `app`.

Nothing here imports torch at module level: `ddpcli --help` answers at once.
"""

from __future__ import annotations

import os
import sys
import traceback
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

_state = {"debug": False}


@app.callback()
def _root(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    _state["debug"] = debug


def run_command(action, json_output: bool = False) -> None:
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


LEGACY_LOCAL_RANK = ("--local-rank", "--local_rank")


def adopt_legacy_local_rank(argv: list[str], environ) -> list[str]:
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
    from ddpcli.process import collect_then_freeze

    sys.argv = adopt_legacy_local_rank(sys.argv, os.environ)
    try:
        app()
    finally:
        collect_then_freeze()


# Each module registers its command(s) on `app` when imported.
from ddpcli.cli import barrier as _barrier  # noqa: E402, F401
from ddpcli.cli import checkenv as _checkenv  # noqa: E402, F401
from ddpcli.cli import checkpoint as _checkpoint  # noqa: E402, F401
from ddpcli.cli import train as _train  # noqa: E402, F401
