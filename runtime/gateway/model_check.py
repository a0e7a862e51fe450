"""At deploy: every model a function names can be had, so a typo is a 422 now, not a 502 at
the first call.

An instance gets a model from the store by name (and version), else loads its ``source``
directly. A model passes when its source is a URL (fetched later; reachability is not checked
here), a file on this host (a relative path counts from ``code_dir``, where the worker runs), or
when the store daemon the gateway hands its instances already holds it. Otherwise the deploy is
refused, naming the model, the path and what to do. Executors whose files are not on this host
(kubernetes: paths on the node) are not checked.
"""

from __future__ import annotations

from pathlib import Path

from trims.errors import NotFound, TrimsError, ValidationError
from trims.runtime.functions.spec import FunctionSpec, ModelRef

__all__ = ["check_models"]

#: Seconds the store may take to answer whether it holds a model.
STORE_TIMEOUT_S = 5.0


def _source_here(model: ModelRef, code_dir: str | None) -> bool:
    source = model.source
    if source is None:
        return False
    if "://" in source:
        return True
    path = Path(source)
    if not path.is_absolute() and code_dir is not None:
        path = Path(code_dir) / path
    return path.is_file() or path.is_dir()


def check_models(spec: FunctionSpec, store_socket: Path | None) -> None:
    """ValidationError (``models[i]``) for the first model neither the store nor its source
    can give; blocking (a store round trip per such model): call it off the event loop."""
    missing = [(i, m) for i, m in enumerate(spec.models) if not _source_here(m, spec.code_dir)]
    if not missing:
        return
    store_error = None
    try:
        from trims.runtime.client import StoreClient

        with StoreClient(store_socket, timeout=STORE_TIMEOUT_S, client_name="gateway-deploy") as c:
            for i, model in missing:
                try:
                    c.info(model.name, model.version)
                except NotFound:
                    raise _refuse(i, model, "the store holds no such model") from None
        return
    except ValidationError:
        raise
    except (TrimsError, OSError) as e:
        store_error = e.message if isinstance(e, TrimsError) else str(e)
    i, model = missing[0]
    raise _refuse(i, model, f"the store cannot be asked ({store_error})")


def _refuse(index: int, model: ModelRef, why: str) -> ValidationError:
    wanted = model.name + (f" version {model.version}" if model.version else "")
    if model.source is None:
        where = "it names no source"
    else:
        where = f"its source {model.source} is not a file on the gateway's host"
    return ValidationError(
        f"models[{index}]: model {wanted}: {where} and {why}; add the model to the store "
        "(trims models add, or the example's prepare.py) or point source at the model file",
        field=f"models[{index}]",
    )
