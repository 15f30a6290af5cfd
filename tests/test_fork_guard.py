"""A rank's forks wait for its other threads to sleep (ddpcli.fork_guard): the process
group's threads, caught mid-way by a fork, hung a loader worker before it ran a line."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time

import pytest

from ddpcli import fork_guard

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


class Hashing(threading.Thread):
    """Runs without the GIL (hashlib lets go of it on a large buffer), as a C++ thread of
    the process group does, until told to stop."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop, self.running = threading.Event(), threading.Event()

    def run(self) -> None:
        data = b"x" * (16 << 20)
        while not self.stop.is_set():
            self.running.set()
            hashlib.sha256(data).digest()


def test_a_running_thread_is_waited_for_within_the_bound_and_a_sleeping_one_is_not():
    sleeper = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    sleeper.start()
    assert fork_guard.wait_for_quiet_threads() is True
    hashing = Hashing()
    hashing.start()
    hashing.running.wait(5)
    try:
        assert hashing.native_id in fork_guard.busy_threads()
        started = time.monotonic()
        assert fork_guard.wait_for_quiet_threads(limit_s=0.05) is False
        assert 0.05 <= time.monotonic() - started < 1.0
    finally:
        hashing.stop.set()
        hashing.join(5)
    assert fork_guard.wait_for_quiet_threads() is True


FORK_AFTER_BUSY_THREAD = """
import hashlib, os, threading, time
from ddpcli import fork_guard

fork_guard.fork_only_when_quiet()
# One digest of 64 MiB holds no GIL for longer than the thread is busy: between digests it
# would wait for the GIL the forking thread holds, asleep, and so rightly not be waited for.
data, busy_until = b"x" * (64 << 20), []
def hash_for(seconds):
    busy_until.append(time.monotonic() + seconds)
    while time.monotonic() < busy_until[0]:
        hashlib.sha256(data).digest()
threading.Thread(target=hash_for, args=(0.03,)).start()
time.sleep(0.005)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, repr(time.monotonic()).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(float(os.read(read, 64)) >= busy_until[0])
"""


def test_a_fork_waits_until_the_busy_thread_is_done():
    result = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_BUSY_THREAD],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
