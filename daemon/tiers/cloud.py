"""The cloud tier: fetch a model file from http(s):// or s3:// into a local file.

Blocking code (the server runs it in a worker thread): stdlib ``urllib.request`` for http(s)
with timeouts and a redirect limit, boto3 for s3:// with a configurable endpoint so any
S3-compatible store works. Bodies are streamed to disk in chunks while being hashed; a failed or
interrupted download removes the destination, so nothing half-written survives. Third-party
errors are translated at this boundary:

=====================================  ======================================================
NotFound                               HTTP 404/410, S3 NoSuchKey/NoSuchBucket
PermissionDenied                       HTTP 401/403, S3 AccessDenied, no S3 credentials
Unavailable (retryable)                connection refused/reset, timeouts, HTTP 5xx/429
CorruptModel                           short read (connection cut mid-body), sha256 mismatch
PayloadTooLarge                        announced or actual size over ``max_bytes``
ValidationError                        bad URL, other HTTP 4xx, too many redirects
=====================================  ======================================================
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import SplitResult, quote, urlsplit, urlunsplit

from trims.config import format_size
from trims.errors import (
    CorruptModel,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    TrimsError,
    Unavailable,
    ValidationError,
)
from trims.protocol import Progress

log = logging.getLogger(__name__)


SCHEMES = ("http", "https", "s3")
CHUNK = 1 << 20
#: Seconds to wait for a connection or for the next bytes of a body.
TIMEOUT = 30.0
#: Redirects followed before giving up (a loop otherwise never ends).
MAX_REDIRECTS = 5


def scheme(source: str) -> str:
    """The lower-case scheme of a URL ("" for a plain path)."""
    return source.split("://", 1)[0].lower() if "://" in source else ""


def is_remote(source: str) -> bool:
    """True for http://, https:// and s3:// sources."""
    return scheme(source) in SCHEMES


def split(url: str) -> SplitResult:
    """urlsplit, with a malformed URL reported as a ValidationError."""
    try:
        parts = urlsplit(url)
        _ = parts.port
    except ValueError as e:
        raise ValidationError(f"malformed URL {url!r}: {e}") from e
    return parts


def sibling(url: str, name: str) -> str:
    """The URL of ``name`` (a relative path) in the folder of ``url``.

    Credentials and the query string carry over: a token valid for the folder (an Azure SAS,
    an access token) reaches the sibling too; a signature for one object would not, and the
    server then answers 403, which names the file.
    """
    import posixpath

    parts = split(url)
    path = posixpath.join(posixpath.dirname(parts.path) or "/", quote(name))
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def redact(url: str) -> str:
    """The URL without credentials or query string (which may hold a signature)."""
    parts = split(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class _Sink:
    """Counts, bounds, hashes and writes the bytes of one download."""

    def __init__(
        self, f: IO[bytes], url: str, max_bytes: int, total: int | None, progress: Progress | None
    ) -> None:
        self.f, self.url, self.max_bytes, self.total = f, url, max_bytes, total
        self.progress = progress
        self.done = 0
        self.hash = hashlib.sha256()
        if total is not None and total > max_bytes:
            raise PayloadTooLarge(
                f"{url} is {format_size(total)}, over the limit of {format_size(max_bytes)}",
                size=total,
                limit=max_bytes,
            )

    def write(self, chunk: bytes) -> None:
        self.done += len(chunk)
        if self.done > self.max_bytes:
            raise PayloadTooLarge(
                f"{self.url} is larger than the limit of {format_size(self.max_bytes)}",
                limit=self.max_bytes,
            )
        self.f.write(chunk)
        self.hash.update(chunk)
        if self.progress is not None:
            self.progress("download", self.done, self.total)

    def check_complete(self) -> None:
        if self.total is not None and self.done != self.total:
            raise CorruptModel(
                f"download of {self.url} ended after {self.done} of {self.total} bytes "
                "(connection cut); try again"
            )


class _LimitedRedirects(urllib.request.HTTPRedirectHandler):
    """At most MAX_REDIRECTS redirects, and only to http(s) (never ftp:// or file://)."""

    max_redirections = MAX_REDIRECTS
    max_repeats = 2

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        target = scheme(newurl)
        if target not in ("http", "https"):
            raise ValidationError(
                f"{redact(req.full_url)} redirects to a {target or 'relative'}:// URL; only "
                "http(s) redirects are followed"
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _http_status_error(url: str, e: urllib.error.HTTPError) -> TrimsError:
    if e.code in (404, 410):
        return NotFound(f"{url} does not exist (HTTP {e.code})")
    if e.code in (401, 403):
        return PermissionDenied(f"{url} refused access (HTTP {e.code}); check the URL's access")
    if e.code >= 500 or e.code in (408, 429):
        return Unavailable(f"{url} answered HTTP {e.code} {e.reason}; try again later")
    if 300 <= e.code < 400:
        return ValidationError(f"{url} redirects more than {MAX_REDIRECTS} times or in a loop")
    return ValidationError(f"{url} answered HTTP {e.code} {e.reason}")


def _fetch_http(url: str, f: IO[bytes], sink_args: dict[str, Any], timeout: float) -> _Sink:
    shown = redact(url)
    if not split(url).hostname:
        raise ValidationError(f"{url!r} names no host; use http(s)://HOST/PATH")
    opener = urllib.request.build_opener(_LimitedRedirects)
    request = urllib.request.Request(url, headers={"User-Agent": "trims"})
    try:
        with opener.open(request, timeout=timeout) as resp:
            length = resp.headers.get("Content-Length")
            total = int(length) if length is not None and length.isdigit() else None
            sink = _Sink(f, shown, total=total, **sink_args)
            while chunk := resp.read(CHUNK):
                sink.write(chunk)
    except urllib.error.HTTPError as e:
        with e:
            raise _http_status_error(shown, e) from e
    except http.client.IncompleteRead as e:
        raise CorruptModel(
            f"download of {shown} ended early ({len(e.partial)} bytes in the last read, "
            f"{e.expected} missing): connection cut; try again"
        ) from e
    except urllib.error.URLError as e:
        raise Unavailable(f"cannot reach {shown}: {e.reason}; check the URL and network") from e
    except (TimeoutError, ConnectionError, http.client.HTTPException) as e:
        raise Unavailable(f"download of {shown} failed: {e!r}; try again") from e
    sink.check_complete()
    return sink


def _s3_error(url: str, e: Exception) -> TrimsError:
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
        IncompleteReadError,
        NoCredentialsError,
        ResponseStreamingError,
    )
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError,
    )

    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
            return NotFound(f"{url} does not exist ({code or status})")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return PermissionDenied(f"{url} refused access ({code}); check the S3 credentials")
        if status >= 500 or code in ("SlowDown", "ServiceUnavailable", "InternalError"):
            return Unavailable(f"{url}: S3 answered {code or status}; try again later")
        return ValidationError(f"{url}: S3 answered {code or status}: {e}")
    if isinstance(e, NoCredentialsError):
        return PermissionDenied(
            f"no S3 credentials to fetch {url}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
            "or an AWS profile for the daemon"
        )
    if isinstance(e, IncompleteReadError | ResponseStreamingError):
        return CorruptModel(f"download of {url} ended early (connection cut): {e}; try again")
    if isinstance(e, BotoConnectionError | HTTPClientError):
        return Unavailable(f"cannot reach the S3 endpoint for {url}: {e}")
    return Unavailable(f"download of {url} failed: {e!r}; try again")


def _iter_s3(body: Any) -> Iterator[bytes]:
    while chunk := body.read(CHUNK):
        yield chunk


def _fetch_s3(
    url: str, f: IO[bytes], sink_args: dict[str, Any], endpoint: str | None, timeout: float
) -> _Sink:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    parts = split(url)
    bucket, key = parts.netloc, parts.path.lstrip("/")
    if not bucket or not key:
        raise ValidationError(f"{url} is not an S3 object URL: use s3://BUCKET/KEY")
    shown = f"s3://{bucket}/{key}"
    config = Config(
        connect_timeout=timeout,
        read_timeout=timeout,
        retries={"max_attempts": 2, "mode": "standard"},
    )
    try:
        client = boto3.client("s3", endpoint_url=endpoint, config=config)
        response = client.get_object(Bucket=bucket, Key=key)
        body = response["Body"]
        with body:
            sink = _Sink(f, shown, total=int(response.get("ContentLength", 0)), **sink_args)
            for chunk in _iter_s3(body):
                sink.write(chunk)
    except (BotoCoreError, ClientError) as e:
        raise _s3_error(shown, e) from e
    except (TimeoutError, ConnectionError, http.client.HTTPException) as e:
        raise Unavailable(f"download of {shown} failed: {e!r}; try again") from e
    sink.check_complete()
    return sink


def fetch(
    source: str,
    dest: Path,
    *,
    s3_endpoint: str | None,
    expected_sha256: str | None,
    progress: Progress | None,
    max_bytes: int,
    timeout: float = TIMEOUT,
) -> None:
    """Download ``source`` into the new file ``dest`` (fsynced), or raise and leave no ``dest``."""
    kind = scheme(source)
    if kind not in SCHEMES:
        raise ValidationError(f"unsupported source scheme {kind!r}; use http(s):// or s3://")
    sink_args: dict[str, Any] = {"max_bytes": max_bytes, "progress": progress}
    f = open(dest, "xb")  # noqa: SIM115 - closed by the with below; exists check first
    try:
        with f:
            if kind == "s3":
                sink = _fetch_s3(source, f, sink_args, s3_endpoint, timeout)
            else:
                sink = _fetch_http(source, f, sink_args, timeout)
            f.flush()
            os.fsync(f.fileno())
        digest = sink.hash.hexdigest()
        if expected_sha256 is not None and digest != expected_sha256.lower():
            raise CorruptModel(
                f"{sink.url} has sha256 {digest}, expected {expected_sha256}: the file changed "
                "or was damaged in transit"
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    log.info("fetched %s (%s)", sink.url, format_size(sink.done))
