"""Lazy access to CuPy: the GPU paths import it here and nowhere at module import time."""

from __future__ import annotations

import logging
from functools import cache
from types import ModuleType

from trims.errors import RequestError

log = logging.getLogger(__name__)

#: The one message every study gives when its GPU path cannot run.
UNAVAILABLE = (
    "CuPy/CUDA not available: install CuPy for the driver's CUDA (pip install 'trims[gpu]' for "
    "CUDA 12, 'trims[gpu13]' for CUDA 13; nvidia-smi names it) and run on a "
    "machine with an NVIDIA GPU and driver, or choose the numpy backend"
)


@cache
def _probe() -> tuple[ModuleType | None, str]:
    try:
        import cupy
    except ImportError as e:
        return None, f"{UNAVAILABLE} (import cupy failed: {e})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError when there is no driver or device
        return None, f"{UNAVAILABLE} ({type(e).__name__}: {e})"
    if count < 1:
        return None, f"{UNAVAILABLE} (no CUDA device found)"
    return cupy, ""


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return _probe()[0] is not None


def unavailable_reason() -> str:
    """Why the GPU path cannot run here ('' when it can)."""
    return _probe()[1]


def require_cupy() -> ModuleType:
    """The cupy module, or a RequestError saying how to get a working GPU path."""
    cp, reason = _probe()
    if cp is None:
        log.info("GPU path refused: %s", reason)
        raise RequestError(reason)
    return cp
