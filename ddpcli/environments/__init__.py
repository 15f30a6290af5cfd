"""Where the world comes from: which launcher started this process, and what it says.

Each launcher environment is one module with a `detect(environ)` that returns this process's
place in the world, or None when that launcher did not start it. `read_launcher_env` asks
them in order; the first that answers wins. Nothing else in ddpcli reads these variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpcli.environments import slurm, torchrun
from ddpcli.environments.world import LauncherEnv

# torchrun first: under `srun torchrun ...` both are set, and torchrun made the workers.
ENVIRONMENTS = (torchrun, slurm)

__all__ = ["ENVIRONMENTS", "LauncherEnv", "read_launcher_env", "restarted_by"]


def read_launcher_env(environ: Mapping[str, str] | None = None) -> LauncherEnv | None:
    """This worker's place in the world when a launcher started it, else None."""
    env = os.environ if environ is None else environ
    for environment in ENVIRONMENTS:
        found = environment.detect(env)
        if found is not None:
            return found
    return None


def restarted_by(environ: Mapping[str, str] | None = None) -> str | None:
    """`SLURM_RESTART_COUNT=1` when a scheduler requeued this job, or an agent restarted its
    workers, and so started this same command again; None on a first start."""
    env = os.environ if environ is None else environ
    for environment in ENVIRONMENTS:
        count = env.get(environment.RESTART_VARIABLE, "")
        if count.isdigit() and int(count) > 0:
            return f"{environment.RESTART_VARIABLE}={count}"
    return None
