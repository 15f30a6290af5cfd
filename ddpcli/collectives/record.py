"""A rank's flight record: torch's flight recorder on in every rank, dumped when the job stops.

The recorder keeps a ring of each rank's last collectives (sequence number, op, sizes, and
where Python issued it) at the cost of a few microseconds a collective. It is on when
`TORCH_FR_BUFFER_SIZE` is set before the process group forms (`recorder_environment`; Gloo
and NCCL alike in torch 2.14). A rank leaves its record in its launcher's records folder:
- when it fails itself (a collective that timed out, a peer gone): `dump_if_armed`;
- when its agent asks, after another rank failed: a file the agent touches, which a small
  thread watches; the main thread may be inside a collective that never returns;
- when Gloo aborts it for a mismatched collective (SIGABRT from one of Gloo's threads,
  which no Python handler survives): a C-level handler made with ctypes dumps first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ddpcli.files import write_bytes_atomic

# The ring's length: a step of a DDP model issues a collective per gradient bucket (a few),
# so the last 2000 reach back many steps.
BUFFER_ENTRIES = 2000
# Each rank's record is RECORD_PREFIX + its global rank, the name torch's analyzer reads
# (`python -m torch.distributed.flight_recorder.fr_trace FOLDER --prefix rank_`).
RECORD_PREFIX = "rank_"
# Touched by the agent in the records folder: every live rank dumps its record.
REQUEST_FILE = "dump-request"
REQUEST_POLL_S = 0.1
# Named to the ranks by the launcher, as the stacks folder is.
RECORDS_FOLDER_VARIABLE = "DDPCLI_RECORDS_DIR"
# A dump from a dying rank that hangs (a lock held by the thread that aborted) must not keep
# it alive: SIGALRM's default action ends it this long after.
DUMP_DEADLINE_S = 20


def recorder_environment(on: bool, records: Path | None) -> dict[str, str]:
    """The variables each rank needs before its process group forms."""
    if not on or records is None:
        return {"TORCH_FR_BUFFER_SIZE": "0"}
    return {"TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES), RECORDS_FOLDER_VARIABLE: str(records)}


def record_name(rank: int) -> str:
    return f"{RECORD_PREFIX}{rank}"


def repaired_dump(dump: dict) -> dict:
    """DUMP as torch's analyzer reads it. On Gloo, pg_config comes out keyed by '' (name and
    desc empty) while the entries name their group ('0', 'default_pg'), and the analyzer
    looks groups up by the entries' names: key it by those, with their desc."""
    groups = {tuple(entry["process_group"]) for entry in dump.get("entries", [])}
    config = dict(dump.get("pg_config", {}))
    anonymous = config.get("")
    for name, desc in groups:
        if name not in config and anonymous is not None:
            config[name] = {**anonymous, "name": name, "desc": desc}
    if groups and all(name != "" for name, _ in groups):
        config.pop("", None)
    return {**dump, "pg_config": config}


def dump_record(folder: Path, rank: int, error: str | None = None) -> bool:
    """This rank's record, written whole into FOLDER (a reader never sees half of one), with
    the ERROR it failed on, if any; False if there is none (the recorder is off, or no
    collective ran)."""
    from torch._C import _distributed_c10d

    try:
        dump_trace: Any = getattr(_distributed_c10d, "_dump_fr_trace")  # noqa: B009 - untyped
        with inductor_stand_in():
            raw = dump_trace(True, True, False)  # with where Python issued each collective
    except (RuntimeError, AttributeError):
        return False
    record = repaired_dump(pickle.loads(raw))
    if not record.get("entries"):
        return False
    record["ddpcli"] = {
        "host": socket.gethostname(), "rank": rank, "pid": os.getpid(), "error": error,
        "stack": main_thread_stack(), "progress": progress_now(),
    }  # fmt: skip
    write_bytes_atomic(folder / record_name(rank), pickle.dumps(record))
    return True


@contextlib.contextmanager
def inductor_stand_in() -> Iterator[None]:
    """torch asks `torch._inductor.codecache.PyCodeCache` of each frame it writes whether
    inductor generated its code. Where torch._inductor was never imported (a plain script:
    DDP imports it, through torch._dynamo) it generated none, and the question would import
    it: seconds of a dying rank's time, more on a busy machine. A stand-in answers "no" for
    the length of the dump."""
    import torch

    if "torch._inductor" in sys.modules:
        yield
        return
    no_code = types.SimpleNamespace(stack_frames_for_code=lambda path, line: None)
    stand_in = types.SimpleNamespace(codecache=types.SimpleNamespace(PyCodeCache=no_code))
    attributes = vars(torch)
    attributes["_inductor"] = stand_in
    try:
        yield
    finally:
        if attributes.get("_inductor") is stand_in:  # a real import since replaced it: kept
            del attributes["_inductor"]


def main_thread_stack() -> list[dict]:
    """Where the rank's main thread is now, innermost first (read from the thread that
    dumps: the main one may be waiting inside a collective). No source lines: no file read."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return [
        {"file": f.f_code.co_filename, "line": line, "function": f.f_code.co_name}
        for f, line in traceback.walk_stack(frame)
    ] if frame else []  # fmt: skip


class Recorder:
    """One rank's side: dumps on request, on Gloo's abort, and when told (`dump`)."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder = folder
        self.rank = rank
        self._dumped = threading.Lock()  # at most one dump per rank, whoever asks first
        self._abort_handler: Any = None  # kept: ctypes calls it after Python forgot it

    def dump(self, error: str | None = None) -> None:
        if self._dumped.acquire(blocking=False):
            with contextlib.suppress(Exception):  # the rank's own failure matters more
                dump_record(self.folder, self.rank, error)

    def watch_requests(self) -> None:
        threading.Thread(target=self._watch, name="ddpcli-record", daemon=True).start()

    def _watch(self) -> None:
        request = self.folder / REQUEST_FILE
        while not request.exists():
            time.sleep(REQUEST_POLL_S)
        self.dump()

    def dump_on_abort(self) -> None:
        """Gloo's C++ thread ends the process with abort(): SIGABRT, where no Python handler
        runs. A C-level one made with ctypes takes the interpreter's lock (released by the
        main thread waiting in the collective) and dumps, then abort() ends the process."""
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None)
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)

        def on_abort(_signum: int) -> None:
            libc.alarm(DUMP_DEADLINE_S)
            self.dump()
            libc.signal(signal.SIGABRT, None)  # SIG_DFL: abort() raises it again, and ends

        self._abort_handler = handler_type(on_abort)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signal.SIGABRT, self._abort_handler)


_recorder: Recorder | None = None


def arm_from_environment() -> None:
    """This rank keeps its record for its launcher, in the folder the launcher named (none
    named, or the recorder off: nothing is armed). Called first thing in a rank."""
    folder = os.environ.get(RECORDS_FOLDER_VARIABLE)
    if folder and os.environ.get("TORCH_FR_BUFFER_SIZE", "0") != "0":
        arm(Path(folder), int(os.environ.get("RANK", "0")))


def arm(folder: Path, rank: int) -> None:
    global _recorder
    _recorder = Recorder(Path(folder), rank)
    _recorder.watch_requests()
    _recorder.dump_on_abort()


# Where the rank's own loop is (ddpcli train's: epoch and step), read when it dumps.
_progress: Callable[[], dict[str, int]] | None = None


def follow_progress(progress: Callable[[], dict[str, int]]) -> None:
    global _progress
    _progress = progress


def progress_now() -> dict[str, int] | None:
    with contextlib.suppress(Exception):  # read from another thread, mid-step
        return _progress() if _progress is not None else None
    return None


def dump_if_armed(error: BaseException) -> None:
    """Called on a rank's own way out after ERROR: its record, for the verdict."""
    if _recorder is not None:
        _recorder.dump(f"{type(error).__name__}: {str(error).strip()[:2000]}")
