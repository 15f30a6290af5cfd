"""Checkpoints: atomic, durable writes; safe loads; inspect, verify and convert.

A save goes to a temporary file in the same directory, is flushed and fsynced, then
renamed over the old file, so a crash mid-write leaves the previous checkpoint intact.
Every load uses `weights_only=True`: a file that needs arbitrary code is refused.
Everything we store is tensors and plain types, so our own files always load safely.
Beside each file, `NAME.sha256` records the digest of the bytes the save wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpcli.errors import first_line, usage_error

FORMAT = "ddpcli-checkpoint-v1"
DDP_PREFIX = "module."
# What `--resume` needs; a weights-only file or a plain state dict lacks some of it.
TRAINING_KEYS = ("model", "optimizer", "scheduler", "epoch", "batch_in_epoch", "step")
TRAINING_KEYS += ("metrics", "config", "rng", "world_size")
# Settings that change the arithmetic: resuming with other values cannot reproduce the run.
RESULT_SETTINGS = (
    "arch", "dataset", "image_size", "synthetic_size", "epochs", "per_gpu_batch", "accumulate",
    "lr", "momentum", "weight_decay", "warmup_epochs", "label_smoothing", "seed", "precision",
    "max_steps",
)  # fmt: skip
BATCHNORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
HASH_CHUNK = 1 << 20


# --- Digests recorded beside the file ------------------------------------------------------


class _HashingWriter:
    """A file wrapper that hashes what torch.save writes, so the SHA-256 costs no re-read."""

    def __init__(self, handle):
        self.handle = handle
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def sha256_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def recorded_digests(path: Path) -> list[str]:
    """The digests in `path.sha256` (`sha256sum` layout), newest first; [] if none."""
    try:
        lines = sha256_path(Path(path)).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [line.split()[0].lower() for line in lines if line.split()]


def _record_digests(path: Path, digests: list[str]) -> None:
    _write_text_atomic(sha256_path(path), "".join(f"{d}  {path.name}\n" for d in digests))


def _replace_recording_digest(tmp: Path | str, target: Path, digest: str) -> None:
    """Rename `tmp` over `target` so that the sidecar matches the file at every instant: while
    the rename is in flight it lists the new digest and the previous one, so a kill at any
    point never makes a good file look corrupt."""
    previous = recorded_digests(target)[:1] if target.exists() else []
    _record_digests(target, [digest, *previous])
    os.replace(tmp, target)
    _record_digests(target, [digest])


def digest_status(path: Path) -> dict[str, Any]:
    """`ok`, `mismatch` (the bytes changed since the save) or `missing` (no sidecar)."""
    recorded = recorded_digests(path)
    if not recorded:
        return {"status": "missing", "sha256": None, "recorded": None}
    actual = file_sha256(path)
    status = "ok" if actual in recorded else "mismatch"
    return {"status": status, "sha256": actual, "recorded": recorded[0]}


def check_recorded_digest(path: Path) -> None:
    status = digest_status(path)
    if status["status"] == "mismatch":
        raise usage_error(
            f"checkpoint {path} is corrupt: its SHA-256 {status['sha256'][:12]}… differs from "
            f"{status['recorded'][:12]}… recorded in {sha256_path(path).name} when it was saved"
        )


# --- Atomic, durable writes ----------------------------------------------------------------


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> str:
    """Write `obj` to `path` atomically; record its SHA-256 beside it; return the digest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; checkpoints are ordinary files
    try:
        with os.fdopen(fd, "wb") as handle:
            writer = _HashingWriter(handle)
            torch.save(obj, writer)
            handle.flush()
            os.fsync(handle.fileno())
        digest = writer.sha256.hexdigest()
        _replace_recording_digest(tmp_name, path, digest)
        _fsync_dir(path.parent)
        return digest
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_metrics_history(path: Path, history: list[dict]) -> None:
    """metrics.jsonl from the checkpoint's history: after a resume each epoch is there exactly
    once, even if the interrupted run had appended an epoch its last checkpoint never saw."""
    _write_text_atomic(Path(path), "".join(json.dumps(metrics) + "\n" for metrics in history))


# --- Safe loading ------------------------------------------------------------------------


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
    import zipfile

    return zipfile.is_zipfile(path)


def _corruption_detail(path: Path, error: Exception) -> str:
    if path.stat().st_size == 0:
        return "the file is empty"
    with open(path, "rb") as handle:
        zipped = handle.read(2) == b"PK"
    if zipped and not _is_zip(path):
        return "the zip archive torch.save writes is cut short: it has no central directory"
    return f"{type(error).__name__}: {first_line(error, limit=200)}"


def _refusal(path: Path, error: pickle.UnpicklingError):
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


# --- Resuming a run ----------------------------------------------------------------------


def load_training_checkpoint(path: Path, map_location: Any) -> dict[str, Any]:
    """A checkpoint `--resume` can continue from: safe, uncorrupted, and complete."""
    payload = safe_load(path, map_location=map_location, check_digest=True)
    check_training_payload(payload, path)
    return payload


def check_training_payload(payload: Any, path: Path) -> None:
    if isinstance(payload, dict) and payload.get("weights_only"):
        raise usage_error(
            f"cannot resume from {path}: it holds weights only (no optimizer, scheduler or RNG "
            "state); resume from a full checkpoint such as OUT/checkpoints/last.pt"
        )
    missing = [key for key in TRAINING_KEYS if not isinstance(payload, dict) or key not in payload]
    if missing:
        raise usage_error(
            f"cannot resume from {path}: it is not a ddpcli training checkpoint "
            f"(no {', '.join(missing[:3])}); `ddpcli checkpoint inspect` shows what it holds"
        )


def load_model_state(model: torch.nn.Module, state_dict: dict, path: Path) -> None:
    state_dict = strip_ddp_prefix(state_dict)
    problems = state_dict_mismatch(model, state_dict)
    if problems:
        raise usage_error(
            f"cannot resume from {path}: its model does not fit this run's model "
            f"({'; '.join(problems)}); check --arch and the data set's classes"
        )
    model.load_state_dict(state_dict)


def resume_warnings(payload: dict, config: dict, world_size: int) -> list[str]:
    """What makes the resumed run differ from the uninterrupted one."""
    notes = []
    if payload["world_size"] != world_size:
        notes.append(
            f"checkpoint was written by {payload['world_size']} ranks, this run has {world_size}: "
            "the data order (and each rank's RNG) from here on differs from the original run"
        )
    saved = payload.get("config") or {}
    changed = [
        f"{key} {saved[key]!r} -> {config.get(key)!r}"
        for key in RESULT_SETTINGS
        if key in saved and saved[key] != config.get(key)
    ]
    if changed:
        notes.append(
            f"settings differ from the checkpoint's ({', '.join(changed)}): the result will not "
            "match an uninterrupted run"
        )
    return notes


def check_resume_source(cfg) -> None:
    """For the launcher, before any worker starts: a missing, broken or unsafe `--resume`
    file is one line and exit 2 at once. Structure only (memory-mapped); the workers check
    the digest when they load it for real."""
    path = find_resume_path(cfg)
    if path is None:
        return
    check_training_payload(safe_load(path, lazy=True), path)


def find_resume_path(cfg) -> Path | None:
    """`--resume auto` continues from OUT/checkpoints/last.pt when there is one; a folder
    given to `--resume` means its last.pt (or checkpoints/last.pt)."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        last = Path(cfg.out) / "checkpoints" / "last.pt"
        return last if last.is_file() else None
    path = Path(cfg.resume)
    if path.is_dir():
        for candidate in (path / "last.pt", path / "checkpoints" / "last.pt"):
            if candidate.is_file():
                return candidate
    return path


# --- Random number generator state as tensors and plain types ----------------------------


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    # A map_location onto a GPU moves these tensors there too; RNG states live on the CPU.
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].cpu().numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


# --- The run's checkpoints: written by rank 0, guarded by barriers -----------------------


def gather_rng_states(ctx, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order, so a resume restores each rank exactly."""
    import torch.distributed as dist

    if not ctx.distributed:
        return [state]
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, state)
    return states


def _link_or_copy_atomic(source: Path, target: Path) -> None:
    """Point `target` at the same bytes as `source` without a window where it is partial."""
    tmp = target.with_name(f".{target.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)  # free and atomic on one file system
    except OSError:
        import shutil

        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
    digests = recorded_digests(source)
    _replace_recording_digest(tmp, target, digests[0] if digests else file_sha256(source))
    _fsync_dir(target.parent)  # the new name survives a power loss too


class CheckpointWriter:
    """Saves `name` (an epoch or step checkpoint), points last.pt (and best.pt) at it, and
    keeps only the newest `keep_last` epoch/step files. Only rank 0 touches the disk; the
    barrier after it means no rank can read or overwrite a file that is half written."""

    def __init__(self, cfg, ctx):
        self.directory = Path(cfg.out) / "checkpoints"
        self.keep_last = cfg.keep_last
        self.ctx = ctx

    def save(self, payload: dict[str, Any], name: str, is_best: bool) -> None:
        from ddpcli.dist import barrier

        if self.ctx.is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self.keep_last == 0:
                atomic_save(payload, self.directory / "last.pt")
                if is_best:
                    _link_or_copy_atomic(self.directory / "last.pt", self.directory / "best.pt")
            else:
                atomic_save(payload, self.directory / name)
                _link_or_copy_atomic(self.directory / name, self.directory / "last.pt")
                if is_best:
                    _link_or_copy_atomic(self.directory / name, self.directory / "best.pt")
                self.prune()
            self.remove_stale_temporaries()
        barrier(self.ctx)

    def prune(self) -> None:
        numbered = [*self.directory.glob("epoch-*.pt"), *self.directory.glob("step-*.pt")]
        numbered.sort(key=lambda p: (p.stat().st_mtime_ns, p.name))
        for old in numbered[: max(0, len(numbered) - self.keep_last)]:
            old.unlink(missing_ok=True)
            sha256_path(old).unlink(missing_ok=True)

    def remove_stale_temporaries(self) -> None:
        """A save killed mid-write leaves its temporary file; the next save sweeps it."""
        for stale in self.directory.glob(".*.tmp"):
            stale.unlink(missing_ok=True)


# --- Reading what a checkpoint holds -----------------------------------------------------


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


def is_state_dict(obj: Any) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in obj.items()
    )  # fmt: skip


def checkpoint_kind(payload: Any) -> str:
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        return "weights-only" if payload.get("weights_only") else "training"
    return "state-dict" if model_state(payload) is not None else "unknown"


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


def count_parameters(state: dict[str, torch.Tensor]) -> int:
    """Elements of the state dict minus BatchNorm's running statistics (buffers, not weights)."""
    return sum(
        tensor.numel()
        for key, tensor in state.items()
        if not key.endswith(BATCHNORM_STATISTICS)
    )  # fmt: skip


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def inspect_checkpoint(path: Path) -> dict[str, Any]:
    """Everything a person or a script wants to know about a checkpoint, as plain data."""
    path = Path(path)
    storage_devices: Counter = Counter()

    def record_device(storage, location: str):
        storage_devices[location] += 1  # where it was saved from; loaded onto the CPU here
        return storage

    payload = safe_load(path, map_location=record_device, lazy=True)
    report: dict[str, Any] = {
        "path": str(path),
        "size_bytes": path.stat().st_size,
        "kind": checkpoint_kind(payload),
        "digest": digest_status(path),
        "devices": dict(sorted(storage_devices.items())),
        "tensors": sum(1 for _ in iter_tensors(payload)),
        "contents": sorted(map(str, payload)) if isinstance(payload, dict) else [],
    }
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        report.update(training_summary(payload))
    state = model_state(payload)
    if state is not None:
        report["model"] = describe_state(state)
    return report


def training_summary(payload: dict) -> dict[str, Any]:
    config = payload.get("config") if isinstance(payload.get("config"), dict) else {}
    metrics = payload.get("metrics") if isinstance(payload.get("metrics"), list) else []
    return {
        "format": payload.get("format"),
        "epochs_done": payload.get("epoch"),
        "epochs_planned": config.get("epochs"),
        "batch_in_epoch": payload.get("batch_in_epoch", 0),
        "step": payload.get("step"),
        "world_size": payload.get("world_size"),
        "arch": config.get("arch"),
        "num_classes": payload.get("num_classes"),
        "best_val_acc": payload.get("best_val_acc"),
        "resumable": all(key in payload for key in TRAINING_KEYS),
        "metrics": metrics,
        "config": config,
    }


def describe_state(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    dtypes = Counter(_dtype_name(tensor.dtype) for tensor in state.values())
    return {
        "tensors": len(state),
        "parameters": count_parameters(state),
        "elements": sum(tensor.numel() for tensor in state.values()),
        "bytes": sum(tensor.numel() * tensor.element_size() for tensor in state.values()),
        "dtypes": dict(dtypes.most_common()),
        "ddp_prefix": has_ddp_prefix(state),
        "first_keys": list(state)[:3],
    }


# --- Verifying ---------------------------------------------------------------------------


def verify_checkpoint(
    path: Path, arch: str | None = None, num_classes: int | None = None
) -> dict[str, Any]:
    """Load safely, then check the digest, that every tensor is finite, and that the model of
    its config accepts the state dict. Each check passes, fails or is skipped, with why."""
    path = Path(path)
    payload = safe_load(path, lazy=True)
    checks = [
        {"check": "safe load", "status": "pass", "detail": "weights_only=True"},
        _check_digest(path),
        _check_finite(payload),
        _check_model(payload, arch, num_classes),
        _check_training_state(payload),
    ]
    return {
        "path": str(path),
        "ok": all(check["status"] != "fail" for check in checks),
        "checks": checks,
    }


def _check_digest(path: Path) -> dict[str, str]:
    status = digest_status(path)
    if status["status"] == "missing":
        detail = f"no {sha256_path(path).name} beside the file; bytes not checked"
        return {"check": "sha256", "status": "skip", "detail": detail}
    if status["status"] == "mismatch":
        detail = (
            f"file is {status['sha256'][:16]}…, the save recorded {status['recorded'][:16]}…: "
            "the bytes changed after the save"
        )
        return {"check": "sha256", "status": "fail", "detail": detail}
    return {"check": "sha256", "status": "pass", "detail": status["sha256"]}


def _check_finite(payload: Any) -> dict[str, str]:
    bad, checked = [], 0
    for name, tensor in iter_tensors(payload):
        if not (tensor.is_floating_point() or tensor.is_complex()):
            continue
        checked += 1
        non_finite = tensor.numel() - int(torch.isfinite(tensor).sum())
        if non_finite:
            bad.append(f"{name} ({non_finite} NaN/inf)")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return {"check": "finite", "status": "fail", "detail": ", ".join(bad[:3]) + more}
    return {"check": "finite", "status": "pass", "detail": f"{checked} float tensors"}


def _check_model(payload: Any, arch: str | None, num_classes: int | None) -> dict[str, str]:
    state = model_state(payload)
    if state is None:
        return {"check": "model", "status": "fail", "detail": "no model state dict found"}
    saved = training_summary(payload) if isinstance(payload, dict) else {}
    arch = arch or saved.get("arch")
    if not arch:
        detail = "the file names no architecture; pass --arch to check it"
        return {"check": "model", "status": "skip", "detail": detail}
    state = strip_ddp_prefix(state)
    classes = num_classes or saved.get("num_classes") or infer_num_classes(state)
    try:
        model = build_model_skeleton(arch, classes)
    except Exception as error:  # an unknown arch is a verdict on the file, not a crash
        return {"check": "model", "status": "fail", "detail": first_line(error, limit=200)}
    problems = state_dict_mismatch(model, state)
    if problems:
        return {"check": "model", "status": "fail", "detail": "; ".join(problems)}
    detail = f"{arch}(num_classes={classes}) accepts all {len(state)} tensors"
    return {"check": "model", "status": "pass", "detail": detail}


def _check_training_state(payload: Any) -> dict[str, str]:
    kind = checkpoint_kind(payload)
    if kind != "training":
        detail = "weights only: loads for inference, cannot resume training"
        detail = detail if kind == "weights-only" else "not a ddpcli training checkpoint"
        return {"check": "resumable", "status": "skip", "detail": detail}
    missing = [key for key in TRAINING_KEYS if key not in payload]
    if missing:
        return {"check": "resumable", "status": "fail", "detail": f"missing {', '.join(missing)}"}
    ranks = len(payload["rng"])
    if ranks != payload["world_size"]:
        detail = f"RNG states for {ranks} ranks, world size {payload['world_size']}"
        return {"check": "resumable", "status": "fail", "detail": detail}
    detail = f"optimizer, scheduler and RNG state of {ranks} rank(s)"
    return {"check": "resumable", "status": "pass", "detail": detail}


def infer_num_classes(state: dict[str, torch.Tensor]) -> int | None:
    """The classifier is the last 2-D weight in a classification net's state dict."""
    for key in reversed(list(state)):
        if key.endswith("weight") and state[key].ndim == 2:
            return state[key].shape[0]
    return None


def build_model_skeleton(arch: str, num_classes: int | None) -> torch.nn.Module:
    """The model on the meta device: shapes and names only, no memory, no initialisation."""
    from ddpcli.models import build_model

    with torch.device("meta"):
        return build_model(arch, num_classes or 1000)


def state_dict_mismatch(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """Missing keys, unexpected keys and shape differences, each in a few words."""
    expected = model.state_dict()
    problems = []
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


# --- Converting --------------------------------------------------------------------------


def convert_checkpoint(
    path: Path, out: Path, strip_prefix: bool = False, weights_only: bool = False
) -> dict[str, Any]:
    """A plain state dict (what `model.load_state_dict` takes), or with `weights_only` our
    checkpoint without optimizer, scheduler and RNG state. Either way on the CPU."""
    path, out = Path(path), Path(out)
    if out.resolve() == path.resolve():
        raise usage_error(f"OUT must differ from PATH: converting {path} in place would lose it")
    payload = safe_load(path, lazy=True)
    state = model_state(payload)
    if state is None:
        raise usage_error(f"{path} holds no model state dict to convert")
    if strip_prefix:
        state = strip_ddp_prefix(state)
    is_ours = isinstance(payload, dict) and payload.get("format") == FORMAT
    keep_metadata = weights_only and is_ours
    document = weights_only_payload(payload, state) if keep_metadata else dict(state)
    digest = atomic_save(document, out)
    saved = training_summary(payload) if is_ours else {}
    arch, classes = saved.get("arch"), saved.get("num_classes") or infer_num_classes(state)
    return {
        "path": str(path),
        "out": str(out),
        "layout": "weights-only checkpoint" if keep_metadata else "state dict",
        "tensors": len(state),
        "parameters": count_parameters(state),
        "ddp_prefix": has_ddp_prefix(state),
        "arch": arch,
        "num_classes": classes,
        "size_bytes": out.stat().st_size,
        "sha256": digest,
        "load_hint": load_hint(arch, classes, out, nested=keep_metadata),
    }


def load_hint(arch: str | None, num_classes: int | None, out: Path, nested: bool) -> str:
    """The plain-PyTorch line that loads the converted file."""
    from ddpcli.models import BUILTIN_MODELS

    state = f"torch.load({str(out)!r}, weights_only=True)" + ('["model"]' if nested else "")
    if arch in BUILTIN_MODELS:
        model = f"ddpcli.models.build_model({arch!r}, num_classes={num_classes})"
    else:
        model = f"torchvision.models.{arch or 'ARCH'}(num_classes={num_classes or 'N'})"
    return f"{model}.load_state_dict({state})"


def weights_only_payload(payload: dict, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    kept = ("format", "epoch", "step", "best_val_acc", "metrics", "config", "num_classes")
    document = {key: payload[key] for key in kept if key in payload}
    document.update(model=state, weights_only=True, world_size=payload.get("world_size"))
    return document
