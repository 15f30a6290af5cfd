"""`ddpcli check-env`'s configuration: the CheckEnvOptions schema and its flag rules."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from ddpcli.config.common import Backend, CommandConfig, check_node_rank, given, validated
from ddpcli.environments.world import DEFAULT_MASTER_PORT
from ddpcli.errors import usage_error


def is_loopback(host: str) -> bool:
    """An address (or `localhost`) that never leaves this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class CheckEnvOptions(CommandConfig):
    """What `ddpcli check-env` was asked to check. Field names are the flags."""

    ifname: str | None = None
    master_addr: str = Field("127.0.0.1", min_length=1)
    master_port: int = Field(DEFAULT_MASTER_PORT, ge=1, le=65535)
    port_given: bool = False  # by flag or MASTER_PORT; else a one-node probe picks a free port
    backend: Backend = "auto"
    probe: bool = False
    nproc: int | None = Field(None, ge=1, le=256)
    nnodes: int = Field(1, ge=1, le=4096)
    node_rank: int = Field(0, ge=0)
    timeout: float = Field(60.0, gt=0, le=3600, description="seconds to wait for all nodes")
    stage_timeout: float = Field(15.0, gt=0, le=600, description="seconds for each probe stage")

    @model_validator(mode="after")
    def _consistent(self) -> CheckEnvOptions:
        check_node_rank(self.node_rank, self.nnodes)
        if self.nnodes > 1 and is_loopback(self.master_addr):
            raise ValueError(
                f"invalid --master-addr: --nnodes {self.nnodes} needs node 0's address, one "
                f"every node can reach (not {self.master_addr}; set it or MASTER_ADDR)"
            )
        return self

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def build_check_options(
    flags: dict[str, Any], environ: Mapping[str, str] | None = None
) -> CheckEnvOptions:
    """Flags left at None are not given; MASTER_ADDR/MASTER_PORT fill in, as for a run."""
    env = os.environ if environ is None else environ
    values = given(flags)
    if "master_addr" not in values and env.get("MASTER_ADDR"):
        values["master_addr"] = env["MASTER_ADDR"]
    if "master_port" in values:
        values["port_given"] = True
    elif env.get("MASTER_PORT"):
        if not env["MASTER_PORT"].strip().isdigit():
            raise usage_error(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number; fix it")
        values["master_port"], values["port_given"] = int(env["MASTER_PORT"]), True
    return validated(CheckEnvOptions, values)
