"""The zygote's warm-up: each preloaded framework runs its common kernels once, on one thread.

Note [zygote warm-up]: a worker forked from the zygote inherits its mappings of the frameworks'
shared libraries, but a page of library code is only in the page tables of a process that ran
it. The zygote only imported the frameworks, so the code of their compute kernels (torch's
GEMM, GEMV, convolution and activation kernels: most of libtorch_cpu's 325 MiB of text is
never touched by an import) was mapped by nothing but the workers that ran it. When those exit,
the kernel may evict those pages like any unmapped page cache, and it does under memory
pressure or ``drop_caches``: the next worker's first request then reads them back from disk.
Measured with ``bench/peers.py``'s model (8 x Linear(4096, 4096), a pooled worker), right
after ``drop_caches``: a scale-from-zero's first response 133 ms (instance start 37 ms)
without the warm-up, 66 ms (22 ms) with it; with a warm page cache both about 45 ms. A
long-lived server (MLServer) keeps the pages it ran mapped in its own process. ONNX Runtime is
alike: importing it maps 11 MiB of its library's code, a first session with a convolution 9 MiB
more (and a SqueezeNet after that only 0.2 MiB more); a worker's first request that creates
and runs a SqueezeNet session right after ``drop_caches`` took 51.5 ms without the warm-up and
31-34 ms with it.

The warm-up keeps them mapped in the zygote, which lives as long as the node does: it runs a
few small operations of each framework (linear layers as matrix-vector and matrix-matrix
products, convolutions, pooling, normalisations, activations) on zero tensors; ONNX Runtime
runs a tiny model of the same operators (:data:`ORT_MODEL`). It changes no setting a child
inherits and starts no thread (Note [fork safety] in :mod:`trims.runtime.executors.zygote`):
torch runs it with one intra-op thread (so no OpenMP team is created) and gets its thread count
back afterwards; the ONNX Runtime session has one intra-op and one inter-op thread (the
caller's) and is dropped. A warm-up that fails is logged and skipped: it is an optimisation,
never a reason for the zygote not to start.

Note [standby warm-up]: a standby worker (Note [standby instances] in
:mod:`trims.runtime.gateway.pool`) runs no kernel before its first request. It used to run a
few torch and numpy kernels on its own thread pools while it prepared, so that the OpenMP team
existed before the first request (with spinning OpenMP threads that saved about 3 ms of a
standby's cold start). Since workers wait passively (Note [passive OpenMP threads] in
:mod:`trims.runtime.functions.spec`) it cost far more than it saved: the team's threads then
slept from the warm-up to the first request, and the first two forward passes of
``bench/peers.py``'s model after an activation took 35-47 ms instead of 26-32 (first response
46.6-50.2 ms with the warm-up, 33.9-35.4 ms without, medians of 5 alternating twice). Threads
created by the first request itself run at full speed.
"""

from __future__ import annotations

import base64
import logging
import sys
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)


def _torch() -> None:
    import torch
    import torch.nn.functional as F

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for batch in (1, 8):  # matrix-vector and matrix-matrix kernels
                x, w, b = torch.zeros(batch, 256), torch.zeros(256, 256), torch.zeros(256)
                y = F.relu(F.linear(x, w, b))
                torch.softmax(y, -1)
                F.layer_norm(y, (256,))
                F.gelu(y)
                torch.matmul(x, w)
            image = torch.zeros(1, 8, 16, 16)
            for k in (1, 3):
                F.conv2d(image, torch.zeros(8, 8, k, k), padding=k // 2)
            F.max_pool2d(image, 2)
            F.adaptive_avg_pool2d(image, 1)
            F.batch_norm(image, torch.zeros(8), torch.ones(8))
    finally:
        torch.set_num_threads(threads)


def _numpy() -> None:
    import numpy as np

    x = np.zeros((8, 64), dtype=np.float32)
    w = np.zeros((64, 64), dtype=np.float32)
    y = np.maximum(x @ w, 0.0)
    np.exp(y - y.max(axis=-1, keepdims=True)).sum(axis=-1)
    np.frombuffer(y.tobytes(), dtype=np.float32).astype(np.float64).reshape(8, 64)


#: A tiny ONNX model for ONNX Runtime's warm-up: 3x3 and 1x1 convolutions with bias, ReLU, a
#: residual Add, max and global average pooling, Flatten, Gemm, Softmax; zero weights, input x
#: [1, 4, 8, 8]. Serialized here so that the zygote need not import ``onnx``;
#: tests/runtime/executors/test_warmup.py builds it again with ``onnx.helper`` and compares.
ORT_MODEL = base64.b64decode(
    "CAgSBXRyaW1zOr0ICicKAXgKAnczCgFiEgJjMyIEQ29udioRCgRwYWRzQAFAAUABQAGgAQcKDgoCYzMSAnIzIgRS"
    "ZWx1ChUKAnIzCgJ3MQoBYhICYzEiBENvbnYKDwoCYzEKAXgSAXMiA0FkZAo4CgFzEgFwIgdNYXhQb29sKhUKDGtl"
    "cm5lbF9zaGFwZUACQAKgAQcqEAoHc3RyaWRlc0ACQAKgAQcKGQoBcBIBZyIRR2xvYmFsQXZlcmFnZVBvb2wKDwoB"
    "ZxIBZiIHRmxhdHRlbgoTCgFmCgJmYwoBYhIBaCIER2VtbQoPCgFoEgF5IgdTb2Z0bWF4Eg10cmltcy13YXJtLXVw"
    "KtEECAQIBAgDCAMQAUICdzNKwAQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAqUAgECAQIAQgBEAFCAncxSkAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAKhkIBBABQgFiShAAAAAAAAAAAAAAAAAAAAAAKkwIBAgEEAFCAmZjSkAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAWhsKAXgSFgoU"
    "CAESEAoCCAEKAggECgIICAoCCAhiEwoBeRIOCgwIARIICgIIAQoCCARCBAoAEA0="
)


def _onnxruntime() -> None:
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # the caller's thread only: no pool is created
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    session = ort.InferenceSession(ORT_MODEL, opts, providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.zeros((1, 4, 8, 8), dtype=np.float32)})


#: Framework module -> its warm-up; run only for the frameworks the zygote preloaded.
WARM_UPS: dict[str, Callable[[], None]] = {
    "numpy": _numpy,
    "torch": _torch,
    "onnxruntime": _onnxruntime,
}


def warm_up(preloaded: Sequence[str]) -> list[str]:
    """Run the warm-up of every framework in ``preloaded`` that is imported; the names of those
    that ran. A failure is logged and skipped."""
    done = []
    for name, run in WARM_UPS.items():
        if name not in preloaded or name not in sys.modules:
            continue
        try:
            run()
        except Exception:
            log.warning("zygote warm-up of %s failed; its kernels load on first use", name,
                        exc_info=True)  # fmt: skip
            continue
        done.append(name)
    return done
