"""Durable files: atomic writes (temporary file, fsync, rename) with the SHA-256 of what
was written recorded beside each file (`NAME.sha256`, `sha256sum` layout).

A crash mid-write leaves the previous file intact, and the sidecar matches the file on disk
at every instant, so a later reader can tell damaged bytes from a file being replaced.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

HASH_CHUNK = 1 << 20


class HashingWriter:
    """A file wrapper that hashes what is written through it (torch.save, tarfile), so the
    SHA-256 costs no re-read."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.sha256 = hashlib.sha256()
        self.error: OSError | None = None  # what failed a write: torch's error hides it

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()

    def tell(self) -> int:  # tarfile asks where it starts
        return self.handle.tell()


def sha256_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def recorded_digests(path: Path) -> list[str]:
    """The digests in `path.sha256` (`sha256sum` layout), newest first; [] if none can be
    read there (no sidecar, or not one a SHA-256 can be read from)."""
    try:
        lines = sha256_path(Path(path)).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    words = [line.split()[0].lower() for line in lines if line.split()]
    return [word for word in words if SHA256_HEX.fullmatch(word)]


def _record_digests(path: Path, digests: list[str]) -> None:
    write_text_atomic(sha256_path(path), "".join(f"{d}  {path.name}\n" for d in digests))


def _replace_recording_digest(tmp: Path | str, target: Path, digest: str) -> None:
    """Rename `tmp` over `target` so that the sidecar matches the file at every instant: while
    the rename is in flight it lists the new digest and the previous one, so a kill at any
    point never makes a good file look corrupt."""
    previous = recorded_digests(target)[:1] if target.exists() else []
    _record_digests(target, [digest, *previous])
    os.replace(tmp, target)
    _record_digests(target, [digest])


def digest_status(path: Path) -> dict[str, Any]:
    """`ok`, `mismatch` (the bytes changed since the save), `missing` (no sidecar) or
    `unreadable` (a sidecar that holds no SHA-256)."""
    recorded = recorded_digests(path)
    if not recorded:
        status = "unreadable" if sha256_path(Path(path)).exists() else "missing"
        return {"status": status, "sha256": None, "recorded": None}
    actual = file_sha256(path)
    status = "ok" if actual in recorded else "mismatch"
    return {"status": status, "sha256": actual, "recorded": recorded[0]}


def folder_write_problem(folder: Path) -> str | None:
    """Why this process cannot write files in FOLDER (creating it if need be), in words;
    None when it can. Nothing is created to find out."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file"
    if os.access(existing, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    return (
        f"{existing} is on a read-only file system" if read_only else f"{existing} is not writable"
    )


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: Path) -> str:
    """Write `obj` to `path` atomically; record its SHA-256 beside it; return the digest."""
    import torch  # here: the launcher checks folders with this module before torch loads

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; checkpoints are ordinary files
    try:
        with os.fdopen(fd, "wb") as handle:
            writer = HashingWriter(handle)
            try:
                # torch.save takes any object with write() and flush(), as its docs say.
                torch.save(obj, writer)  # type: ignore[arg-type]
            except RuntimeError:
                # A failed write reaches the caller as torch's "[enforce fail at
                # inline_container.cc] unexpected pos": say what failed (a full disk).
                if writer.error is not None:
                    raise writer.error from None
                raise
            handle.flush()
            os.fsync(handle.fileno())
        digest = writer.sha256.hexdigest()
        _replace_recording_digest(tmp_name, path, digest)
        fsync_dir(path.parent)
        return digest
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    # A temporary name per process: several ranks may write the same file at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def link_or_copy_atomic(source: Path, target: Path) -> None:
    """Point `target` at the same bytes as `source` without a window where it is partial."""
    tmp = target.with_name(f".{target.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)  # free and atomic on one file system
    except OSError:
        shutil.copyfile(source, tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
    digests = recorded_digests(source)
    _replace_recording_digest(tmp, target, digests[0] if digests else file_sha256(source))
    fsync_dir(target.parent)  # the new name survives a power loss too
