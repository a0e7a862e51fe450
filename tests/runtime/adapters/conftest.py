"""A model buffer built in the test: canonical layout in a sealed memfd, mapped by HostMapping.

This is exactly what the daemon's CPU tier hands out, so adapters are tested on the real
mapping without a daemon; tests/runtime/test_client.py covers the same path through one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from trims.layout import Manifest, TensorSpec, plan
from trims.runtime.adapters.numpy import numpy_dtype
from trims.runtime.mapping import HostMapping

SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


def sealed_model(
    arrays: dict[str, np.ndarray[Any, Any]],
    *,
    name: str = "test-model",
    framework: str = "numpy",
    dtypes: dict[str, str] | None = None,
    metadata: dict[str, str] | None = None,
) -> HostMapping:
    """Lay ``arrays`` out canonically in a sealed memfd and map it (the fd is closed)."""
    dtypes = dtypes or {}
    specs = [TensorSpec(n, dtypes.get(n, str(a.dtype)), tuple(a.shape)) for n, a in arrays.items()]
    entries, total = plan(specs)
    buf = bytearray(total)
    for e in entries:
        data = np.ascontiguousarray(arrays[e.name]).view(numpy_dtype(e.dtype))
        buf[e.offset : e.offset + e.nbytes] = data.tobytes()
    manifest = Manifest(
        name=name,
        version="1",
        digest=hashlib.sha256(buf).hexdigest(),
        framework=framework,
        total_bytes=total,
        tensors=entries,
        metadata=metadata or {},
    )
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        os.pwrite(fd, bytes(buf), 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return HostMapping.from_fd(fd, total, manifest)


@pytest.fixture
def make_model() -> Iterator[Callable[..., HostMapping]]:
    made: list[HostMapping] = []

    def make(arrays: dict[str, np.ndarray[Any, Any]], **kwargs: Any) -> HostMapping:
        mapping = sealed_model(arrays, **kwargs)
        made.append(mapping)
        return mapping

    yield make
    for mapping in made:
        mapping.close()
