"""The libc memory calls the ``mmap`` module does not offer on an address: ``madvise``, ``mmap``,
``munmap`` and ``mlock`` through ctypes (which releases the GIL while they run), for the daemon's
page-cache copies and the workers' populate (the daemon and the runtime share only this floor).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from typing import Any

#: ``MADV_POPULATE_READ`` (Linux 5.14+); Python's ``mmap`` module names it from 3.13 on.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: What ``mmap`` returns on failure.
MAP_FAILED = ctypes.c_void_p(-1).value


@functools.cache
def libc() -> Any:
    """The C library with ``mmap``, ``munmap``, ``mlock`` and ``madvise`` typed; errors are
    read with ``ctypes.get_errno()``."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]  # fmt: skip
    lib.mmap.restype = ctypes.c_void_p
    for name in ("munmap", "mlock"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        getattr(lib, name).restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    return lib
