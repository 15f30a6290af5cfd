"""Checkpoints: atomic, durable writes and safe loads.

A save goes to a temporary file in the same directory, is flushed and fsynced, then
renamed over the old file, so a crash mid-write leaves the previous checkpoint intact.
Every load uses `weights_only=True`: a file that needs arbitrary code is refused.
Everything we store is tensors and plain types, so our own files always load safely.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpcli.errors import usage_error

FORMAT = "ddpcli-checkpoint-v1"
DDP_PREFIX = "module."


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
        os.replace(tmp_name, path)
        _write_text_atomic(sha256_path(path), f"{digest}  {path.name}\n")
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


def safe_load(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load with weights_only=True; turn every way a file can be bad into one clear line."""
    path = Path(path)
    if not path.is_file():
        raise usage_error(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise usage_error(
            f"refused {path}: it needs arbitrary Python objects to load, which could run "
            f"code; only weights-only checkpoints are loaded ({_first_line(error)})"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as error:
        raise usage_error(
            f"checkpoint {path} is truncated or corrupt and cannot be read ({_first_line(error)})"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def strip_ddp_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key.removeprefix(DDP_PREFIX): value for key, value in state_dict.items()}


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
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
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
    os.replace(tmp, target)
    digest_file = sha256_path(source)
    if digest_file.exists():
        digest = digest_file.read_text().split()[0]
        _write_text_atomic(sha256_path(target), f"{digest}  {target.name}\n")


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
        barrier(self.ctx)

    def prune(self) -> None:
        numbered = [*self.directory.glob("epoch-*.pt"), *self.directory.glob("step-*.pt")]
        numbered.sort(key=lambda p: p.stat().st_mtime_ns)
        for old in numbered[: max(0, len(numbered) - self.keep_last)]:
            old.unlink(missing_ok=True)
            sha256_path(old).unlink(missing_ok=True)


def find_resume_path(cfg) -> Path | None:
    """`--resume auto` continues from OUT/checkpoints/last.pt when there is one."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        last = Path(cfg.out) / "checkpoints" / "last.pt"
        return last if last.is_file() else None
    return Path(cfg.resume)
