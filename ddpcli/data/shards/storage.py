"""Where shards are read from: a local folder, or a URL that fsspec understands (s3://,
gs://, http(s)://). Every reader of shards (training's stream, `data verify`) opens them
here, so that retries, credentials and the one-line failures live in one place.

A URL's shards are streamed: read front to back, a block at a time in memory, never copied
to disk. A connection that drops mid-read is opened again at the byte reached (a Range
request), up to READ_TRIES times with a growing pause; then the read ends the command with
one line naming the shard's URL (exit 1: it happened at run time). What fails before any
shard is read (no such bucket, no index, no endpoint there) is bad input: exit 2.

Credentials are wherever the storage's own library looks (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, AWS_ENDPOINT_URL[_S3] for botocore;
GOOGLE_APPLICATION_CREDENTIALS for gcsfs): ddpcli never reads them, and a URL's own
user:password@ is shown and saved as ***@. One exception to botocore's own search: off EC2,
its last place, the instance-metadata endpoint, is skipped (`without_instance_metadata`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ddpcli.config.data import is_url, redacted_url
from ddpcli.errors import RUNTIME, DdpcliError, first_line, usage_error

__all__ = ["ShardReadFailed", "ShardStore", "UrlShardStore", "is_url", "shard_store"]

# Tries of one read before it fails (the first and READ_TRIES - 1 reopenings); the pause
# before reopening doubles from RETRY_PAUSE_S: 0.25 + 0.5 + 1 + 2 s, in all about 4 s.
READ_TRIES = 5
RETRY_PAUSE_S = 0.25
# A block of an object store's shard, fetched by one ranged GET and held in memory.
BLOCK_BYTES = 8 << 20
# An HTTP stream that brings no byte for this long counts as dropped (and is reopened); the
# whole transfer has no limit (aiohttp's default of 5 minutes would end a large shard's).
HTTP_CONNECT_S, HTTP_SILENT_S = 30.0, 60.0
# What each scheme needs installed, and how to install it.
PACKAGES = {
    "s3": ("s3fs", "pip install 'ddpcli[s3]'"),
    "gs": ("gcsfs", "pip install 'ddpcli[gcs]'"),
    "gcs": ("gcsfs", "pip install 'ddpcli[gcs]'"),
    "http": ("aiohttp", "pip install 'ddpcli[s3]' (or 'fsspec[http]')"),
    "https": ("aiohttp", "pip install 'ddpcli[s3]' (or 'fsspec[http]')"),
}
BUCKET_SCHEMES = ("s3", "gs", "gcs")
# Where Linux says it runs on an EC2 instance (AWS's "Detect whether a host is an EC2
# instance"): the DMI vendor of a Nitro instance, the hypervisor's UUID of a Xen one.
EC2_MARKERS = (
    (Path("/sys/devices/virtual/dmi/id/sys_vendor"), "Amazon EC2"),
    (Path("/sys/devices/virtual/dmi/id/bios_vendor"), "Amazon EC2"),
    (Path("/sys/hypervisor/uuid"), "ec2"),
)
# 4xx answers a retry cannot change (408 and 429 can: they say "later").
FINAL_STATUS = range(400, 500)
RETRIED_STATUS = (408, 429)


class ShardReadFailed(DdpcliError):
    """A shard that could not be read at run time: exit 1, one line naming its URL.

    Raised in a DataLoader worker, it reaches the training process re-created from the
    worker's formatted traceback, whose last line is `...ShardReadFailed: <message>`; only
    that message is kept, so the user still reads one line."""

    def __init__(self, message: str) -> None:
        last = (message.strip().splitlines() or [message])[-1]
        super().__init__(last.split(f"{ShardReadFailed.__name__}: ", 1)[-1], RUNTIME)


class ShardStore:
    """The folder (or bucket prefix) that holds index.json and the shards it names."""

    def __init__(self, location: str | Path):
        self.location = str(location).rstrip("/") or "/"

    @property
    def shown(self) -> str:
        """The location as messages say it."""
        return self.location

    def url(self, name: str) -> str:
        """NAME's address, as a message names it."""
        return f"{self.shown}/{name}"

    def check_container(self) -> None:
        """Exit 2 if what holds the shards (a bucket) is not there; a folder's absence is
        said by whoever looked for the index in it."""

    def size(self, name: str) -> int | None:
        """NAME's bytes, or None if there is no such file."""
        path = Path(self.location) / name
        return path.stat().st_size if path.is_file() else None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def read_text(self, name: str) -> str:
        return (Path(self.location) / name).read_text()

    @contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        """NAME as a stream read front to back (a tar read in stream mode never seeks)."""
        with open(Path(self.location) / name, "rb") as stream:
            yield stream


class UrlShardStore(ShardStore):
    """Shards under a URL, read through fsspec. Picklable: each process (a DataLoader
    worker, a verify worker) makes its own file system object when it first reads."""

    def __init__(self, location: str):
        scheme, rest = location.split("://", 1)
        self.scheme, self.location = scheme.lower(), f"{scheme}://{rest.rstrip('/')}"
        self._fs: Any = None
        if self.scheme in BUCKET_SCHEMES and self.bucket() is None:
            raise usage_error(f"{self.shown} names no bucket; e.g. {self.scheme}://bucket/shards")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None}

    @property
    def shown(self) -> str:
        return redacted_url(self.location)

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = url_filesystem(self.scheme)
        return self._fs

    def address(self, name: str) -> str:
        """NAME's full URL, credentials and all: for the file system only, never shown."""
        return f"{self.location}/{name}"

    def said(self, error: BaseException) -> str:
        """An error of the file system in one line, without credentials."""
        words = connection_in_words(error) or first_line(error)
        return redacted_url(words).replace(self.location, self.shown)

    def bucket(self) -> str | None:
        if self.scheme not in BUCKET_SCHEMES:
            return None
        return self.location.split("://", 1)[1].split("/", 1)[0] or None

    def check_container(self) -> None:
        bucket = self.bucket()
        if bucket is not None and not self.at_start(f"{self.scheme}://{bucket}", self.fs.exists):
            raise usage_error(
                f"the bucket {bucket} of {self.shown} does not exist (or these credentials "
                "cannot see it); check the URL, or create the bucket and upload the packed "
                "folder there"
            )

    def at_start(self, address: str, action: Callable[[str], Any]) -> Any:
        """ACTION on ADDRESS, before any shard is read: a failure to reach it is bad input
        (exit 2). FileNotFoundError is the caller's to take."""
        try:
            return action(address)
        except DdpcliError:
            raise
        except FileNotFoundError as error:
            cause = self.behind(error)
            if cause is error:
                raise
            raise self.unreachable(cause) from None
        except Exception as error:
            raise self.unreachable(error) from None

    def behind(self, error: BaseException) -> BaseException:
        """The error to act on. fsspec's HTTP client says FileNotFoundError for whatever
        stopped it, a refused connection too, with the real error as its cause: only a 404
        (410), or no cause, is an absence."""
        cause = error.__cause__
        http = self.scheme in ("http", "https")
        if not isinstance(error, FileNotFoundError) or not http or cause is None:
            return error
        return error if getattr(cause, "status", None) in (404, 410) else cause

    def unreachable(self, error: BaseException) -> DdpcliError:
        refused = isinstance(error, PermissionError) or getattr(error, "status", 0) in (401, 403)
        if refused or "credential" in str(error).lower():
            return usage_error(
                f"cannot read {self.shown}: {self.said(error)}; give credentials through the "
                "storage's usual variables (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                "AWS_PROFILE; GOOGLE_APPLICATION_CREDENTIALS for gs://)"
            )
        return usage_error(
            f"cannot reach {self.shown}: {self.said(error)}; check the URL and the network "
            "(an S3-compatible endpoint is set with AWS_ENDPOINT_URL)"
        )

    def size(self, name: str) -> int | None:
        try:
            info = self.at_start(self.address(name), self.fs.info)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        if info.get("size") is None:
            raise usage_error(f"{self.url(name)}: the server does not say its size")
        return int(info["size"])

    def read_text(self, name: str) -> str:
        try:
            data = self.at_start(self.address(name), self.fs.cat_file)
        except FileNotFoundError:
            raise usage_error(f"{self.url(name)} is missing") from None
        return bytes(data).decode()

    @contextmanager
    def open(self, name: str) -> Iterator[BinaryIO]:
        stream = ResumingStream(lambda offset: self.open_at(name, offset), self, name)
        try:
            yield stream  # type: ignore[misc]
        finally:
            stream.close()

    def open_at(self, name: str, offset: int) -> BinaryIO:
        """NAME's bytes from OFFSET on: an HTTP server's answer is one streamed GET (a Range
        from OFFSET on; a server that ignores Range sends it all and OFFSET bytes are
        skipped); an object store's, a ranged GET per block."""
        address = self.address(name)
        if self.scheme not in ("http", "https"):
            stream = self.fs.open(address, "rb", block_size=BLOCK_BYTES, cache_type="readahead")
            stream.seek(offset)
            return stream
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        stream = self.fs.open(address, "rb", block_size=0, headers=headers)
        if offset and getattr(getattr(stream, "r", None), "status", 206) != 206:
            skip(stream, offset)
        return stream


def skip(stream: BinaryIO, count: int) -> None:
    while count > 0:
        data = stream.read(min(count, BLOCK_BYTES))
        if not data:
            raise EOFError(f"the stream ended {count} bytes before the offset to continue at")
        count -= len(data)


class ResumingStream(io.RawIOBase):
    """A shard read front to back; a dropped connection is opened again where it stopped."""

    def __init__(self, open_at: Callable[[int], BinaryIO], store: UrlShardStore, name: str):
        super().__init__()
        self.open_at, self.store, self.name = open_at, store, name
        self.offset = 0
        self.stream: BinaryIO | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        for attempt in range(1, READ_TRIES + 1):
            try:
                if self.stream is None:
                    self.stream = self.open_at(self.offset)
                data = self.stream.read(-1 if size is None else size)
            except Exception as raised:
                self.drop()
                error = self.store.behind(raised)
                if not retryable(error):
                    raise self.failed(error, attempt) from None
                if attempt == READ_TRIES:
                    raise self.failed(error, attempt) from None
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 1))
                continue
            self.offset += len(data)
            return bytes(data)
        raise AssertionError("unreachable: the last try returns or raises")

    def failed(self, error: BaseException, tries: int) -> ShardReadFailed:
        url = self.store.url(self.name)
        if isinstance(error, FileNotFoundError):
            return ShardReadFailed(f"cannot read shard {url}: it is not there any more")
        at = f"at byte {self.offset:,}" if self.offset else "at its start"
        return ShardReadFailed(
            f"cannot read shard {url} ({at}, {tries} tries): {self.store.said(error)}; check "
            "the connection to the storage, then run again (--resume auto continues)"
        )

    def drop(self) -> None:
        stream, self.stream = self.stream, None
        # A connection that broke may fail to close too: it is gone either way.
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.close()

    def close(self) -> None:
        self.drop()
        super().close()


def retryable(error: BaseException) -> bool:
    """A dropped or stalled connection, or a server's passing trouble (5xx, 408, 429); not
    a missing object or refused access, which a retry cannot change."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, EOFError)):
        return False
    status = getattr(error, "status", None)
    if isinstance(status, int) and status in FINAL_STATUS and status not in RETRIED_STATUS:
        return False
    return isinstance(error, (OSError, asyncio.TimeoutError, *library_connection_errors()))


def connection_in_words(error: BaseException) -> str | None:
    """aiohttp's "Cannot connect to host H:P ssl:default [Connect call failed ('H', P)]"
    said shorter; None for any other error."""
    reason, host = getattr(error, "os_error", None), getattr(error, "host", None)
    if not isinstance(reason, OSError) or host is None:
        return None
    why = "refused" if isinstance(reason, ConnectionRefusedError) else first_line(reason)
    return f"cannot connect to {host}:{getattr(error, 'port', '?')} ({why})"


def library_connection_errors() -> tuple[type[BaseException], ...]:
    """The connection errors of the libraries under fsspec that are no OSError."""
    kinds: list[type[BaseException]] = []
    try:
        from fsspec.exceptions import FSTimeoutError

        kinds.append(FSTimeoutError)
    except ImportError:
        pass
    try:
        import aiohttp

        kinds.append(aiohttp.ClientError)
    except ImportError:
        pass
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError

        kinds += [BotoConnectionError, HTTPClientError]
    except ImportError:
        pass
    return tuple(kinds)


def url_filesystem(scheme: str) -> Any:
    """fsspec's file system for SCHEME, or exit 2 naming what to install."""
    package, install = PACKAGES.get(scheme, ("fsspec", "pip install fsspec"))
    try:
        import fsspec

        if scheme in ("http", "https"):
            import aiohttp

            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=HTTP_CONNECT_S, sock_read=HTTP_SILENT_S
            )
            return fsspec.filesystem(scheme, client_kwargs={"timeout": timeout})
        if scheme == "s3":
            without_instance_metadata()
        return fsspec.filesystem(scheme)
    except ImportError:
        raise usage_error(f"reading {scheme}:// needs the {package} package; {install}") from None


def without_instance_metadata() -> None:
    """Without credentials botocore asks the instance-metadata endpoint (169.254.169.254) last;
    off EC2 nothing answers there, and a laptop's `--dry-run` waited for its timeout before
    "Unable to locate credentials". Off EC2 the endpoint is skipped, for this process and the
    ones it starts; on an instance its role is the credentials, and the user's own
    AWS_EC2_METADATA_DISABLED (true or false) always stands."""
    if "AWS_EC2_METADATA_DISABLED" not in os.environ and not on_ec2():
        os.environ["AWS_EC2_METADATA_DISABLED"] = "true"


def on_ec2() -> bool:
    for marker, start in EC2_MARKERS:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if marker.read_text().strip().lower().startswith(start.lower()):
                return True
    return False


def shard_store(location: str | Path) -> ShardStore:
    return UrlShardStore(str(location)) if is_url(location) else ShardStore(location)
