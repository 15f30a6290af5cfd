"""The answer every launcher environment gives: this process's place in the world, and the
reading of the variables it comes from (a value that cannot be one is exit 2, naming it)."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from ddpcli.errors import usage_error

# torchrun's default master port: where a job meets unless told otherwise.
DEFAULT_MASTER_PORT = 29500


def tcp_address(init_method: str) -> tuple[str, int]:
    """tcp://HOST:PORT (TrainConfig has checked its form) as (HOST, PORT)."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host, int(port)


# Launchers that start their workers only once the world has formed (torchrun's agent, ours):
# the others' workers are what waits for the whole world to come.
FORMED_BY_AN_AGENT = ("elastic",)
NAMES = {"slurm": "SLURM's srun", "env": "a launcher's env:// variables", "elastic": "torchrun"}


class LauncherEnv(BaseModel):
    """Rank information a launcher (torchrun, the legacy launcher, SLURM, or our own
    elastic agent) hands to a worker through environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    launcher: str = "torchrun"
    agent_store: bool = False  # the elastic agent serves a TCPStore at MASTER_ADDR:PORT
    # The variables this world was read from, as they were set (`SLURM_PROCID=1 ...`).
    variables: dict[str, str] = {}

    def describe(self) -> str:
        """`SLURM's srun (SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=2 ...)`: who made the world."""
        name = NAMES.get(self.launcher, self.launcher)
        shown = " ".join(f"{variable}={value}" for variable, value in self.variables.items())
        return f"{name} ({shown})" if shown else name

    def joining(self, timeout_s: float, init_method: str | None) -> str | None:
        """The line a rank says before it waits for the rest of a world its launcher did not
        form: which variables made it, and where and how long it waits. None where an agent
        formed it (its workers meet at once) or the world is this one process."""
        if self.launcher in FORMED_BY_AN_AGENT or self.world_size == 1:
            return None
        place = init_method or f"{self.master_addr}:{self.master_port or DEFAULT_MASTER_PORT}"
        return (
            f"rank {self.rank} of {self.world_size}, from {self.describe()}: waiting up to "
            f"{timeout_s:g} s (--timeout) for the others at {place}"
        )


def whole_number(
    env: Mapping[str, str], name: str, fix: str, default: int | None = None, least: int = 0
) -> int:
    """ENV[NAME] as a whole number of at least LEAST (DEFAULT when unset or empty); anything
    else is exit 2 naming the variable, with FIX, what to do about it."""
    text = env.get(name, "").strip()
    if not text and default is not None:
        return default
    if not text.isdigit() or int(text) < least:
        at_least = f" of at least {least}" if least else ""
        raise usage_error(f"invalid {name}: give a whole number{at_least} (got {text!r}); {fix}")
    return int(text)


def rank_below(
    env: Mapping[str, str],
    name: str,
    world_size: int,
    world_name: str,
    fix: str,
    default: int | None = None,
) -> int:
    """ENV[NAME], a rank, checked against the world it belongs to: 0..WORLD_SIZE-1."""
    rank = whole_number(env, name, fix, default)
    if rank >= world_size:
        raise usage_error(
            f"invalid {name}: {rank} is not below {world_name}={world_size} (ranks are "
            f"0..{world_size - 1}); {fix}"
        )
    return rank


def set_variables(env: Mapping[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """NAME=value for each of NAMES set in ENV, in that order: what a world was read from."""
    return {name: env[name] for name in names if env.get(name, "") != ""}


def master_port(env: Mapping[str, str]) -> int | None:
    """MASTER_PORT, when set: a port number, 1-65535."""
    if env.get("MASTER_PORT", "").strip() == "":
        return None
    port = whole_number(env, "MASTER_PORT", "set it to a free port, 1-65535", least=1)
    if port > 65535:
        raise usage_error(f"invalid MASTER_PORT: ports are 1-65535 (got {port})")
    return port
