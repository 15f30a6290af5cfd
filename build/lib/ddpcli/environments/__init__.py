"""Where the world comes from: which launcher started this process, and what it says.

Each launcher environment is one module with a `detect(environ)` that returns this process's
place in the world, or None when that launcher did not start it. `read_launcher_env` asks
them in order; the first that answers wins. Nothing else in ddpcli reads these variables.

May import only ddpcli.errors: dist and every package above it take the world from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpcli.environments import slurm, torchrun
from ddpcli.environments.world import LauncherEnv
from ddpcli.errors import usage_error

# torchrun first: under `srun torchrun ...` both are set, and torchrun made the workers.
ENVIRONMENTS = (torchrun, slurm)

__all__ = [
    "ENVIRONMENTS",
    "LauncherEnv",
    "check_meeting_place",
    "left_aside",
    "read_launcher_env",
    "restarted_by",
]


def read_launcher_env(environ: Mapping[str, str] | None = None) -> LauncherEnv | None:
    """This worker's place in the world when a launcher started it, else None."""
    env = os.environ if environ is None else environ
    for environment in ENVIRONMENTS:
        found = environment.detect(env)
        if found is not None:
            return found
    return None


def left_aside(environ: Mapping[str, str] | None = None) -> str | None:
    """Launcher variables that would have made a world but were not taken for one, in words
    (SLURM's outside srun); None when there are none."""
    return slurm.left_aside(os.environ if environ is None else environ)


def check_meeting_place(launcher: LauncherEnv, init_method: str | None) -> None:
    """Exit 2 when the ranks of an env:// world have nowhere to meet: MASTER_ADDR and
    MASTER_PORT unset and no --init-method naming the place (torch would say so only
    from inside init_process_group)."""
    if launcher.world_size == 1 or launcher.launcher != "env":
        return
    if init_method not in (None, "env://"):
        return
    missing = [
        name
        for name, value in (
            ("MASTER_ADDR", launcher.master_addr),
            ("MASTER_PORT", launcher.master_port),
        )
        if not value
    ]
    if missing:
        raise usage_error(
            f"{launcher.describe()} set, but not {' and '.join(missing)}: the ranks have "
            "nowhere to meet; set MASTER_ADDR and MASTER_PORT (rank 0's address and a free "
            "port) as torchrun does, or give --init-method tcp://HOST:PORT"
        )


def restarted_by(environ: Mapping[str, str] | None = None) -> str | None:
    """`SLURM_RESTART_COUNT=1` when a scheduler requeued this job, or an agent restarted its
    workers, and so started this same command again; None on a first start."""
    env = os.environ if environ is None else environ
    for environment in ENVIRONMENTS:
        count = env.get(environment.RESTART_VARIABLE, "")
        if count.isdigit() and int(count) > 0:
            return f"{environment.RESTART_VARIABLE}={count}"
    return None
