"""Shared test helpers: run the real CLI in a subprocess, always with a timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 120, env: dict | None = None, cwd=None):
    """`python -m ddpcli ARGS` as a user would run it; a hang fails the test, not CI."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if env is None or name not in env:
            full_env.pop(name, None)
    return run_bounded([sys.executable, "-m", "ddpcli", *args], timeout, full_env, cwd)


def run_bounded(command: list[str], timeout: float, env: dict | None = None, cwd=None):
    """Run a command in its own session; on timeout kill the whole process group (the
    launcher and every worker), then fail the test the way subprocess.run would."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd or REPO,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(command)}\n{stderr[-3000:]}"
        ) from None
    kill_group(process.pid)  # nothing of the job may outlive it
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` exist everywhere and run only where CUDA does."""
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
