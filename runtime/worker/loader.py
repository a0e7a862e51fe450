"""Import a function's code: ``module:function`` from its code_dir, plus ``init`` and ``infer``."""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trims.errors import ValidationError
from trims.runtime.functions.spec import FunctionSpec


@dataclass(frozen=True)
class FunctionCode:
    handler: Callable[..., Any]
    init: Callable[..., Any] | None
    infer: Callable[..., Any] | None

    @property
    def handler_is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.handler)

    @property
    def infer_is_async(self) -> bool:
        return self.infer is not None and inspect.iscoroutinefunction(self.infer)


def load_code(spec: FunctionSpec) -> FunctionCode:
    """Import the handler module; ValidationError naming what is missing or broken."""
    if spec.handler is None:
        raise ValidationError(f"function {spec.name} has no handler ('module:function') to run")
    module_name, _, attr = spec.handler.partition(":")
    if spec.code_dir and spec.code_dir not in sys.path:
        sys.path.insert(0, spec.code_dir)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        where = f" from {spec.code_dir}" if spec.code_dir else ""
        raise ValidationError(
            f"cannot import handler module {module_name!r}{where}: {e}", field="handler"
        ) from e
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise ValidationError(
            f"handler module {module_name!r} has no function {attr!r}", field="handler"
        )
    init = getattr(module, "init", None)
    infer = getattr(module, "infer", None)
    if spec.serves is not None and not callable(infer):
        raise ValidationError(
            f"function {spec.name} declares 'serves' but module {module_name!r} defines no "
            "infer(inputs, ctx)",
            field="serves",
        )
    return FunctionCode(
        handler=handler,
        init=init if callable(init) else None,
        infer=infer if callable(infer) else None,
    )
