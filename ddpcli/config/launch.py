"""`ddpcli launch`'s configuration: which script (or module) to run, on how many processes
and nodes, and how the nodes meet. torchrun's flag spellings land on the same fields."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ddpcli.config.common import (
    CommandConfig,
    GpuList,
    Membership,
    RdzvBackend,
    check_membership,
    check_node_rank,
    from_comma_text,
    given,
    nproc_spec,
    parse_int_list,
    pod_defaults,
    split_nnodes,
    validated,
    with_origins,
)
from ddpcli.errors import DdpcliError, usage_error

# Below a second no rank can even join: the rendezvous is bounded by --timeout.
MIN_TIMEOUT_S = 1.0


class ScriptLaunchConfig(Membership, CommandConfig):
    """Everything `ddpcli launch` needs. Field names are the flags with `_` for `-`."""

    target: str = Field(min_length=1)  # SCRIPT.py, or MODULE with `module`
    module: bool = False
    script_args: list[str] = Field(default_factory=list)
    gpus: GpuList = None
    nproc: int | None = Field(None, ge=1, le=1024)
    nnodes: int = Field(1, ge=1)  # the most nodes; `--nnodes MIN:MAX` sets both
    min_nnodes: int | None = Field(None, ge=1)
    node_rank: int = Field(0, ge=0)
    master_addr: str = Field("127.0.0.1", min_length=1)
    master_port: int | None = Field(None, ge=1, le=65535)
    rdzv_backend: RdzvBackend | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    standalone: bool = False
    ifname: str | None = None
    max_restarts: int = Field(0, ge=0)
    timeout: float = Field(300.0, ge=MIN_TIMEOUT_S, description="seconds for the rendezvous")
    log_dir: str | None = None
    flight_recorder: bool = Field(
        True,
        description="torch's flight recorder in every rank: when ranks stop agreeing, a "
        "verdict naming the rank, the collective and the line that issued it",
    )
    # torchrun's flags for its logs and its agent (docs/launch.md, "flag by flag").
    redirects: str | None = None  # 0-3, or LOCAL_RANK:N,... (elastic's Std)
    tee: str | None = None
    local_ranks_filter: Annotated[
        list[int] | None, from_comma_text(parse_int_list, "local_ranks_filter")
    ] = None
    rdzv_conf: dict[str, int | bool] = Field(default_factory=dict)  # less its timeout
    monitor_interval: float = Field(0.1, gt=0, le=60)
    role: str | None = None
    local_addr: str | None = None
    # Taken and without effect, as under torchrun for a script: its workers are programs
    # (a new interpreter each), and ddpcli's bootstrap already runs the script with runpy.
    start_method: Literal["spawn", "fork", "forkserver"] | None = None
    run_path: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nnodes_range(cls, data: Any) -> Any:
        return split_nnodes(data)

    @model_validator(mode="before")
    @classmethod
    def _rendezvous_settings(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("rdzv_conf"), str):
            return data
        return rdzv_conf_settings(data)

    @model_validator(mode="after")
    def _consistent(self) -> ScriptLaunchConfig:
        check_node_rank(self.node_rank, self.nnodes)
        check_membership(self.min_nnodes, self.nnodes, self.rdzv_backend, self.rdzv_endpoint)
        if self.gpus and self.nproc is not None and self.nproc != len(self.gpus):
            raise ValueError(
                f"invalid --nproc: {self.nproc} processes, but --gpus lists {len(self.gpus)} "
                "GPUs (one process each); give one of them"
            )
        if self.standalone and self.nnodes > 1:
            raise ValueError(
                "invalid --standalone: it means one node, but --nnodes is "
                f"{self.nnodes}; drop one of them"
            )
        for flag, spec in (("--redirects", self.redirects), ("--tee", self.tee)):
            check_output_spec(flag, spec, self.log_dir)
        return self

    @property
    def nproc_per_node(self) -> int:
        """Set by `ddpcli.launcher.script_launch.resolve_script_launch` without either flag."""
        if self.gpus:
            return len(self.gpus)
        if self.nproc is None:
            raise RuntimeError("ScriptLaunchConfig.nproc read before it was resolved")
        return self.nproc


def build_launch_config(
    flags: dict[str, Any], environ: Mapping[str, str] | None = None
) -> ScriptLaunchConfig:
    """A pod's PET_* variables < flags (left at None: not given); exit 2 with one line per
    problem naming the flag, and the PET_* variable it came from."""
    env = os.environ if environ is None else environ
    if isinstance(flags.get("target"), str):
        check_not_a_flag(flags["target"])
    from_pod, pod_origins = pod_defaults(env, launch_nproc_settings)
    from_flags = given(flags)
    if isinstance(from_flags.get("nproc"), str):  # torchrun's --nproc-per-node auto|gpu|cpu|N
        settings = launch_nproc_settings(from_flags.pop("nproc"), "--nproc")
        from_pod.pop("nproc", None)  # a flag wins, even `auto`
        from_flags.update(settings)
    try:
        return validated(ScriptLaunchConfig, {**from_pod, **from_flags})
    except DdpcliError as error:
        origins = {name: pod for name, pod in pod_origins.items() if name not in from_flags}
        raise with_origins(error, origins) from None


# Elastic's Std for --redirects and --tee: 0 none, 1 stdout, 2 stderr, 3 both; per rank too.
OUTPUT_SPEC = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")


def check_output_spec(flag: str, spec: str | None, log_dir: str | None) -> None:
    if spec is None:
        return
    if not OUTPUT_SPEC.fullmatch(spec.replace(" ", "")):
        raise ValueError(
            f"invalid {flag}: give 0, 1, 2 or 3 (none, stdout, stderr, both), or "
            f"LOCAL_RANK:N,... per rank, e.g. 0:3,1:2 (got {spec!r})"
        )
    if log_dir is None:
        raise ValueError(
            f"invalid {flag}: it writes the output to files in --log-dir DIR; give one "
            "(torchrun would use a temporary folder)"
        )


# torchrun's --rdzv-conf keys that torch's static and c10d rendezvous read, besides the
# rendezvous timeout (`timeout`, `join_timeout`), which is --timeout here.
RDZV_INT_KEYS = frozenset({
    "read_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt",
})  # fmt: skip
RDZV_TIMEOUT_KEYS = ("timeout", "join_timeout")


def rdzv_conf_settings(data: dict[str, Any]) -> dict[str, Any]:
    """torchrun's `--rdzv-conf timeout=60,read_timeout=120,is_host=1` as fields: its timeout
    becomes --timeout (unless that is given too), the rest the rendezvous's own settings."""
    settings: dict[str, int | bool] = {}
    for pair in filter(None, data["rdzv_conf"].replace(" ", "").split(",")):
        key, equals, value = pair.partition("=")
        if not equals:
            raise ValueError(f"invalid --rdzv-conf: give KEY=VALUE,... (got {pair!r})")
        settings[key] = rdzv_conf_value(key, value)
    timeouts = {settings.pop(key) for key in RDZV_TIMEOUT_KEYS if key in settings}
    data = {**data, "rdzv_conf": settings}
    if timeouts:
        given = data.get("timeout")
        if len(timeouts) > 1 or (given is not None and float(given) not in timeouts):
            raise ValueError(
                "invalid --rdzv-conf: its timeout and --timeout disagree; give one of them"
            )
        data["timeout"] = timeouts.pop()
    return data


def rdzv_conf_value(key: str, value: str) -> int | bool:
    known = (*RDZV_TIMEOUT_KEYS, *sorted(RDZV_INT_KEYS), "is_host")
    if key not in known:
        raise ValueError(
            f"invalid --rdzv-conf: {key} is not a setting of torch's rendezvous; give "
            f"{', '.join(known)}"
        )
    if key == "is_host":
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"invalid --rdzv-conf: is_host takes 1 or 0 (got {value!r})")
        return value.lower() in ("1", "true", "yes")
    if not value.isdigit():
        raise ValueError(f"invalid --rdzv-conf: {key} takes whole seconds (got {value!r})")
    return int(value)


# torchrun's flags that `ddpcli launch` has no room for, and why.
UNSUPPORTED_TORCHRUN_FLAGS = {
    "--no-python": "its workers run a Python script or module through ddpcli's bootstrap; "
    "start a program from a Python script (subprocess), or use torchrun",
    "--logs-specs": "its logs are set by --log-dir, --redirects and --tee",
    "--log-line-prefix-template": "with --log-dir its lines are prefixed [host rank r]",
    "--numa-binding": "bind with numactl in the script's own command, or use torchrun",
    "--event-log-handler": "its report of a failure is its own",
    "--virtual-local-rank": "each worker sees its own LOCAL_RANK; give --gpus to choose GPUs",
    "--duplicate-stdout-filters": "grep the logs of --log-dir",
    "--duplicate-stderr-filters": "grep the logs of --log-dir",
    "--signals-to-handle": "it passes SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 on",
    "--shutdown-timeout": "its workers get 30 s to stop",
    "--print-completion": "see `ddpcli --install-completion`",
}


def check_not_a_flag(target: str) -> None:
    """Option parsing stops at the first word it does not know, so a flag ddpcli lacks
    arrives here as the script: say which it is."""
    if not target.startswith("-") or target in ("-m", "--module"):
        return
    flag = target.split("=", 1)[0].replace("_", "-")
    if flag in UNSUPPORTED_TORCHRUN_FLAGS:
        raise usage_error(
            f"{flag} is a torchrun flag that ddpcli launch does not support: "
            f"{UNSUPPORTED_TORCHRUN_FLAGS[flag]}"
        )
    raise usage_error(
        f"no such option: {flag} (`ddpcli launch --help` lists them); options come before "
        "the script, and everything after it is the script's"
    )


def launch_nproc_settings(text: str, source: str = "PET_NPROC_PER_NODE") -> dict[str, Any]:
    """PET_NPROC_PER_NODE for `ddpcli launch`: N processes, cpu: one per core; auto and gpu:
    one per GPU (else 2, ddpcli's default; torchrun's auto would start one per core)."""
    spec = nproc_spec(text, source)
    if isinstance(spec, int):
        return {"nproc": spec}
    return {"nproc": os.cpu_count() or 1} if spec == "cpu" else {}
