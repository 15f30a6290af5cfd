"""Safe loading: `torch.load(weights_only=True)` and every way a file can be bad turned into
one clear line (exit 2). A file that needs arbitrary Python objects is refused; nothing in
it runs. Also: finding the model's state dict in a file, and fitting it to a model.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from ddpcli.errors import DdpcliError, first_line, usage_error
from ddpcli.files import digest_status, sha256_path

DDP_PREFIX = "module."


def check_recorded_digest(path: Path) -> None:
    status = digest_status(path)
    if status["status"] == "mismatch":
        raise usage_error(
            f"checkpoint {path} is corrupt: its SHA-256 {status['sha256'][:12]}… differs from "
            f"{status['recorded'][:12]}… recorded in {sha256_path(path).name} when it was saved"
        )


def safe_load(
    path: Path, map_location: Any = "cpu", check_digest: bool = False, lazy: bool = False
) -> Any:
    """Load with weights_only=True; turn every way a file can be bad into one clear line.
    `lazy` memory-maps the tensor data, so reading only the structure of a huge file is
    instant (not for resuming: the tensors would stay backed by the file)."""
    path = Path(path)
    _check_readable(path)
    if check_digest:
        check_recorded_digest(path)
    mmap = lazy and _is_zip(path)  # torch.save's zip layout; mmap refuses anything else
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pickle-protocol notes are noise to a user
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        if digest_status(path)["status"] == "mismatch":
            check_recorded_digest(path)  # damaged bytes, not a malicious file: say so
        raise _refusal(path, error) from None
    except Exception as error:  # a broken file can fail in any layer: zip, pickle, storage
        check_recorded_digest(path)
        raise usage_error(
            f"checkpoint {path} is truncated or corrupt and cannot be read "
            f"({_corruption_detail(path, error)})"
        ) from None


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise usage_error(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise usage_error(f"checkpoint {path} is not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise usage_error(f"checkpoint {path} cannot be read: {error.strerror}") from None


def _is_zip(path: Path) -> bool:
    return zipfile.is_zipfile(path)


def _corruption_detail(path: Path, error: Exception) -> str:
    if path.stat().st_size == 0:
        return "the file is empty"
    with open(path, "rb") as handle:
        zipped = handle.read(2) == b"PK"
    if zipped and not _is_zip(path):
        return "the zip archive torch.save writes is cut short: it has no central directory"
    return f"{type(error).__name__}: {first_line(error, limit=200)}"


def _refusal(path: Path, error: pickle.UnpicklingError) -> DdpcliError:
    """The weights-only unpickler stopped: say whether the file wanted a Python object (the
    dangerous case) or is simply not a pickle it accepts (corrupt, or not from torch.save)."""
    text = str(error)
    blocked = re.search(r"GLOBAL ([\w.]+)", text)
    if blocked:
        return usage_error(
            f"refused {path}: loading it needs the Python object {blocked.group(1)}, which could "
            "run code; only tensors and plain types are loaded (weights_only=True), nothing ran"
        )
    opcode = re.search(r"Unsupported operand (\d+)", text)
    detail = f"pickle opcode {opcode.group(1)}" if opcode else first_line(error, limit=200)
    return usage_error(
        f"refused {path}: it is corrupt or not written by torch.save ({detail} is not allowed "
        "in a weights-only load); nothing in it ran"
    )


def strip_ddp_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.removeprefix(DDP_PREFIX): value for key, value in state_dict.items()}


def has_ddp_prefix(state_dict: dict[str, Any]) -> bool:
    return any(key.startswith(DDP_PREFIX) for key in state_dict)


def is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in obj.items()
    )  # fmt: skip


def model_state(payload: Any) -> dict[str, torch.Tensor] | None:
    """The model's state dict: ours under "model", Lightning's under "state_dict", or the
    whole file when it is a plain state dict."""
    if is_state_dict(payload):
        return payload
    if isinstance(payload, dict):
        for key in ("model", "state_dict", "model_state_dict"):
            if is_state_dict(payload.get(key)):
                return payload[key]
    return None


def load_model_state(
    model: torch.nn.Module, state_dict: dict[str, torch.Tensor], path: Path
) -> None:
    state_dict = strip_ddp_prefix(state_dict)
    problems = state_dict_mismatch(model, state_dict)
    if problems:
        raise usage_error(
            f"cannot resume from {path}: its model does not fit this run's model "
            f"({'; '.join(problems)}); check --arch and the data set's classes"
        )
    model.load_state_dict(state_dict)


def state_dict_mismatch(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Missing keys, unexpected keys and shape differences, each in a few words."""
    expected = model.state_dict()
    problems: list[str] = []
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    if missing:
        problems.append(f"missing {len(missing)} key(s): {', '.join(missing[:3])}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:3])}")
    for key, tensor in state.items():
        if key in expected and tensor.shape != expected[key].shape:
            problems.append(
                f"{key} is {list(tensor.shape)}, the model wants {list(expected[key].shape)}"
            )
    return problems[:4]
