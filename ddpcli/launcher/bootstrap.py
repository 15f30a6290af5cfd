"""One worker of `ddpcli launch`: run the user's script (or module) as `python SCRIPT` or
`python -m MODULE` would, in a process the launcher can report on.

Started as `python -m ddpcli.launcher.bootstrap [-m] TARGET ARGS...` by the elastic agent, with
torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ...). The script needs no change:
no `@record`, no signal handling. An uncaught exception is printed as Python would print
it and recorded in the agent's error file, so the launcher names it, except where it only
says that another rank is gone (one line then: with 8 ranks, 7 such tracebacks buried the
one that mattered); SIGTERM (the agent stopping the job) first writes every thread's stack
to a file, from which the launcher says where the rank was; Ctrl-C ends quietly.

Torch is imported only to record a failure: a script that never imports it stays light.
"""

from __future__ import annotations

import os
import signal

if __name__ == "__main__":
    # Until the script runs, a Ctrl-C (the agent passes the terminal's on to every worker)
    # ends this worker quietly, as one in the script does; Python's own printed a traceback
    # of the imports below, which on a busy machine take a second or more.
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))

import contextlib
import faulthandler
import runpy
import sys
import time
import traceback
from pathlib import Path

from ddpcli.collectives import record
from ddpcli.errors import (
    INTERRUPTED,
    backend_gist,
    debug_requested,
    gave_up_waiting,
    lost_a_peer,
)
from ddpcli.interrupts import hold_interrupts_while_importing
from ddpcli.process import die_with_parent, record_for_agent
from ddpcli.stacks import (
    STACKS_FOLDER_VARIABLE,
    finished_file_name,
    is_users_code,
    place_in_words,
    stack_output,
)

USAGE_TEXT = "usage: python -m ddpcli.launcher.bootstrap [-m] SCRIPT.py|FOLDER|MODULE [ARGS...]"


def run_target(target: str, as_module: bool, args: list[str]) -> None:
    """What `python SCRIPT ARGS` (or `python -m MODULE ARGS`) does, in this process."""
    if as_module:
        sys.argv = [target, *args]  # runpy puts the module's file name in argv[0]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [target, *args]
    # Python puts the script's folder first on the path (here it put the working folder),
    # and a folder with __main__.py itself.
    path = os.path.abspath(target)
    sys.path[0] = path if os.path.isdir(path) else os.path.dirname(path)
    runpy.run_path(target, run_name="__main__")


def print_user_traceback(error: BaseException) -> None:
    """The traceback as `python SCRIPT` would print it: from the script's own frames, without
    this module's and runpy's above them."""
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    frames = error.__traceback__
    while frames is not None and frames.tb_frame.f_code.co_filename in ours:
        frames = frames.tb_next
    traceback.print_exception(type(error), error, frames or error.__traceback__)


def print_failure(error: BaseException) -> None:
    """A rank that failed only because of another one (it lost its connection to it, or gave
    up waiting for it at a collective) says so in one line, with where it was: the launcher
    names the rank that started it, whose traceback seven others buried on 8 GPUs.
    DDPCLI_DEBUG=1 prints the traceback all the same."""
    consequence = consequence_in_words(error)
    if debug_requested() or not consequence:
        print_user_traceback(error)
        return
    # One write: the agent may stop this rank at any moment, and the script's own streams
    # are the user's (no ddpcli.process.whole_lines here).
    sys.stderr.write(f"rank {os.environ.get('RANK', '?')} {consequence}\n")


def consequence_in_words(error: BaseException) -> str:
    """What this rank's error says of another rank, or "" if it may be its own."""
    text = str(error)
    said = f"{users_place(error)} ({type(error).__name__}: {backend_gist(error)})"
    if lost_a_peer(text):
        return f"lost its connection to another rank{said}; the launcher names the first to fail"
    if gave_up_waiting(error):
        return f"gave up waiting for another rank{said}; the launcher names the one it waited for"
    return ""


def users_place(error: BaseException) -> str:
    """ " at train.py:42 in step(): dist.all_reduce(loss)", the script's innermost line."""
    frames = traceback.extract_tb(error.__traceback__)
    theirs = [frame for frame in frames if is_users_code({"file": frame.filename})]
    if not theirs:
        return ""
    frame = theirs[-1]
    where = {"file": frame.filename, "line": frame.lineno, "function": frame.name}
    return f" at {place_in_words({**where, 'code': frame.line})}"


def end_now(exit_code: int) -> None:
    """Out at once: atexit hooks of a failed script could wait on peers that are gone."""
    faulthandler.unregister(signal.SIGTERM)  # the agent's SIGTERM now is no news
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def script_finished(reports: str) -> None:
    """The script ended well: said to the launcher in its folder REPORTS, then the process
    group closed. A rank that ends while the others still call collectives with it is the
    cause of their failure, even when the agent stops it in its own exit."""
    if reports:
        with contextlib.suppress(OSError, KeyError, ValueError):
            (Path(reports) / finished_file_name(int(os.environ["RANK"]))).touch()
    close_process_group()


def main(argv: list[str]) -> None:
    die_with_parent()
    hold_interrupts_while_importing("torch")  # the script's import: else Ctrl-C can be lost
    reports = os.environ.pop(STACKS_FOLDER_VARIABLE, "")  # not the script's business
    # Where a stopped rank was stuck. faulthandler keeps the file open for the process's life.
    faulthandler.register(signal.SIGTERM, file=stack_output(reports), all_threads=True, chain=True)
    record.arm_from_environment()
    as_module = len(argv) > 1 and argv[1] == "-m"
    rest = argv[2:] if as_module else argv[1:]
    if not rest:
        print(USAGE_TEXT, file=sys.stderr)
        end_now(2)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # from here, the script's
    try:
        run_target(rest[0], as_module, rest[1:])
    except SystemExit as leaving:
        if leaving.code in (0, None):
            script_finished(reports)
        raise  # the script's own exit status, as Python gives it
    except KeyboardInterrupt:  # Ctrl-C: the launcher says it once for the whole job
        end_now(INTERRUPTED)
    except BaseException as error:
        try:
            fail(error)
        except KeyboardInterrupt:  # the agent's Ctrl-C, while this rank was failing
            end_now(INTERRUPTED)
    script_finished(reports)


# How long a rank that lost a peer waits for a Ctrl-C of its own before it says so.
CTRL_C_LAG_S = 0.5


def fail(error: BaseException) -> None:
    """The script failed with ERROR: recorded for the agent, said, and the rank ended."""
    # Failing already: the agent's SIGTERM to the others may reach this rank too.
    faulthandler.unregister(signal.SIGTERM)
    record.dump_if_armed(error)  # for the verdict, if ranks stopped agreeing
    record_for_agent(error)
    if lost_a_peer(str(error)):
        # The agent passes a Ctrl-C on to its workers one after another: a rank whose peer
        # ended on it first can lose the connection before its own comes (raised here).
        time.sleep(CTRL_C_LAG_S)
    print_failure(error)
    end_now(1)


def close_process_group() -> None:
    """The process group a finished script left open, closed while the interpreter still
    runs, as torch asks scripts to do. Left to the interpreter's exit, a rank 0 that hosts
    the store (each round's own: ddpcli.launcher.script_launch.restart_safe) now and then
    aborts there ("terminate called without an active exception"), and a finished job fails."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
