"""Shared test helpers: run the real CLI in a subprocess, always with a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


LAUNCHER_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables (a test may itself run under one)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_VARIABLES and not name.startswith(("SLURM_", "TORCHELASTIC_"))
    }
    return {**env, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **extra}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_cli(*args: str, timeout: float = 120, env: dict | None = None, cwd=None):
    """`python -m ddpcli ARGS` as a user would run it; a hang fails the test, not CI."""
    return run_bounded(
        [sys.executable, "-m", "ddpcli", *args], timeout, clean_env(**(env or {})), cwd
    )


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
