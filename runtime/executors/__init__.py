"""Executors start and stop function instances; each sits behind the interface in ``base``.

Resolved lazily by name, so using the local executor never imports docker or kubernetes.
"""

from __future__ import annotations

import importlib
from typing import Any

from trims.errors import ValidationError

#: executor name -> "module:factory"; the factory takes keyword options and returns an Executor.
EXECUTORS: dict[str, str] = {
    "local": "trims.runtime.executors.local:LocalExecutor",
    "docker": "trims.runtime.executors.docker:DockerExecutor",
    "kubernetes": "trims.runtime.executors.kubernetes:KubernetesExecutor",
}


def create_executor(name: str, **options: Any) -> Any:
    """Import the executor ``name`` and build it with ``options``."""
    target = EXECUTORS.get(name)
    if target is None:
        raise ValidationError(f"unknown executor {name!r}; choose from {', '.join(EXECUTORS)}")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValidationError(f"executor {name!r} is unavailable: {e}") from e
    return getattr(module, attr)(**options)
