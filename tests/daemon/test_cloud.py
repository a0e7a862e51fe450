"""The cloud tier against a real HTTP server and a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.cloud import CREDENTIALS, serve_files
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
