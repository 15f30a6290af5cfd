"""Ctrl-C held back where a KeyboardInterrupt would be lost, or would leave work half done.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside torch's import
it can be lost: torch's C++ start-up imports numpy, takes a failure there for "no numpy" (a
warning), and goes on, so a Ctrl-C pressed then does nothing (the launcher kept its job running
until a second one), and what follows runs on a torch without numpy (a later `import numpy`:
"cannot load module more than once per process"). Held, the Ctrl-C is taken when the block ends.

Where the main thread waits in C++ instead (joining the process group), Python's handler never
runs at all: there a Ctrl-C that the wait does not end within a grace ends the process.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any


class InterruptsHeld:
    """Ctrl-C taken when the block ends, not inside it (in the main thread; elsewhere Python
    raises no KeyboardInterrupt). A block that fails of itself raises its own error."""

    def __enter__(self) -> InterruptsHeld:
        self.came = False
        self.previous = signal.getsignal(signal.SIGINT)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.note)
        return self

    def note(self, signum: int, frame: object) -> None:
        self.came = True

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGINT, self.previous)
        if self.came and kind is None and callable(self.previous):
            self.previous(signal.SIGINT, None)  # Python's own: raises KeyboardInterrupt


def hold_interrupts_while_importing(name: str) -> None:
    """The first import of the top-level package NAME, wherever it happens in this process
    (a user's script too), runs with Ctrl-C held: found by the usual finders, loaded by its
    own loader inside InterruptsHeld. Installed before anything imports NAME; once imported,
    the finder is gone."""
    if name not in sys.modules:
        sys.meta_path.insert(0, HeldImportFinder(name))


class HeldImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: what follows finds it the usual way
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = HeldLoader(spec.loader)
                return spec
        return None


class HeldLoader(importlib.abc.Loader):
    """A module's own LOADER, its execution inside InterruptsHeld; the module keeps that
    loader as its own (torch's resources are found through it)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:  # the import system made it from the spec: it has one
            module.__spec__.loader = self.loader
        with InterruptsHeld():
            self.loader.exec_module(module)


# How long after a Ctrl-C a wait on peers may go on before it is taken for stuck: a call
# into C++ that returns (a store's reply) lets Python's handler run well within it.
STUCK_AFTER_CTRL_C_S = 2.0
INTERRUPTED = 130  # 128 + SIGINT, the code a Ctrl-C ends a rank with


@contextlib.contextmanager
def ctrl_c_ends_a_stuck_wait(
    grace_s: float = STUCK_AFTER_CTRL_C_S, said: bool = False
) -> Iterator[None]:
    """For a block that only waits on peers (joining the process group, nothing to save yet):
    a Ctrl-C the block has not ended by GRACE_S later ends the process with 130, quietly
    unless SAID (a process no launcher speaks for: it says `error: interrupted`). The
    wait runs in C++, where Python's handler never runs, and a peer that the same Ctrl-C
    ended never comes: a launched rank sat out the launcher's 30 s grace, one started by
    hand its whole timeout. Python's C handler still writes each signal's number to the
    wakeup fd, which a thread here reads."""
    handled = callable(signal.getsignal(signal.SIGINT))  # else Python's C handler is not in
    if not handled or threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block on a full pipe
    over = threading.Event()
    previous = None
    watch = None
    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        watch = threading.Thread(
            target=end_when_stuck, args=(read_end, previous, over, grace_s, said), daemon=True
        )
        watch.start()
        yield
    finally:  # also after a Ctrl-C taken as KeyboardInterrupt on the way in
        if previous is not None:
            signal.set_wakeup_fd(previous)
        over.set()
        os.close(write_end)  # the watch reads the end of the pipe, and returns
        if watch is not None and watch.ident is not None:
            watch.join()
        os.close(read_end)


def end_when_stuck(
    read_end: int, previous: int, over: threading.Event, grace_s: float, said: bool
) -> None:
    while signals := os.read(read_end, 64):
        if previous >= 0:  # the wakeup fd set before ours still hears of every signal
            with contextlib.suppress(OSError):
                os.write(previous, signals)
        if signal.SIGINT in signals and not over.wait(grace_s):
            if said:  # written past sys.stderr, whose lock the stuck main thread may hold
                os.write(2, b"error: interrupted\n")
            os._exit(INTERRUPTED)
