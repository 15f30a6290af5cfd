"""Which model a command may rebuild from what a checkpoint says about itself.

A checkpoint's config names its architecture. A built-in, torchvision or timm name only
picks a constructor ddpcli already has; an import path (`pkg.module:factory`,
`path/to/file.py:factory`) names code, and importing it runs that code. A file from
someone else must not run anything, so an import path is used only when the user gives the
same `--arch` (or --trust-checkpoint-code); otherwise the model is not built and the
reason says how to build it. Every command that rebuilds a model from a file asks here
(`checkpoint verify` today, `ddpcli eval` next).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ddpcli.factories import is_factory_spec, timm_model_name

TRUST_FLAG = "--trust-checkpoint-code"
# A plain timm model name (with its optional `.tag`): not `hf-hub:` or `local-dir:`, which
# make timm read a configuration from somewhere the file chose.
PLAIN_TIMM_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
# Constructor keywords that make it fetch or read weights (timm's pretrained ones, a
# checkpoint path): taken from a file only with the user's word, like an import path.
LOADING_ARGUMENTS = frozenset(
    {"pretrained", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path", "weights"}
)


@dataclass(frozen=True)
class ModelChoice:
    """The architecture to build and its keywords, or None and why it is not built."""

    arch: str | None
    model_args: dict[str, Any] = field(default_factory=dict)
    reason: str = ""


def model_to_rebuild(
    saved_config: dict[str, Any] | None, given_arch: str | None, trust_code: bool
) -> ModelChoice:
    """The model to check a checkpoint against. The user's own --arch always wins (their
    code, their choice); the file's model arguments go with it only when it is the file's
    arch. The file's arch alone is built when it runs nothing."""
    config = saved_config if isinstance(saved_config, dict) else {}
    arch, model_args = config.get("arch"), config.get("model_args")
    saved_arch = arch if isinstance(arch, str) else None
    saved_args: dict[str, Any] = model_args if isinstance(model_args, dict) else {}
    if given_arch:
        return ModelChoice(given_arch, dict(saved_args) if given_arch == saved_arch else {})
    if not saved_arch:
        return ModelChoice(None, reason="the file names no architecture; pass --arch to check it")
    if trust_code:
        return ModelChoice(saved_arch, dict(saved_args))
    why_not = untrusted_reason(saved_arch, saved_args)
    if why_not:
        return ModelChoice(None, reason=why_not)
    return ModelChoice(saved_arch, dict(saved_args))


def untrusted_reason(arch: str, model_args: dict[str, Any]) -> str:
    """Why building ARCH(**MODEL_ARGS) as a file names them could run or fetch something
    the file chose; "" when it cannot."""
    how = f"pass --arch {arch} if you trust it (or {TRUST_FLAG})"
    if is_factory_spec(arch):
        return f"the file names the import path {arch}, code that is not run on its say; {how}"
    timm_name = timm_model_name(arch)
    if timm_name is not None and not PLAIN_TIMM_NAME.fullmatch(timm_name):
        return f"the file names {arch}, which makes timm read a configuration elsewhere; {how}"
    loading = sorted(LOADING_ARGUMENTS.intersection(model_args))
    if loading:
        return (
            f"the file's model arguments ({', '.join(loading)}) would load weights from "
            f"elsewhere; {how}"
        )
    return ""
