"""torch's intra-op thread team, made while a fresh instance's first request is on its way.

Note [team before the first request]: torch runs its kernels on an OpenMP team of
``torch.get_num_threads()`` threads, one team per thread that calls into it (libgomp keeps a
pool per master thread). A worker never inherits one (Note [fork safety] in
:mod:`trims.runtime.executors.zygote`), so the first forward pass of a fresh instance also
created its team and ran every kernel's first call on the new threads: with
``bench/peers.py``'s model (8 x Linear(4096, 4096), one pooled worker, scaled from zero) the
first request took 29.7 ms against 25.4 ms warm (1.17x; medians of 5 runs of 5 starts each,
alternating with the runs below), and in a plain fork of a warmed torch process 21 ms against
17.5 (a 64 x 64 matrix product first: 18.6 ms, the product itself 0.55 ms).

So when a function's code imports torch, the worker runs two small multi-threaded kernels on
the thread that will run the function's synchronous calls (:func:`make_team`), after init: the
team then exists, its threads have run the kernel library's per-thread set-up, and they have
not been idle long. With a concurrency of 1 the product is queued on that single thread while
the worker says it is ready, so it overlaps the ready message and the request's way to the
worker; the request waits behind it on the same thread. With more, the worker waits for it
before saying ready: a request arriving while it ran would start a second pool thread, with
no team. Measured the same way: the first request 28.2 ms against 26.0 warm (1.08x), the
first full response 37.8 ms against 39.0 (lower in 4 of the 5 pairs), the instance start
unchanged (9.6 ms against 9.4).

Not for standbys (Note [standby warm-up] in :mod:`trims.runtime.executors.warmup`): a team made
long before its first request did not help (made at activation, right before it: no
difference measured, 4 alternating runs). A function whose torch use hides in another module
(its handler's module imports no torch) makes its team on its first request, as before.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

#: torch's grain for element-wise kernels (``at::internal::GRAIN_SIZE``): below it per
#: thread, a parallel loop uses fewer threads.
_GRAIN = 32768


def uses_torch(*functions: Callable[..., Any] | None) -> bool:
    """Whether the module of any of ``functions`` has torch, or one of its submodules, in its
    namespace (``import torch``, ``from torch import nn``, ``import torch.nn.functional as F``)."""
    for fn in functions:
        if fn is None:
            continue
        namespace = getattr(inspect.unwrap(fn), "__globals__", None)
        if not isinstance(namespace, dict):
            continue
        for value in namespace.values():
            if isinstance(value, types.ModuleType) and (
                value.__name__ == "torch" or value.__name__.startswith("torch.")
            ):
                return True
    return False


def make_team() -> int:
    """Create this thread's torch intra-op team (Note [team before the first request]); the
    team's size (1: single-threaded, nothing to make).

    A 64 x 64 matrix product runs the BLAS's per-thread set-up; an element-wise fill over
    :data:`_GRAIN` elements per thread asks for every thread (the BLAS may use fewer for a
    small product, and the team would grow on the first larger one)."""
    import torch

    threads = int(torch.get_num_threads())
    if threads > 1:
        with torch.inference_mode():
            torch.mm(torch.zeros(64, 64), torch.zeros(64, 64))
            torch.empty(threads * _GRAIN).fill_(1.0)
    return threads
