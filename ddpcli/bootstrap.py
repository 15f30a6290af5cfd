"""One worker of `ddpcli launch`: run the user's script (or module) as `python SCRIPT` or
`python -m MODULE` would, in a process the launcher can report on.

Started as `python -m ddpcli.bootstrap [-m] TARGET ARGS...` by the elastic agent, with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...). The script needs no change:
no `@record`, no signal handling. An uncaught exception is printed as Python would print
it and recorded in the agent's error file, so the launcher names it; SIGTERM (the agent
stopping a stuck job) first dumps every thread's stack; Ctrl-C ends quietly.

Torch is imported only to record a failure: a script that never imports it stays light.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import traceback

from ddpcli.errors import INTERRUPTED
from ddpcli.process import die_with_parent, record_for_agent

USAGE_TEXT = "usage: python -m ddpcli.bootstrap [-m] SCRIPT.py|MODULE [ARGS...]"


def run_target(target: str, as_module: bool, args: list[str]) -> None:
    """What `python SCRIPT ARGS` (or `python -m MODULE ARGS`) does, in this process."""
    if as_module:
        sys.argv = [target, *args]  # runpy puts the module's file name in argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    # Python puts the script's folder first on the path (here it put the working folder).
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")


def print_user_traceback(error: BaseException) -> None:
    """The traceback as `python SCRIPT` would print it: from the script's own frames, without
    this module's and runpy's above them."""
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    frames = error.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename in ours:
        frames = frames.tb_next
    traceback.print_exception(type(error), error, frames or error.__traceback__)


def end_now(exit_code: int) -> None:
    """Out at once: atexit hooks of a failed script could wait on peers that are gone."""
    faulthandler.unregister(signal.SIGTERM)  # the agent's SIGTERM now is no news
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def main(argv: list[str]) -> None:
    die_with_parent()
    faulthandler.register(signal.SIGTERM, chain=True)  # where a stopped rank was stuck
    as_module = len(argv) > 1 and argv[1] == "-m"
    rest = argv[2:] if as_module else argv[1:]
    if not rest:
        print(USAGE_TEXT, file=sys.stderr)
        end_now(2)
    try:
        run_target(rest[0], as_module, rest[1:])
    except SystemExit:
        raise  # the script's own exit status, as Python gives it
    except KeyboardInterrupt:  # Ctrl-C: the launcher says it once for the whole job
        end_now(INTERRUPTED)
    except BaseException as error:
        # Failing already: the agent's SIGTERM to the others may reach this rank too.
        faulthandler.unregister(signal.SIGTERM)
        print_user_traceback(error)
        record_for_agent(error)
        end_now(1)


if __name__ == "__main__":
    main(sys.argv)
