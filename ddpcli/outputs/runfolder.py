"""A run folder (`--out`) belongs to one run: a lock held for the run's life, and an earlier
run found there is refused unless the user says what to do with it (`--resume auto`, another
`--out`, or `--overwrite`). A scheduler's requeue of the same job continues it by itself.

The nodes of one multi-node job may share `--out` (a shared file system), and under an
outside launcher every rank runs this command: each process tries the lock, and those that
do not get it are admitted when its holder is another member of the same job (same master
address and port, same size). Only rank 0 writes the run's files.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import math
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ddpcli import ui
from ddpcli.config.plan import RunPlan
from ddpcli.environments import LauncherEnv, restarted_by
from ddpcli.environments.world import DEFAULT_MASTER_PORT
from ddpcli.errors import usage_error
from ddpcli.outputs.steplog import TENSORBOARD_DIR, read_rows

LOCK_FILE = ".lock"
# What a run writes in --out; `--overwrite` removes these and nothing else.
RUN_FILES = ("metrics.jsonl", "steps.jsonl", "config.json", "summary.json", "curves.png")
CHECKPOINT_FILES = ("*.pt", "*.pt.sha256", ".*.tmp")
HOLDER_READ_S = 2.0  # a lock just taken: how long its record may take to appear


@dataclass
class Holder:
    """Who holds a run folder's lock: written into the lock file for the others to read."""

    host: str
    pid: int
    job: str | None  # None: a run of its own, which admits no one
    # node rank (our launcher), rank (an outside launcher), or host and pid (an elastic
    # job, whose nodes have no rank until they meet) within the job
    member: int | str
    started: str

    def words(self) -> str:
        text = f"pid {self.pid} on {self.host}, started {self.started}"
        return f"{text}, member {self.member} of job {self.job}" if self.job else text


def membership(cfg: RunPlan, launcher: LauncherEnv | None) -> tuple[str | None, int | str]:
    """This process's job key and its place in the job: every node of one multi-node job
    (or every rank under an outside launcher) derives the same key."""
    if launcher is not None:
        key = f"{launcher.master_addr}:{launcher.master_port}, world size {launcher.world_size}"
        return (key if launcher.world_size > 1 else None), launcher.rank
    if cfg.nnodes == 1:
        return None, 0
    host, port = cfg.rendezvous_address(DEFAULT_MASTER_PORT)
    key = f"rendezvous {cfg.rdzv_id or 'ddpcli'} at {host}:{port}"
    if cfg.elastic:
        return f"{key}, {cfg.min_nnodes or cfg.nnodes}:{cfg.nnodes} nodes", (
            f"{socket.gethostname()} pid {os.getpid()}"
        )
    return f"{key}, {cfg.nnodes} nodes", cfg.node_rank


class RunFolderLock:
    """An exclusive flock on OUT/.lock, held by this process until `release`."""

    def __init__(self, out: Path, job: str | None, member: int | str) -> None:
        self.path = out / LOCK_FILE
        self.job = job
        self.member = member
        self.fd: int | None = None

    def acquire(self) -> bool:
        """Take the lock (True), or be admitted to the holder's job (False); else exit 2
        naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                self.check_admitted(read_holder(self.path))
                return False
            # a file system without locks (some NFS mounts): say so, run on
            ui.warn(
                f"cannot lock {self.path} ({error.strerror}): nothing stops a second run "
                "from writing into the same --out"
            )
            return True
        holder = Holder(
            host=socket.gethostname(),
            pid=os.getpid(),
            job=self.job,
            member=self.member,
            started=datetime.datetime.now().isoformat(timespec="seconds"),
        )
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(asdict(holder)) + "\n").encode())
        self.fd = fd
        return True

    def check_admitted(self, holder: Holder | None) -> None:
        same_job = holder is not None and self.job is not None and holder.job == self.job
        if same_job and holder is not None and holder.member != self.member:
            return  # another node (or rank) of this same job holds it
        folder = self.path.parent
        who = holder.words() if holder else "its holder left no record"
        raise usage_error(
            f"invalid --out: {folder} is in use by another run ({who}); wait for that run to "
            "end, or give this one another --out"
        )

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def read_holder(path: Path) -> Holder | None:
    """The holder's record; a lock taken a moment ago may not have written it yet."""
    deadline = time.monotonic() + HOLDER_READ_S
    while True:
        try:
            return Holder(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)


@contextlib.contextmanager
def claim_run_folder(cfg: RunPlan, launcher: LauncherEnv | None) -> Iterator[None]:
    """For the run's life: --out is this run's (locked), and an earlier run in it was
    continued (--resume), cleared (--overwrite, by the lock's holder only) or refused."""
    out = cfg.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise usage_error(f"invalid --out: cannot create {out} ({error.strerror})") from None
    job, member = membership(cfg, launcher)
    lock = RunFolderLock(out, job, member)
    # A member admitted to the holder's job leaves the earlier-run rules to the holder: what
    # it finds in OUT may be this very job's (an elastic host joining a running job).
    holds = lock.acquire()
    try:
        if cfg.resume is None and holds:
            if cfg.overwrite:
                clear_earlier_run(out)
            else:
                refuse_earlier_run(out)
        yield
    finally:
        lock.release()


def refuse_earlier_run(out: Path) -> None:
    found = describe_earlier_run(out)
    if found:
        raise usage_error(
            f"invalid --out: {out} already holds a run ({found}); continue it with --resume "
            "auto, give this run another --out, or replace it with --overwrite"
        )


def describe_earlier_run(out: Path) -> str | None:
    """What a finished or partial run left in OUT, in words; None when there is none."""
    metrics_file, last = out / "metrics.jsonl", out / "checkpoints" / "last.pt"
    if not metrics_file.exists() and not last.exists():
        return None
    epochs = read_rows(metrics_file)
    planned = read_planned_epochs(out / "config.json")
    words = []
    if epochs:
        done = max(int(epoch.get("epoch", 0)) for epoch in epochs)
        words.append(f"{done} of {planned} epochs done" if planned else f"{done} epoch(s) done")
        accuracies = [
            epoch["val_acc"]
            for epoch in epochs
            if isinstance(epoch.get("val_acc"), (int, float)) and math.isfinite(epoch["val_acc"])
        ]
        if accuracies:
            words.append(f"best val acc {100 * max(accuracies):.2f}%")
    else:
        words.append("no epoch finished")
    if last.exists():
        words.append("checkpoints/last.pt")
    return ", ".join(words)


def read_planned_epochs(path: Path) -> int | None:
    try:
        planned = json.loads(path.read_text()).get("epochs")
    except (OSError, ValueError, AttributeError):
        return None
    return planned if isinstance(planned, int) else None


def clear_earlier_run(out: Path) -> None:
    """--overwrite: remove what a run writes in OUT (nothing else the folder holds)."""
    found = describe_earlier_run(out)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir():
        for pattern in CHECKPOINT_FILES:
            for path in checkpoints.glob(pattern):
                path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: files of the user's own stay
            checkpoints.rmdir()
    board = out / TENSORBOARD_DIR  # --tensorboard's event files
    if board.is_dir():
        for path in board.glob("events.out.tfevents.*"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            board.rmdir()
    if found:
        ui.warn(f"--overwrite: removed the earlier run in {out} ({found})")


def continues_after_requeue(
    resume: str | None,
    out: Path,
    launcher: LauncherEnv | None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """A scheduler's requeue (or an agent's restart) runs the same command again: True when
    it must continue the run in OUT (as --resume auto) instead of refusing or clearing it."""
    reason = restarted_by(environ)
    if reason is None or resume is not None:
        return False
    if launcher is None or launcher.rank == 0:
        ui.info(
            f"{reason}: this job was started again; it continues from "
            f"{out / 'checkpoints' / 'last.pt'} if there (as with --resume auto)"
        )
    return True
