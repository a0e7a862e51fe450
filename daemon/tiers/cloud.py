"""The cloud tier: fetch a model file from http(s):// or s3:// into a local file.

Blocking code (the server runs it in a worker thread): stdlib ``urllib.request`` for http(s)
with a redirect limit, boto3 for s3:// with a configurable endpoint so any S3-compatible store
works. Bodies are streamed to disk in chunks while being hashed; a failed or interrupted
download removes the destination, so nothing half-written survives.

Two limits bound the time a download may take (see Note [download deadline]): the stall
timeout (no byte for that long, connecting included) and the overall deadline (the whole
download, redirects included), so a server that trickles one byte every few seconds cannot
hold an ``add`` forever. Only http(s) redirects are followed (never file://, ftp://, s3://).
Third-party errors are translated at this boundary:

=====================================  ======================================================
NotFound                               HTTP 404/410, S3 NoSuchKey/NoSuchBucket
PermissionDenied                       HTTP 401/403, S3 AccessDenied, no S3 credentials
Unavailable (retryable)                connection refused/reset, stalls, HTTP 5xx/429
Timeout (retryable)                    the download ran past its overall deadline
CorruptModel                           short read (connection cut mid-body), sha256 mismatch
PayloadTooLarge                        announced or actual size over ``max_bytes``
ValidationError                        bad URL, other HTTP 4xx, redirect loops, non-http(s)
                                       redirects
=====================================  ======================================================
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import SplitResult, quote, urljoin, urlsplit, urlunsplit

from trims.config import format_size
from trims.errors import (
    CorruptModel,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    Timeout,
    TrimsError,
    Unavailable,
    ValidationError,
    error_for_status,
)
from trims.protocol import Progress

log = logging.getLogger(__name__)


SCHEMES = ("http", "https", "s3")
CHUNK = 1 << 20
#: Default stall timeout, seconds: the longest wait for a connection or for the next bytes of
#: a body. 60 s rides out a busy server or a congested link; DaemonSettings sets it.
STALL_TIMEOUT = 60.0
#: Default overall deadline of one download, seconds: one hour fetches tens of GiB on an
#: ordinary link. DaemonSettings sets it.
DEADLINE = 3600.0
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
    """At most MAX_REDIRECTS redirects, and only to http(s) (never file://, ftp:// or s3://).

    urllib itself refuses file:// with an HTTPError carrying the 3xx code (which would read as
    a loop) and follows ftp://; both are refused here, before urllib looks at the target.
    """

    max_redirections = MAX_REDIRECTS
    max_repeats = 2

    def http_error_302(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Any
    ) -> Any:
        location = headers.get("location") or headers.get("uri")
        if location is not None:
            try:
                target = urlsplit(urljoin(req.full_url, location)).scheme.lower()
            except ValueError as e:
                fp.close()
                raise ValidationError(
                    f"{redact(req.full_url)} redirects to a malformed URL: {e}"
                ) from e
            if target not in ("http", "https"):
                fp.close()
                raise ValidationError(
                    f"redirect from {redact(req.full_url)} to a {target}:// URL refused; only "
                    "http(s) redirects are followed"
                )
        try:
            return super().http_error_302(req, fp, code, msg, headers)
        except urllib.error.HTTPError as e:
            if not str(e.msg).startswith(self.inf_msg):
                raise
            with e:
                raise ValidationError(
                    f"{redact(req.full_url)} redirects in a loop or more than {MAX_REDIRECTS} "
                    "times; fix the URL or the server's redirects"
                ) from e

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


# Note [download deadline]: every read of a download waits at most the stall timeout (the
# socket timeout, so a server that stops sending is cut off), but a server that sends one byte
# just before each timeout would keep a download going forever. The overall deadline is
# enforced by a watchdog timer: when it fires it shuts down every socket the download opened
# (redirects open new ones), which wakes the blocked read at once, wherever it is (status
# line, headers or body); the download then reports Timeout, never a short read, because the
# watchdog says it fired. For http(s) the sockets are recorded by a connection class wrapped
# around urllib's; for s3:// the body stream is shut down (urllib3's ``shutdown``), and the
# request before the body is bounded by the stall timeout and botocore's two attempts.
class _Watchdog:
    """Shuts down the connections of one download when its deadline passes."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.fired = False
        self._lock = threading.Lock()
        self._closers: list[Callable[[], None]] = []
        self._timer = threading.Timer(deadline, self._fire)
        self._timer.name = "trims-download-deadline"
        self._timer.daemon = True

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self._timer.join()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            closers, self._closers = self._closers, []
        for close in closers:
            with contextlib.suppress(Exception):
                close()

    def watch(self, close: Callable[[], None]) -> None:
        """Call ``close`` (from the timer thread) when the deadline passes, or now if it has."""
        with self._lock:
            if not self.fired:
                self._closers.append(close)
                return
        with contextlib.suppress(Exception):
            close()

    def connection_class(self, base: type[http.client.HTTPConnection]) -> Callable[..., Any]:
        """``base`` with every socket it connects handed to this watchdog."""
        watchdog = self

        class Watched(base):  # type: ignore[valid-type,misc]
            def connect(self) -> None:
                super().connect()
                sock = self.sock
                watchdog.watch(lambda: sock.shutdown(socket.SHUT_RDWR))

        return Watched


class _WatchedHTTP(urllib.request.HTTPHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._watchdog = watchdog

    def do_open(self, http_class: Any, req: urllib.request.Request, **kw: Any) -> Any:
        return super().do_open(self._watchdog.connection_class(http_class), req, **kw)


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, watchdog: _Watchdog) -> None:
        super().__init__()
        self._watchdog = watchdog

    def do_open(self, http_class: Any, req: urllib.request.Request, **kw: Any) -> Any:
        return super().do_open(self._watchdog.connection_class(http_class), req, **kw)


def _seconds(value: float) -> str:
    """3600.0 -> '3600', 0.999997 -> '1', 0.5 -> '0.5'."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _deadline_error(url: str, deadline: float, done: int) -> Timeout:
    return Timeout(
        f"download of {url} did not finish within its deadline of {_seconds(deadline)} s "
        f"({format_size(done)} received); the server is too slow: try again later, use a "
        "closer mirror, or raise --download-deadline"
    )


#: What a status's error says about a model URL ({url}, {code}, {reason}).
_HTTP_MESSAGES: dict[type[TrimsError], str] = {
    NotFound: "{url} does not exist (HTTP {code})",
    PermissionDenied: "{url} refused access (HTTP {code}); check the URL's access",
    Unavailable: "{url} answered HTTP {code} {reason}; try again later",
}


def _http_status_error(url: str, e: urllib.error.HTTPError) -> TrimsError:
    """The refusal as :func:`trims.errors.error_for_status` reads the status."""
    if 300 <= e.code < 400:
        return ValidationError(f"{url} answered HTTP {e.code} without a Location to follow")
    cls = error_for_status(e.code)
    message = _HTTP_MESSAGES.get(cls, "{url} answered HTTP {code} {reason}")
    return cls(message.format(url=url, code=e.code, reason=e.reason))


def _fetch_http(
    url: str, f: IO[bytes], sink_args: dict[str, Any], stall_timeout: float, deadline: float
) -> _Sink:
    shown = redact(url)
    if not split(url).hostname:
        raise ValidationError(f"{url!r} names no host; use http(s)://HOST/PATH")
    sink: _Sink | None = None
    with _Watchdog(deadline) as watchdog:
        opener = urllib.request.build_opener(
            _LimitedRedirects, _WatchedHTTP(watchdog), _WatchedHTTPS(watchdog)
        )
        request = urllib.request.Request(url, headers={"User-Agent": "trims"})
        try:
            with opener.open(request, timeout=stall_timeout) as resp:
                length = resp.headers.get("Content-Length")
                total = int(length) if length is not None and length.isdigit() else None
                sink = _Sink(f, shown, total=total, **sink_args)
                while chunk := resp.read(CHUNK):
                    sink.write(chunk)
        except urllib.error.HTTPError as e:
            with e:
                raise _http_status_error(shown, e) from e
        except TrimsError:
            raise
        except Exception as e:
            if watchdog.fired:
                raise _deadline_error(shown, deadline, sink.done if sink else 0) from e
            error = _http_transport_error(shown, stall_timeout, e)
            if error is e:
                raise
            raise error from e
        if watchdog.fired:
            raise _deadline_error(shown, deadline, sink.done)
    sink.check_complete()
    return sink


def _http_transport_error(url: str, stall_timeout: float, e: Exception) -> Exception:
    """The trims error for an exception of urllib/http.client (others pass unchanged)."""
    if isinstance(e, http.client.IncompleteRead):
        return CorruptModel(
            f"download of {url} ended early ({len(e.partial)} bytes in the last read, "
            f"{e.expected} missing): connection cut; try again"
        )
    if isinstance(e, TimeoutError):
        return Unavailable(
            f"download of {url} stalled: no byte for {_seconds(stall_timeout)} s (the stall "
            "timeout); try again later or raise --download-stall-timeout"
        )
    if isinstance(e, urllib.error.URLError):
        return Unavailable(f"cannot reach {url}: {e.reason}; check the URL and network")
    if isinstance(e, ConnectionError | http.client.HTTPException):
        return Unavailable(f"download of {url} failed: {e!r}; try again")
    return e


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
        # S3's error codes where its status is not the whole story.
        if code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
            status = 404
        elif code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            status = 403
        elif code in ("SlowDown", "ServiceUnavailable", "InternalError"):
            status = 503
        cls = error_for_status(status or (int(code) if code.isdigit() else 400))
        if cls is NotFound:
            return NotFound(f"{url} does not exist ({code or status})")
        if cls is PermissionDenied:
            return PermissionDenied(f"{url} refused access ({code}); check the S3 credentials")
        if cls is Unavailable:
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
    url: str,
    f: IO[bytes],
    sink_args: dict[str, Any],
    endpoint: str | None,
    stall_timeout: float,
    deadline: float,
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
        connect_timeout=stall_timeout,
        read_timeout=stall_timeout,
        retries={"max_attempts": 2, "mode": "standard"},
    )
    sink: _Sink | None = None
    with _Watchdog(deadline) as watchdog:
        try:
            client = boto3.client("s3", endpoint_url=endpoint, config=config)
            response = client.get_object(Bucket=bucket, Key=key)
            body = response["Body"]
            # StreamingBody wraps a urllib3 response, whose shutdown() wakes a blocked read.
            raw = getattr(body, "_raw_stream", None)
            if raw is not None and hasattr(raw, "shutdown"):
                watchdog.watch(raw.shutdown)
            with body:
                sink = _Sink(f, shown, total=int(response.get("ContentLength", 0)), **sink_args)
                for chunk in _iter_s3(body):
                    sink.write(chunk)
                    if watchdog.fired:
                        break
        except TrimsError:
            raise
        except Exception as e:
            if watchdog.fired:
                raise _deadline_error(shown, deadline, sink.done if sink else 0) from e
            if isinstance(e, BotoCoreError | ClientError):
                raise _s3_error(shown, e) from e
            if isinstance(e, TimeoutError | ConnectionError | http.client.HTTPException):
                raise Unavailable(f"download of {shown} failed: {e!r}; try again") from e
            raise
        if watchdog.fired:
            raise _deadline_error(shown, deadline, sink.done)
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
    stall_timeout: float = STALL_TIMEOUT,
    deadline: float = DEADLINE,
) -> None:
    """Download ``source`` into the new file ``dest`` (fsynced), or raise and leave no ``dest``.

    ``stall_timeout`` bounds the wait for a connection and for each next byte, ``deadline``
    the whole download (seconds; see Note [download deadline]).
    """
    if not (stall_timeout > 0 and deadline > 0):
        raise ValidationError(
            f"download stall timeout {stall_timeout} and deadline {deadline} must be positive"
        )
    kind = scheme(source)
    if kind not in SCHEMES:
        raise ValidationError(f"unsupported source scheme {kind!r}; use http(s):// or s3://")
    sink_args: dict[str, Any] = {"max_bytes": max_bytes, "progress": progress}
    f = open(dest, "xb")  # noqa: SIM115 - closed by the with below; exists check first
    try:
        with f:
            if kind == "s3":
                sink = _fetch_s3(source, f, sink_args, s3_endpoint, stall_timeout, deadline)
            else:
                sink = _fetch_http(source, f, sink_args, stall_timeout, deadline)
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
