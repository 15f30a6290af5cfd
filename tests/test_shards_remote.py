"""Shards read from object storage (issue 36 item 4): a real S3 endpoint (moto's server on
127.0.0.1, read through s3fs) and a plain HTTP server, both started here. Shards are
streamed, a dropped connection is reopened where it stopped, a read that keeps failing ends
with one line naming the URL, a missing bucket is exit 2, and credentials (environment
variables, a URL's user:password@) are never printed or saved."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import free_port, run_cli, traced_counts
from test_data_pack import invoke, pack, write_image_folder

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET, PREFIX = "ddpcli-shards", "digits/v1"
# Not the secret of any account: moto accepts any; the tests check it never shows.
ACCESS_KEY, SECRET_KEY = "AKIDDPCLITESTKEY", "ddpcli-test-secret-never-shown"


class RangeHandler(SimpleHTTPRequestHandler):
    """Static files with Range requests honoured (http.server ignores them), every request
    logged, and a response cut short where the test says: CUTS[path] = [byte, times]."""

    def log_message(self, *args: object) -> None:  # quiet: the tests read `requests`
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start, end = self.requested_range(len(data))
        self.server.requests.append((self.path, start))  # type: ignore[attr-defined]
        self.send_response(206 if self.headers.get("Range") else 200)
        if self.headers.get("Range"):
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        cut = self.server.cuts.get(self.path)  # type: ignore[attr-defined]
        if cut and cut[1] > 0 and start <= cut[0] < end:
            cut[1] -= 1
            self.wfile.write(data[start : cut[0]])
            self.wfile.flush()
            time.sleep(0.2)  # the client reads what came before the connection drops
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(data[start:end])

    def requested_range(self, size: int) -> tuple[int, int]:
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if not match:
            return 0, size
        return int(match[1]), min(size, int(match[2]) + 1) if match[2] else size


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    src = write_image_folder(root / "src", train_per_class=6, val_per_class=2)
    out = root / "shards"
    result = pack(src, out, "--shard-size", "8K", "--workers", "1")
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def s3(packed):
    """moto's S3 server on a free port of 127.0.0.1, the packed folder uploaded under
    s3://BUCKET/PREFIX; yields the environment a command reads it with."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }
        client = boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        for path in sorted(packed.iterdir()):
            client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.name}")
        yield env
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3, monkeypatch):
    """The S3 endpoint's variables in this process too (for commands run in it)."""
    for name, value in s3.items():
        monkeypatch.setenv(name, value)
    return s3


@contextlib.contextmanager
def serving(folder: Path, handler: type[RangeHandler] = RangeHandler):
    """A local HTTP server of FOLDER, answered by HANDLER; yields (base URL, server)."""

    class Handler(handler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.requests, server.cuts = [], {}  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def http(packed):
    """A local HTTP server of the packed folder; yields (base URL, server)."""
    with serving(packed) as served:
        yield served


def train_from(url: str, out: Path, nproc: int, workers: int):
    """A one-epoch tiny run on the shards at URL."""
    return run_cli(
        "train", "--data-dir", url, "--cpu", "--nproc", str(nproc), "--arch", "tinycnn",
        "--image-size", "16", "--per-gpu-batch", "2", "--epochs", "1", "--workers", str(workers),
        "--out", str(out), timeout=180,
    )  # fmt: skip


def one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_verify_streams_shards_from_s3_and_http(s3, http, packed):
    """Every shard read and checked over both endpoints; from S3 in worker processes (the
    store travels to them without its connection), from HTTP in this one."""
    names = sorted(path.name for path in packed.glob("*.tar"))
    url, server = http
    server.requests.clear()
    from_s3 = run_cli(
        "data", "verify", f"s3://{BUCKET}/{PREFIX}", "--json", "--workers", "2", env=s3
    )
    from_http = invoke("data", "verify", f"{url}/", "--json", "--workers", "1")
    for result in (from_s3, from_http):
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["ok"] and sorted(check["name"] for check in report["shards"]) == names
        assert {check["status"] for check in report["shards"]} == {"ok"}
    # One streamed GET per shard over HTTP: never a copy fetched before reading it.
    shard_gets = [path for path, _ in server.requests if path.endswith(".tar")]
    assert sorted(name.lstrip("/") for name in shard_gets) == names


def test_a_dropped_connection_is_reopened_where_it_stopped(http, monkeypatch):
    from ddpcli.data.shards import storage

    monkeypatch.setattr(storage, "RETRY_PAUSE_S", 0.01)
    url, server = http
    shard = "/train-000001.tar"
    server.requests.clear()
    server.cuts[shard] = [4096, 1]
    result = invoke("data", "verify", url, "--json", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert all(check["status"] == "ok" for check in json.loads(result.stdout)["shards"])
    starts = [start for path, start in server.requests if path == shard]
    assert starts == [0, 4096]  # the second GET asked for the rest, from the byte reached


def test_a_read_that_keeps_failing_ends_with_one_line_naming_the_url(http, monkeypatch):
    from ddpcli.data.shards import storage

    monkeypatch.setattr(storage, "RETRY_PAUSE_S", 0.01)
    url, server = http
    shard = "/train-000002.tar"
    server.requests.clear()
    server.cuts[shard] = [4096, 100]
    try:
        result = invoke("data", "verify", url, "--workers", "1")
    finally:
        server.cuts.pop(shard)
    assert result.returncode == 1
    line = one_line(result)
    assert f"{url}{shard}" in line and f"{storage.READ_TRIES} tries" in line
    assert len([path for path, _ in server.requests if path == shard]) == storage.READ_TRIES


def test_credentials_are_never_shown(http, s3_env):
    """A URL's user:password@ is said as ***@; the S3 secret in the environment never
    appears."""
    url, _ = http
    with_password = url.replace("http://", "http://alice:pa55word@")
    result = invoke("data", "verify", with_password + "/nothing-here")
    assert result.returncode == 2
    line = one_line(result)
    assert "pa55word" not in line and "alice" not in line and "***@127.0.0.1" in line
    result = invoke("data", "verify", with_password, "--json", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "pa55word" not in result.stdout + result.stderr
    result = invoke("data", "verify", f"s3://{BUCKET}/{PREFIX}", "--json", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert SECRET_KEY not in result.stdout + result.stderr


def test_bad_urls_are_exit_2_with_one_line(http, s3_env, unused_port):
    url, _ = http
    cases = [
        (f"s3://no-such-bucket-{unused_port}/shards", "the bucket no-such-bucket"),
        (f"s3://{BUCKET}/no/such/prefix", "index.json is missing"),
        (f"{url}/no/such/folder", "index.json is missing"),
        (f"http://127.0.0.1:{unused_port}/shards", "cannot reach http://127.0.0.1"),
        ("ftp://example.org/shards", "ftp:// is not a storage"),
        ("s3://", "names no bucket"),
    ]
    for location, words in cases:
        result = invoke("data", "verify", location)
        assert result.returncode == 2, (location, result.stderr)
        assert words in one_line(result), location


@pytest.fixture
def unused_port() -> int:
    return free_port()


def test_train_from_s3_stopped_and_resumed_at_another_world_trains_each_sample_once(
    s3, packed, tmp_path
):
    """Shards streamed from S3 by the ranks; stopped after a step at 3 ranks, resumed
    at 2: every training sample of the epoch once; the secret key in no output or file."""
    out, trace = tmp_path / "run", tmp_path / "trace"
    settings = [
        "--data-dir", f"s3://{BUCKET}/{PREFIX}/", "--cpu", "--arch", "tinycnn",
        "--image-size", "16", "--per-gpu-batch", "2", "--epochs", "1", "--workers", "0",
        "--out", str(out),
    ]  # fmt: skip
    env = {**s3, "DDPCLI_TRACE_SAMPLES": str(trace)}
    first = run_cli("train", *settings, "--nproc", "3", "--max-steps", "1", env=env, timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli("train", *settings, "--nproc", "2", "--resume", "auto", env=env, timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "on shards" in second.stderr and "world 3 -> 2" in second.stderr
    samples = json.loads((packed / "index.json").read_text())["splits"]["train"]["samples"]
    assert traced_counts(trace, 3) == Counter(range(samples))
    config = json.loads((out / "config.json").read_text())
    assert config["dataset"] == "shards" and config["data_dir"].startswith(f"s3://{BUCKET}/")
    shown = first.stdout + first.stderr + second.stdout + second.stderr
    kept = b"".join(path.read_bytes() for path in out.rglob("*") if path.is_file())
    assert SECRET_KEY not in shown and SECRET_KEY.encode() not in kept


def test_train_from_a_missing_bucket_is_exit_2_before_any_worker(s3_env):
    result = invoke("train", "--data-dir", "s3://no-such-bucket-ddpcli/shards", "--cpu")
    assert result.returncode == 2
    line = one_line(result)
    assert "the bucket no-such-bucket-ddpcli" in line and "rank" not in line


def test_train_ends_with_one_line_naming_the_shard_that_cannot_be_read(http, tmp_path):
    """Over HTTP, a training shard whose every read drops: after the retries, exit 1 with
    the rank and the shard's URL, raised in a loader worker and said as one line (one rank:
    how the launcher reports a rank's failure to the others is tested elsewhere)."""
    url, server = http
    shard = "/train-000003.tar"
    server.cuts[shard] = [2048, 1000]
    try:
        result = train_from(url, tmp_path / "run", nproc=1, workers=1)
    finally:
        server.cuts.pop(shard)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    failure = [line for line in result.stderr.splitlines() if f"{url}{shard}" in line]
    assert len(failure) == 1 and "rank " in failure[0] and "5 tries" in failure[0], result.stderr


def test_a_urls_password_is_kept_only_for_the_workers():
    """config.json and checkpoints hold the config as model_dump_json writes it: ***@; the
    launcher's private request to its own workers keeps the password they read with."""
    from ddpcli.config.data import WITH_CREDENTIALS
    from ddpcli.config.train import build_train_config

    cfg = build_train_config({"data_dir": "https://alice:pa55word@data.example.org/x"}, None)
    assert cfg.dataset == "shards"
    saved = cfg.model_dump_json()
    assert "pa55word" not in saved and '"https://***@data.example.org/x"' in saved
    assert "alice:pa55word@" in cfg.model_dump_json(context={WITH_CREDENTIALS: True})


# --- No request to the instance-metadata endpoint off EC2 --------------------------------------


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """A laptop's shell: no AWS variables, no ~/.aws files, no s3fs connection cached by an
    earlier test, and AWS_EC2_METADATA_DISABLED as this process had it again afterwards."""
    import s3fs

    for name in [name for name in os.environ if name.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "")  # recorded, so the fix's value goes
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_without_credentials_s3_is_exit_2_at_once_and_never_asks_the_metadata_endpoint(
    no_aws_credentials, monkeypatch
):
    """Off EC2 botocore's search for credentials skips the instance-metadata endpoint (a
    laptop would wait for its timeout): a listening stand-in for it is never connected to."""
    from ddpcli.data.shards import storage

    monkeypatch.setattr(storage, "on_ec2", lambda: False)
    with socket.create_server(("127.0.0.1", 0)) as metadata:
        metadata.setblocking(False)
        monkeypatch.setenv(
            "AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{metadata.getsockname()[1]}"
        )
        started = time.monotonic()
        result = invoke("data", "verify", "s3://some-bucket/shards")
        took = time.monotonic() - started
        with pytest.raises(BlockingIOError):
            metadata.accept()  # nobody knocked
    assert result.returncode == 2
    assert "Unable to locate credentials" in one_line(result)
    assert took < 10
    assert os.environ["AWS_EC2_METADATA_DISABLED"] == "true"


def test_the_metadata_endpoint_stays_on_ec2_and_where_the_user_says(
    no_aws_credentials, monkeypatch
):
    from botocore.utils import IMDSFetcher

    from ddpcli.data.shards import storage

    monkeypatch.setattr(storage, "on_ec2", lambda: False)
    storage.url_filesystem("s3")
    assert IMDSFetcher()._disabled  # what botocore reads: off
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")  # the user's own word stands
    storage.url_filesystem("s3")
    assert not IMDSFetcher()._disabled
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    monkeypatch.setattr(storage, "on_ec2", lambda: True)  # an instance's role is its credentials
    storage.url_filesystem("s3")
    assert "AWS_EC2_METADATA_DISABLED" not in os.environ


# --- A server that goes away (issue 47 findings 8 and 10) --------------------------------------


class Outage:
    """The packed folder served on a port of its own, which goes away when SHARD is first
    asked for, as `python -m http.server` killed mid-shard: its port closed and that answer
    cut after 4 KiB; back on the same port after AWAY_S seconds (None: never)."""

    def __init__(self, folder: Path, shard: str, away_s: float | None):
        self.folder, self.shard, self.away_s = folder, shard, away_s
        self.requests: list[tuple[str, int]] = []
        self.cuts = {shard: [4096, 1]}
        self.running: list[ThreadingHTTPServer] = []
        self.went = False
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        outage = self

        class Handler(RangeHandler):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, directory=str(outage.folder), **kwargs)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path == outage.shard and not outage.went:
                    outage.went = True
                    threading.Thread(target=outage.go_away, daemon=True).start()
                super().do_GET()

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.requests, server.cuts = self.requests, self.cuts  # type: ignore[attr-defined]
        self.port = server.server_address[1]
        self.running.append(server)
        serve = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        serve.start()

    def go_away(self) -> None:
        self.stop()
        if self.away_s is not None:
            time.sleep(self.away_s)
            self.start()

    def stop(self) -> None:
        while self.running:
            server = self.running.pop()
            server.shutdown()
            server.server_close()


@pytest.fixture
def outage(packed):
    """Outage(shard, away_s): the packed folder behind a server that goes away mid-shard."""
    made: list[Outage] = []

    def start(shard: str, away_s: float | None) -> Outage:
        made.append(Outage(packed, shard, away_s))
        return made[-1]

    yield start
    for server in made:
        server.stop()


def test_a_server_away_for_a_second_is_waited_for(outage):
    """Killed mid-shard and started again a second later: the reads retry until it is back
    (fsspec's HTTP client says FileNotFoundError for a refused connection: that read was
    taken for a shard deleted, and the command ended at once)."""
    shard = "/train-000001.tar"
    server = outage(shard, away_s=1.0)
    result = invoke("data", "verify", server.url, "--json", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert all(check["status"] == "ok" for check in json.loads(result.stdout)["shards"])
    assert [start for path, start in server.requests if path == shard] == [0, 4096]


def test_a_server_that_stays_away_ends_with_one_line_after_the_retries(outage, monkeypatch):
    from ddpcli.data.shards import storage

    monkeypatch.setattr(storage, "RETRY_PAUSE_S", 0.01)
    shard = "/train-000001.tar"
    server = outage(shard, away_s=None)
    result = invoke("data", "verify", server.url, "--workers", "1")
    assert result.returncode == 1, result.stderr
    line = one_line(result)
    assert f"{server.url}{shard}" in line and f"{storage.READ_TRIES} tries" in line, line
    assert f"cannot connect to 127.0.0.1:{server.port}" in line, line
    assert "not there any more" not in line


class IndexHandler(RangeHandler):
    """The server goes away once the launcher has read index.json: the first rank to ask
    for it again waits (it is still reading when the other rank fails), every later request
    is cut unanswered. Each reader of the index asks HEAD first."""

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
        server = self.server
        if self.path == "/index.json":
            server.index_readers += 1  # type: ignore[attr-defined]
            if server.index_readers == 2:  # type: ignore[attr-defined]
                server.release.wait(60)  # type: ignore[attr-defined]
                return  # its reader was stopped meanwhile
            if server.index_readers > 2:  # type: ignore[attr-defined]
                server.gone = True  # type: ignore[attr-defined]
        if not self.hung_up():
            super().do_HEAD()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if not self.hung_up():
            super().do_GET()

    def hung_up(self) -> bool:
        if not self.server.gone:  # type: ignore[attr-defined]
            return False
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True
        return True


def test_a_server_gone_after_the_launchers_check_is_a_run_time_failure_without_stacks(
    packed, tmp_path
):
    """Exit 1 (it was there when the launcher checked), the failed rank's line, and no
    stack from the rank the agent stopped while it was still reading (it printed 40 lines
    of faulthandler's, and the command ended with exit 2, as for bad input)."""

    with serving(packed, IndexHandler) as (url, server):
        server.index_readers, server.gone = 0, False
        server.release = threading.Event()
        try:
            result = train_from(url, tmp_path / "run", nproc=2, workers=0)
        finally:
            server.release.set()  # the held reader, before the server shuts down
    assert result.returncode == 1, result.stderr[-3000:]
    assert server.index_readers >= 3  # type: ignore[attr-defined] # the launcher, both ranks
    for stack in ("Traceback", "Thread 0x", "Current thread", "most recent call first"):
        assert stack not in result.stderr, result.stderr[-3000:]
    failed = [line for line in result.stderr.splitlines() if f"cannot reach {url}" in line]
    assert len(failed) == 1 and failed[0].startswith("error: rank "), result.stderr[-3000:]
    assert "failed first: exit code 1 (then rank " in result.stderr, result.stderr[-3000:]
