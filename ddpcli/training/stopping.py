"""How a training run stops before its end when asked to, without a traceback per rank.

- Ctrl-C: every rank stops at once; rank 0 says where the run was (`Interrupted`).
- A preemption signal (`--preempt-signal`, SIGTERM by default; SIGUSR1 for SLURM's
  `--signal=USR1@90`), sent to the launcher (which passes it on) or to any one worker: each
  rank notes it, and every `--log-every` steps, where the loop already waits for the
  loss reduction, one small all-reduce lets all ranks agree to stop at the same optimizer
  step. No host sync is added to the other steps. The run then saves a mid-epoch checkpoint
  (as `--max-steps` does) and ends; a resume continues exactly from it.
- The agent's SIGTERM after another rank failed: no preemption, the rank leaves at once
  (ddpcli.launcher.peer_failure).
- SIGTERM when the preemption signal is another (USR1): an ordinary termination. Every rank
  leaves at once without saving (a scheduler's SIGTERM after USR1 means the grace is over);
  rank 0 first leaves where the run stopped, for the launcher to say in one line. No stack
  dumps: the ranks were stopped, not stuck (--debug prints them).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from ddpcli.dist import DistContext, all_reduce_max
from ddpcli.errors import RUNTIME, STOPPED_FOR_PEER, debug_requested
from ddpcli.outputs.summary import StopRecord
from ddpcli.process import end_quietly, record_for_agent
from ddpcli.stacks import main_thread_now, place_in_words

# A rank still running this long after the preemption signal is most likely stuck (in a
# collective with a peer that died on another node, whose agent could leave no notice
# here): print where, before the agent's SIGKILL (30 s) ends it.
STUCK_AFTER_S = 20.0

# A rank ended by SIGTERM, as a shell reports it (128 + 15).
TERMINATED = 128 + signal.SIGTERM


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside the training loop, with where the run was (`stop_record`)."""

    def __init__(self, record: StopRecord) -> None:
        super().__init__("interrupted")
        self.record = record


def stop_record(
    reason: str,
    epoch: int,
    step: int,
    checkpoint_step: int | None,
    steps_per_epoch: int,
    out: Path,
    preempt_signal: str | None = None,
) -> StopRecord:
    """What the launcher needs to say where a run stopped and what a resume starts from;
    EPOCH is 1-based, the one the run was in. PREEMPT_SIGNAL: named for a termination."""
    last = out / "checkpoints" / "last.pt"
    saved, where = None, None
    if checkpoint_step is not None:
        epochs, into = divmod(checkpoint_step, max(1, steps_per_epoch))
        where = f"epoch {epochs}" if into == 0 else f"step {checkpoint_step}, in epoch {epochs + 1}"
        saved = str(last)
    elif last.exists():
        saved = str(last)
    return StopRecord(reason, epoch, step, str(out), saved, where, preempt_signal)


class Preemption:
    """Notes the preemption signal while the loop runs, and tells when all ranks agree.

    Python runs a signal handler only between bytecodes of the main thread, which a rank
    stuck in a collective never reaches; the interpreter's wakeup file descriptor is written
    at once, so a small thread sees the signal even then and arms the stack dump."""

    def __init__(
        self, signal_name: str, every_steps: int, on_terminate: Callable[[], None] | None = None
    ) -> None:
        """ON_TERMINATE: called before the rank leaves on a SIGTERM that is not the
        preemption signal (rank 0 records where the run stopped)."""
        self.signum = signal.Signals[f"SIG{signal_name}"]
        self.every_steps = max(1, every_steps)
        self.received = threading.Event()
        self.agreed = False
        self.on_terminate = on_terminate
        # Watched too when it does not preempt: else it ends the rank with a stack dump.
        self.watched = {self.signum, signal.SIGTERM}
        self._previous: dict[signal.Signals, Any] = {}
        self._pipe: tuple[int, int] | None = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            return self  # signal handlers can only be set there; nothing to watch
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        self._pipe = (read_end, write_end)
        for signum in self.watched:
            self._previous[signum] = signal.signal(signum, lambda *_: None)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_end,), daemon=True).start()
        return self

    def _watch(self, read_end: int) -> None:
        while data := os.read(read_end, 64):
            if signal.SIGTERM in data and self.signum != signal.SIGTERM:
                self._terminate()
            if self.signum in data and not self.received.is_set():
                if _failed_peer_noticed() and not self.agreed:  # not while saving for one
                    leave_for_failed_peer()
                self.received.set()
                faulthandler.dump_traceback_later(STUCK_AFTER_S)
        os.close(read_end)

    def _terminate(self) -> NoReturn:
        """Out now, from this thread: the main one may be inside a collective."""
        if _failed_peer_noticed():
            leave_for_failed_peer()
        _terminating.set()
        if self.on_terminate is not None:
            with contextlib.suppress(Exception):  # leaving matters more than the record
                self.on_terminate()
        if debug_requested():
            faulthandler.dump_traceback(all_threads=True)
        # Said when this rank alone got it: the launcher names it as the rank that failed.
        record_for_agent(RuntimeError(f"SIGTERM, not the preemption signal ({self.signal_name})"))
        end_quietly(TERMINATED)

    def __exit__(self, *exc: object) -> None:
        faulthandler.cancel_dump_traceback_later()  # the loop has ended: not stuck in it
        if self._pipe is None:
            return
        signal.set_wakeup_fd(-1)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous or signal.SIG_DFL)
        with contextlib.suppress(OSError):
            os.close(self._pipe[1])  # the watching thread reads the end of the pipe and ends
        self._pipe = None

    @property
    def signal_name(self) -> str:
        return self.signum.name

    def stop_now(self, step: int, ctx: DistContext, boundary: bool = False) -> bool:
        """True, on every rank alike, once any rank received the signal. Asked after each
        optimizer step; it communicates every `every_steps` steps, and at epoch ends
        (BOUNDARY), and nowhere else."""
        if self.agreed:
            return True
        if not boundary and step % self.every_steps:
            return False
        flag = torch.tensor([1.0 if self.received.is_set() else 0.0], device=ctx.device)
        self.agreed = bool(all_reduce_max(flag, ctx).item() > 0)
        return self.agreed


_peer_failed_notice: Path | None = None


def note_failed_peers(notice: Path) -> None:
    """The agent touches NOTICE before it stops the other ranks after one failed: a rank
    that finds it when the signal comes was not preempted, and leaves at once."""
    global _peer_failed_notice
    _peer_failed_notice = notice


def _failed_peer_noticed() -> bool:
    return _peer_failed_notice is not None and _peer_failed_notice.exists()


def leave_for_failed_peer() -> NoReturn:
    """Out now, from any thread, even while the main one waits in a collective: the job
    has already failed, and the agent names the rank that did. Where the main thread was
    goes with it: a rank busy outside any collective when the others gave up waiting is the
    one they waited for (ddpcli.launcher.failure_report)."""
    place, waiting = main_thread_now()
    where = f" while {'waiting' if waiting else 'busy'} at {place_in_words(place)}" if place else ""
    record_for_agent(RuntimeError(STOPPED_FOR_PEER + where))
    end_quietly(RUNTIME)


_terminating = threading.Event()


def wait_if_terminating() -> None:
    """A rank's error while its SIGTERM is being handled (a peer that already left) is a
    consequence: the thread that handles it ends the process, with the record it writes."""
    if _terminating.is_set():
        time.sleep(10)


_interrupted = threading.Event()


def note_interrupts() -> None:
    """Ctrl-C raises KeyboardInterrupt as usual, and is remembered: an error a rank meets
    afterwards (a peer that already stopped) is a consequence, not news."""

    def interrupt(signum: int, frame: object) -> None:
        _interrupted.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


def was_interrupted() -> bool:
    return _interrupted.is_set()
