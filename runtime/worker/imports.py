"""What a worker imports before it drops privileges, so it never reads the project's files after.

The project (and the interpreter) may live where the user function code runs as cannot read
them: CI clones the repository under /root (mode 0700), pyenv installs Python there too. A
worker imports every runtime module it may need while it still has its original privileges:
the zygote imports them once before forking (its children inherit them), a spawned worker in
:func:`trims.runtime.worker.runner.run_worker` before :func:`~trims.runtime.worker.sandbox.confine`.
Modules imported later (by function code) must be readable by that user; the local executor
warns at start when they are not (:func:`trims.runtime.worker.access.unreadable_runtime`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

__all__ = ["TRACING_MODULES", "WORKER_MODULES", "preimport"]

#: The worker's own modules, including those it imports lazily (models, adapters, telemetry;
#: the idna codec that binding a TCP address looks up).
WORKER_MODULES = (
    "encodings.idna",
    "numpy",
    "numpy.random",
    "yaml",
    "uvloop",
    "opentelemetry.propagate",
    "trims.telemetry",
    "trims.runtime.functions",
    "trims.runtime.functions.context",
    "trims.runtime.worker.runner",
    "trims.runtime.worker.access",
    "trims.runtime.worker_cli",
    "trims.runtime.client",
    "trims.runtime.models",
    "trims.runtime.adapters.numpy",
    "trims.runtime.adapters.torch",
    "trims.runtime.adapters.onnxruntime",
    "trims.runtime.adapters.mxnet",
    "trims.runtime.adapters.cuda",
    "trims.tracing.levels",
    "trims.tracing.spans",
    "trims.tracing.sources",
    "trims.tracing.sources.torch",
    "trims.tracing.sources.onnxruntime",
    "trims.tracing.active",
    "trims.runtime.worker.tracing",
)

#: What :func:`trims.telemetry.setup_tracing` imports (only when spans are exported).
TRACING_MODULES = (
    "opentelemetry.sdk.resources",
    "opentelemetry.sdk.trace",
    "opentelemetry.sdk.trace.export",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)


def preimport(modules: Sequence[str]) -> list[str]:
    """Import ``modules`` (those not installed are skipped); the names imported."""
    loaded = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        loaded.append(name)
    return loaded
