"""What every model handle (from the store or loaded directly) does the same way."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Self


class ModelBase:
    """Builds torch modules from :meth:`torch` and closes on leaving a ``with`` block.

    Subclasses provide ``torch()`` (name -> tensor) and ``close()``.
    """

    def torch(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def populate(self) -> str | None:
        """Fill this process's page tables for the weights now (a standby's prepare); how, or
        None where there is nothing mapped to fill (the default: weights this process read)."""
        return None

    def torch_module(self, build: Callable[[], Any] | Any, *, strict: bool = True) -> Any:
        from trims.runtime.adapters import torch as torch_adapter

        return torch_adapter.load_module(build, self.torch(), strict=strict)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
