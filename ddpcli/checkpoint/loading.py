"""Safe loading: `torch.load(weights_only=True)` and every way a file can be bad turned into
one clear line (exit 2). A file that needs arbitrary Python objects is refused; nothing in
it runs. Also: finding the model's state dict in a file, and fitting it to a model.
"""

from __future__ import annotations

import pickle
import re
import warnings
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ddpcli.errors import DdpcliError, first_line, runtime_error, usage_error
from ddpcli.files import digest_status, sha256_path

DDP_PREFIX = "module."
# What a RuntimeError from the GPU says (not "CUDA" alone: loading a GPU file on a machine
# without CUDA says that too, and is the file's business).
DEVICE_FAILURES = ("CUDA error", "out of memory", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side")


def check_recorded_digest(path: Path) -> dict[str, Any]:
    """Exit 2 when the bytes changed since the save; else the digest's status, which says
    whether they could be checked at all (`unchecked_digest_reason`)."""
    status = digest_status(path)
    if status["status"] == "mismatch":
        raise usage_error(
            f"checkpoint {path} is corrupt: its SHA-256 {status['sha256'][:12]}… differs from "
            f"{status['recorded'][:12]}… recorded in {sha256_path(path).name} when it was saved"
        )
    return status


def file_stamp(path: Path) -> str | None:
    """PATH as it stands: where, how long, when last written, which inode (None: no file
    there). A file written again or replaced (atomic_save renames a new inode over it) has
    another stamp."""
    try:
        stat = Path(path).stat()
    except OSError:
        return None
    return f"{Path(path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"


def unchecked_digest_reason(path: Path, status: dict[str, Any]) -> str | None:
    """Why the bytes of PATH cannot be checked against the save's SHA-256, or None."""
    sidecar = sha256_path(path).name
    if status["status"] == "missing":
        return (
            f"no {sidecar} beside the file, so its bytes cannot be checked (ddpcli records one "
            "with every save: copy it along with the checkpoint)"
        )
    if status["status"] == "unreadable":
        return (
            f"{sidecar} is unreadable: it holds no SHA-256 digest, so the bytes cannot be "
            "checked (it was damaged or replaced; the checkpoint itself may be fine)"
        )
    return None


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a loaded checkpoint, named by its path: `optimizer/state/0/...`."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from iter_tensors(value, f"{prefix}/{index}" if prefix else str(index))


def non_finite_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[str], int]:
    """`name (N NaN/inf)` for each floating tensor that holds NaN or inf, and how many
    floating tensors were looked at."""
    bad: list[str] = []
    checked = 0
    for name, tensor in named:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        checked += 1
        non_finite = tensor.numel() - int(torch.isfinite(tensor).sum())
        if non_finite:
            bad.append(f"{name} ({non_finite} NaN/inf)")
    return bad, checked


def listed_briefly(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


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
        if is_device_failure(error):  # the GPU's fault, not the file's
            raise device_load_error(path, map_location, error) from None
        check_recorded_digest(path)
        raise usage_error(
            f"checkpoint {path} is truncated or corrupt and cannot be read "
            f"({_corruption_detail(path, error)})"
        ) from None


def is_device_failure(error: BaseException) -> bool:
    """Out of memory on the device, or a CUDA error: the file may well be fine."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    accelerator_error = getattr(torch, "AcceleratorError", ())  # torch >= 2.8
    if accelerator_error and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(marker in text for marker in DEVICE_FAILURES)


def device_load_error(path: Path, map_location: Any, error: BaseException) -> DdpcliError:
    """A run-time failure (exit 1) in one line, with what to do about it."""
    onto = f" onto {map_location}" if isinstance(map_location, (str, torch.device)) else ""
    where = f"loading {path}{onto}"
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error):
        return runtime_error(
            f"out of memory {where}: {first_line(error, limit=160)}; free that GPU's memory "
            "(nvidia-smi shows which processes hold it) or train on another GPU (--gpus)"
        )
    return runtime_error(
        f"CUDA error {where}: {first_line(error, limit=200)}; the GPU failed, not the file "
        "(`ddpcli checkpoint verify` checks it on the CPU)"
    )


def _check_readable(path: Path) -> None:
    check_is_file(path)
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise usage_error(f"checkpoint {path} cannot be read: {error.strerror}") from None


def check_is_file(path: Path) -> None:
    """Exit 2 where the checkpoint PATH is missing or a folder (naming what it holds)."""
    if not path.exists():
        raise usage_error(f"checkpoint {path} does not exist")
    if not path.is_file():
        raise usage_error(not_a_file(path))


def not_a_file(path: Path) -> str:
    """Why the folder PATH is no checkpoint, naming the checkpoints a run's --out folder (or
    its checkpoints/) holds: the run's folder is what people pass first."""
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = [str(folder / name) for name in ("best.pt", "last.pt") if (folder / name).is_file()]
    if not found:
        return f"checkpoint {path} is not a file"
    return f"checkpoint {path} is a folder; give a checkpoint file: {' or '.join(found)}"


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


def ema_state(payload: Any) -> dict[str, torch.Tensor] | None:
    """The EMA's averaged model (--ema) as a plain state dict, or None when the file has
    none. AveragedModel keeps it under `module.` with its own `n_averaged` counter."""
    saved = payload.get("ema") if isinstance(payload, dict) else None
    if saved is None or not is_state_dict(saved):
        return None
    return {
        key.removeprefix(DDP_PREFIX): tensor
        for key, tensor in saved.items()
        if key != "n_averaged"
    }  # fmt: skip


def deployed_state(payload: Any, weights: str | None) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The weights a user deploys and which they are: WEIGHTS "ema" or "raw", None for the
    EMA's when the file holds one (best.pt follows it too), else the trained ones."""
    averaged = ema_state(payload)
    if weights == "ema" and averaged is None:
        raise usage_error(
            "invalid --weights ema: the checkpoint holds no EMA (trained without --ema)"
        )
    if weights != "raw" and averaged is not None:
        return averaged, "ema"
    return model_state(payload), "raw"


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
