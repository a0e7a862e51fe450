"""The cloud tier against a real HTTP server and a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from trims.daemon.tiers.cloud import fetch, is_remote
from trims.errors import (
    CorruptModel,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    Timeout,
    Unavailable,
    ValidationError,
)

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class _FileServer(ThreadingHTTPServer):
    daemon_threads = True
    files: dict[str, bytes]
    cut: bool


class _Handler(BaseHTTPRequestHandler):
    server: _FileServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests assert on outcomes, not on access logs."""

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in _SLOW:
            _SLOW[path](self)
            return
        if path.startswith("/status/"):
            code = int(path.rsplit("/", 1)[1])
            self.send_response(code)
            if 300 <= code < 400:
                self.send_header("Location", path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path.startswith("/redirect/"):
            self.send_response(302)
            target = path.removeprefix("/redirect")
            self.send_header("Location", _FOREIGN.get(target, target))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self.server.files.get(path.removeprefix("/chunked"))
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        if path.startswith("/chunked"):
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for start in range(0, len(body), 65536):
                part = body[start : start + 65536]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.server.cut:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.wfile.write(body)


#: ``/redirect/<key>`` targets on other schemes.
_FOREIGN = {
    "/ftp": "ftp://127.0.0.1/m.bin",
    "/file": "file:///etc/passwd",
    "/s3": "s3://models/m.bin",
    "/FILE": "FILE:///etc/passwd",
    "/file-no-slashes": "file:/etc/passwd",
}


def _trickle(handler: _Handler, head: bytes) -> None:
    """Send ``head`` then one byte about every 0.2 s until the client goes away."""
    try:
        handler.wfile.write(head)
        for _ in range(10_000):
            handler.wfile.write(b"x")
            handler.wfile.flush()
            time.sleep(0.2)  # pacing the trickle, not ordering the test
    except OSError:
        pass
    handler.close_connection = True


def _silent(handler: _Handler) -> None:
    """Send the headers of a 10-byte body, then nothing until the client closes."""
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    handler.wfile.flush()
    with contextlib.suppress(OSError):
        handler.rfile.read(1)
    handler.close_connection = True


_SLOW: dict[str, Any] = {
    "/trickle": lambda h: _trickle(h, b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"),
    "/trickle-chunked": lambda h: _trickle(h, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n"),
    "/trickle-headers": lambda h: _trickle(h, b"HTTP/1.1 200 OK\r\nX-Slow: "),
    "/silent": _silent,
}


@contextlib.contextmanager
def serve_files(files: dict[str, bytes], *, cut: bool = False) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 (port 0) serving ``files``; yields its base URL.

    ``/status/<code>`` answers that status, ``/redirect/<path>`` redirects to ``<path>``
    (``/redirect/ftp``, ``/file``, ``/s3`` to such URLs), ``/trickle`` sends a byte every
    0.2 s (``/trickle-chunked`` without a length, ``/trickle-headers`` inside a header),
    ``/silent`` sends headers and then nothing,
    ``/chunked/<path>`` sends without Content-Length; ``cut`` sends half of each body and
    closes the connection.
    """
    server = _FileServer(("127.0.0.1", 0), _Handler)
    server.files, server.cut = files, cut
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="test-http", daemon=True
    )
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _fetch(source: str, dest: Path, **kw: Any) -> None:
    args: dict[str, Any] = {
        "s3_endpoint": None,
        "expected_sha256": None,
        "progress": None,
        "max_bytes": 1 << 30,
    }
    args.update(kw)
    fetch(source, dest, **args)


def test_is_remote() -> None:
    assert is_remote("http://h/m.onnx") and is_remote("HTTPS://h/m") and is_remote("s3://b/k")
    assert not is_remote("/models/m.onnx") and not is_remote("file:///m") and not is_remote("s3:x")


def test_http_download_with_progress_and_digest(tmp_path: Path) -> None:
    calls: list[tuple[str, int, int | None]] = []
    sha = hashlib.sha256(PAYLOAD).hexdigest()
    with serve_files({"/m.bin": PAYLOAD}) as base:
        for route in ("/m.bin", "/redirect/m.bin", "/chunked/m.bin"):
            dest = tmp_path / route.replace("/", "_")
            _fetch(base + route, dest, expected_sha256=sha, progress=lambda *a: calls.append(a))
            assert dest.read_bytes() == PAYLOAD
    assert calls[-1] == ("download", len(PAYLOAD), None)
    assert ("download", len(PAYLOAD), len(PAYLOAD)) in calls


@pytest.mark.parametrize(
    ("route", "error"),
    [
        ("/missing.bin", NotFound),
        ("/status/410", NotFound),
        ("/status/403", PermissionDenied),
        ("/status/500", Unavailable),
        ("/status/503", Unavailable),
        ("/status/400", ValidationError),
        ("/status/302", ValidationError),
    ],
)
def test_http_errors_are_translated(tmp_path: Path, route: str, error: type[Exception]) -> None:
    dest = tmp_path / "dest"
    with serve_files({}) as base, pytest.raises(error) as info:
        _fetch(base + route, dest)
    assert info.value.__cause__ is not None
    assert not dest.exists()


def test_redirect_to_ftp_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    with serve_files({}) as base, pytest.raises(ValidationError, match="only http"):
        _fetch(base + "/redirect/ftp", dest)
    assert not dest.exists()


@pytest.mark.parametrize(
    ("target", "kind"),
    [("file", "file"), ("s3", "s3"), ("FILE", "file"), ("ftp", "ftp"), ("file-no-slashes", "file")],
)
def test_redirect_to_another_scheme_is_refused_and_named(
    tmp_path: Path, target: str, kind: str
) -> None:
    dest = tmp_path / "dest"
    with serve_files({}) as base, pytest.raises(ValidationError) as info:
        _fetch(f"{base}/redirect/{target}?sig=secret", dest)
    message = str(info.value)
    assert f"redirect from {base}/redirect/{target} to a {kind}:// URL refused" in message
    assert "only http(s) redirects are followed" in message
    assert "loop" not in message and "secret" not in message
    assert not dest.exists()


def test_a_redirect_loop_is_reported_as_a_loop(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    with serve_files({}) as base, pytest.raises(ValidationError, match="redirects in a loop"):
        _fetch(base + "/status/302", dest)
    assert not dest.exists()


@pytest.mark.parametrize("route", ["/trickle", "/trickle-chunked", "/trickle-headers"])
def test_a_trickling_server_is_cut_off_at_the_deadline(tmp_path: Path, route: str) -> None:
    dest = tmp_path / "dest"
    with serve_files({}) as base, pytest.raises(Timeout) as info:
        _fetch(f"{base}{route}?sig=secret", dest, deadline=1.0, stall_timeout=30.0)
    message = str(info.value)
    assert f"download of {base}{route} did not finish within its deadline of 1 s" in message
    assert "secret" not in message
    assert not dest.exists()


def test_a_silent_server_is_cut_off_at_the_stall_timeout(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    with serve_files({}) as base, pytest.raises(Unavailable, match=r"stalled: no byte for 0\.5 s"):
        _fetch(base + "/silent", dest, deadline=600.0, stall_timeout=0.5)
    assert not dest.exists()


@pytest.mark.parametrize("kw", [{"deadline": 0}, {"stall_timeout": -1.0}])
def test_download_limits_must_be_positive(tmp_path: Path, kw: dict[str, float]) -> None:
    with pytest.raises(ValidationError, match="must be positive"):
        _fetch("http://127.0.0.1:1/m.bin", tmp_path / "dest", **kw)


@pytest.mark.parametrize(
    "url", ["http://[::1/m.bin", "http://host:port/m.bin", "http:///m.bin", "ftp://h/m.bin"]
)
def test_malformed_urls(tmp_path: Path, url: str) -> None:
    dest = tmp_path / "dest"
    with pytest.raises(ValidationError):
        _fetch(url, dest)
    assert not dest.exists()


def test_connection_cut_mid_body(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    with serve_files({"/m.bin": PAYLOAD}, cut=True) as base, pytest.raises(CorruptModel):
        _fetch(base + "/m.bin", dest)
    assert not dest.exists()


def test_refused_connection(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dest = tmp_path / "dest"
    with pytest.raises(Unavailable, match="cannot reach"):
        _fetch(f"http://127.0.0.1:{port}/m.bin", dest)
    assert not dest.exists()


@pytest.mark.parametrize("route", ["/m.bin", "/chunked/m.bin"])
def test_oversize(tmp_path: Path, route: str) -> None:
    dest = tmp_path / "dest"
    with serve_files({"/m.bin": PAYLOAD}) as base, pytest.raises(PayloadTooLarge):
        _fetch(base + route, dest, max_bytes=1000)
    assert not dest.exists()


def test_digest_mismatch(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    with serve_files({"/m.bin": PAYLOAD}) as base, pytest.raises(CorruptModel, match="sha256"):
        _fetch(base + "/m.bin", dest, expected_sha256="0" * 64)
    assert not dest.exists()


def test_existing_destination_is_kept(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    dest.write_bytes(b"mine")
    with serve_files({"/m.bin": PAYLOAD}) as base, pytest.raises(FileExistsError):
        _fetch(base + "/m.bin", dest)
    assert dest.read_bytes() == b"mine"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """A real moto S3 server on 127.0.0.1 for this module; yields its endpoint URL."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for key, value in CREDENTIALS.items():
            mp.setenv(key, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            yield f"http://{host}:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    """A fresh bucket ``models`` on the module's S3 server; yields (endpoint, client)."""
    import boto3

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3", endpoint_url=s3_server)
    client.create_bucket(Bucket="models")
    yield s3_server, client
    for item in client.list_objects_v2(Bucket="models").get("Contents", []):
        client.delete_object(Bucket="models", Key=item["Key"])
    client.delete_bucket(Bucket="models")


def test_s3_download(tmp_path: Path, s3: tuple[str, Any]) -> None:
    endpoint, client = s3
    client.put_object(Bucket="models", Key="dir/m.bin", Body=PAYLOAD)
    calls: list[tuple[str, int, int | None]] = []
    dest = tmp_path / "dest"
    _fetch(
        "s3://models/dir/m.bin",
        dest,
        s3_endpoint=endpoint,
        expected_sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        progress=lambda *a: calls.append(a),
    )
    assert dest.read_bytes() == PAYLOAD
    assert calls[-1] == ("download", len(PAYLOAD), len(PAYLOAD))


@pytest.mark.parametrize(
    ("source", "kw", "error"),
    [
        ("s3://models/missing.bin", {}, NotFound),
        ("s3://no-such-bucket/m.bin", {}, NotFound),
        ("s3://models/m.bin", {"max_bytes": 10}, PayloadTooLarge),
        ("s3://models/m.bin", {"expected_sha256": "0" * 64}, CorruptModel),
        ("s3://models", {}, ValidationError),
    ],
)
def test_s3_errors(
    tmp_path: Path, s3: tuple[str, Any], source: str, kw: dict[str, Any], error: type[Exception]
) -> None:
    endpoint, client = s3
    client.put_object(Bucket="models", Key="m.bin", Body=PAYLOAD)
    dest = tmp_path / "dest"
    with pytest.raises(error):
        _fetch(source, dest, s3_endpoint=endpoint, **kw)
    assert not dest.exists()


def test_s3_endpoint_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dest = tmp_path / "dest"
    with pytest.raises(Unavailable):
        _fetch("s3://models/m.bin", dest, s3_endpoint=f"http://127.0.0.1:{port}", stall_timeout=2.0)
    assert not dest.exists()
