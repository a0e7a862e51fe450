"""Ingest: a local path or URL -> (fetch) -> convert into the canonical layout -> disk tier.

Every intermediate file lives under the disk tier's ``tmp/`` and is removed whatever happens;
the only thing an ingest leaves behind is a committed, verified layout.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trims.config import format_size
from trims.daemon.formats import FORMATS, convert, detect_format
from trims.daemon.tiers import cloud
from trims.daemon.tiers.disk import DiskTier
from trims.errors import CorruptModel, PayloadTooLarge, Timeout, ValidationError
from trims.layout import Manifest, sha256_stream, validate_digest, validate_model_name
from trims.layout import validate_version as _validate_version
from trims.protocol import Progress

log = logging.getLogger(__name__)

#: Longest source string accepted (a URL or a path).
MAX_SOURCE = 4096


@dataclass(frozen=True)
class DownloadLimits:
    """How long the downloads of one ingest may take (seconds; see cloud.fetch)."""

    #: No byte for this long (connecting included) fails the download.
    stall_timeout: float = cloud.STALL_TIMEOUT
    #: The model and its external data files together must arrive within this.
    deadline: float = cloud.DEADLINE

    def __post_init__(self) -> None:
        if not (self.stall_timeout > 0 and self.deadline > 0):
            raise ValidationError(
                f"download stall timeout {self.stall_timeout} s and deadline {self.deadline} s "
                "must be positive"
            )


class _Clock:
    """The time left of one ingest's download deadline."""

    def __init__(self, limits: DownloadLimits) -> None:
        self.limits = limits
        self._end = time.monotonic() + limits.deadline

    def left(self, url: str) -> float:
        left = self._end - time.monotonic()
        if left <= 0:
            raise Timeout(
                f"downloads for {cloud.redact(url)} did not finish within their deadline of "
                f"{self.limits.deadline:g} s; try again later or raise --download-deadline"
            )
        return left


def _local_source(source: str, expected_sha256: str | None, max_bytes: int) -> Path:
    path = Path(source)
    if not path.is_file():
        raise ValidationError(f"model source {source} does not exist or is not a regular file")
    size = path.stat().st_size
    if size > max_bytes:
        raise PayloadTooLarge(
            f"model source {source} is {format_size(size)}, over the limit of "
            f"{format_size(max_bytes)}",
            size=size,
            limit=max_bytes,
        )
    if expected_sha256 is not None:
        with open(path, "rb") as f:
            actual = sha256_stream(f, size)
        if actual != expected_sha256:
            raise CorruptModel(f"model source {source} has sha256 {actual}, not {expected_sha256}")
    return path


def _fetch_external_data(
    source: str,
    model: Path,
    s3_endpoint: str | None,
    progress: Progress | None,
    max_bytes: int,
    clock: _Clock,
) -> None:
    """Fetch the external data files a remote ONNX model names from beside it.

    They land next to ``model`` under the names the model uses, so conversion reads them as
    it reads a local model's. ``max_bytes`` bounds the model and its data together.
    """
    from trims.daemon.formats.onnx_fmt import external_locations

    left = max_bytes - model.stat().st_size
    for location in external_locations(model):
        dest = model.parent / location
        if dest == model:
            raise ValidationError(
                f"{cloud.redact(source)} names itself ({location!r}) as its external data"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        url = cloud.sibling(source, location)
        cloud.fetch(
            url,
            dest,
            s3_endpoint=s3_endpoint,
            expected_sha256=None,
            progress=progress,
            max_bytes=left,
            stall_timeout=clock.limits.stall_timeout,
            deadline=clock.left(url),
        )
        left -= dest.stat().st_size


def _check_source(source: object) -> str:
    if not isinstance(source, str) or not source or len(source) > MAX_SOURCE or "\0" in source:
        raise ValidationError(
            f"model source must be a path or an http(s)/s3 URL of at most {MAX_SOURCE} characters"
        )
    if "://" in source and not cloud.is_remote(source):
        raise ValidationError(
            f"unsupported source scheme {cloud.scheme(source)!r}; use http(s):// or s3://"
        )
    return source


def ingest(
    source: str,
    *,
    name: str,
    version: str,
    fmt: str | None,
    expected_sha256: str | None,
    disk: DiskTier,
    s3_endpoint: str | None,
    progress: Progress | None,
    max_bytes: int,
    make_room: Callable[[int], None] | None = None,
    limits: DownloadLimits | None = None,
) -> Manifest:
    """Bring ``source`` into the disk tier as model ``name:version``; return its manifest.

    ``expected_sha256`` is the digest of the source file (not of the layout). ``make_room``,
    when given, is called with the layout's size before it is committed, so the caller can
    evict to fit its disk budget. ``limits`` bounds the time of a remote source's downloads
    (the model and its external data together). Raises ValidationError, NotFound, Unavailable,
    Timeout, CorruptModel, PayloadTooLarge or ResourceExhausted; on any of them no file of this
    ingest remains.
    """
    validate_model_name(name)
    _validate_version(version)
    _check_source(source)
    if fmt is not None and fmt not in FORMATS:
        raise ValidationError(f"unknown model format {fmt!r}; use one of {', '.join(FORMATS)}")
    if expected_sha256 is not None:
        expected_sha256 = validate_digest(expected_sha256.lower())
    work: Path | None = None
    layout = disk.new_temp()
    try:
        if cloud.is_remote(source):
            work = disk.new_temp()
            work.mkdir()
            filename = Path(cloud.split(source).path).name
            if filename in ("", ".", ".."):
                filename = "model"
            local = work / filename
            clock = _Clock(limits or DownloadLimits())
            cloud.fetch(
                source,
                local,
                s3_endpoint=s3_endpoint,
                expected_sha256=expected_sha256,
                progress=progress,
                max_bytes=max_bytes,
                stall_timeout=clock.limits.stall_timeout,
                deadline=clock.left(source),
            )
            if fmt is None:
                fmt = detect_format(local, filename=filename)
            if fmt == "onnx":
                _fetch_external_data(source, local, s3_endpoint, progress, max_bytes, clock)
        else:
            local = _local_source(source, expected_sha256, max_bytes)
        manifest: Manifest = convert(
            local, layout, name=name, version=version, fmt=fmt, progress=progress
        )
        if make_room is not None and not disk.contains(manifest.digest):
            make_room(manifest.total_bytes)
        disk.commit(layout, manifest, progress)
    finally:
        layout.unlink(missing_ok=True)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    log.info(
        "model %s:%s ingested from %s as layout %s",
        name,
        version,
        source if not cloud.is_remote(source) else cloud.redact(source),
        manifest.digest[:12],
    )
    return manifest
