"""Loading a model straight from its file with the framework's own loader (no daemon).

The fallback of :func:`trims.runtime.models.open_model` when no store is reachable: the same
methods as a store-backed model, each returning what the framework's usual loader gives, so
function code runs unchanged. Every process then holds its own copy; nothing is shared.
Formats: safetensors, PyTorch state dicts (``weights_only=True``: no code runs), ONNX, MXNet
``.params``; chosen by ``fmt`` or the file's suffix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from trims.errors import CorruptModel, NotFound, ValidationError
from trims.layout import MODEL_FORMATS, format_from_suffix
from trims.runtime.model_base import ModelBase

log = logging.getLogger(__name__)


def detect_format(path: Path) -> str:
    fmt = format_from_suffix(path.name)
    if fmt is None:
        raise ValidationError(
            f"cannot tell the format of {path.name}: name it *.safetensors, *.pt, *.pth, "
            "*.onnx or *.params, or pass fmt="
        )
    return fmt


class DirectModel(ModelBase):
    """A model file loaded in this process; methods mirror :class:`StoreModel`."""

    via = "direct"

    def __init__(self, name: str, source: str | Path, fmt: str | None = None) -> None:
        path = Path(source).expanduser()
        if "://" in str(source):
            raise ValidationError(
                f"model {name}: the store is not reachable and {source} is remote; start "
                "`trims daemon` (it downloads and caches it) or pass a local file"
            )
        if not path.is_file():
            raise NotFound(f"model {name}: source file {path} does not exist")
        self.name = name
        self.path = path
        self.format = fmt or detect_format(path)
        if self.format not in MODEL_FORMATS:
            raise ValidationError(f"model {name}: unknown format {self.format!r}")

    def _fail(self, e: Exception) -> CorruptModel:
        return CorruptModel(f"model {self.name}: cannot load {self.path} as {self.format}: {e}")

    @cached_property
    def _torch_state(self) -> dict[str, Any]:
        import torch

        try:
            if self.format == "safetensors":
                from safetensors.torch import load_file

                return dict(load_file(str(self.path)))
            if self.format == "torch":
                state = torch.load(self.path, map_location="cpu", weights_only=True)
                if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
                    state = state["state_dict"]
                if not isinstance(state, Mapping):
                    raise ValidationError(f"{self.path} holds a {type(state).__name__}")
                return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        except (OSError, RuntimeError, ValueError) as e:
            raise self._fail(e) from e
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.numpy().items()}

    def numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        """Each tensor as a NumPy array (bfloat16 as its uint16 bits, as from the store)."""
        if self.format == "safetensors":
            from safetensors.numpy import load_file

            try:
                return dict(load_file(str(self.path)))
            except TypeError:
                pass  # bfloat16, which NumPy lacks: read through torch below
            except (OSError, ValueError) as e:
                raise self._fail(e) from e
        if self.format in ("safetensors", "torch"):
            import torch

            return {
                k: (v.view(torch.uint16) if v.dtype == torch.bfloat16 else v).numpy()
                for k, v in self._torch_state.items()
            }
        if self.format == "onnx":
            import onnx
            from onnx import numpy_helper

            try:
                model = onnx.load(str(self.path))
            except Exception as e:
                raise self._fail(e) from e
            return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        return {k: v.asnumpy() for k, v in self.mxnet().items()}

    def torch(self) -> dict[str, Any]:
        return dict(self._torch_state)

    def onnx_session(
        self,
        *,
        providers: Sequence[str] | None = None,
        sess_options: Any = None,
        prepack: bool = True,
    ) -> Any:
        import onnxruntime as ort

        if self.format != "onnx":
            raise ValidationError(f"model {self.name} is {self.format}, not ONNX")
        from trims.runtime.adapters.onnxruntime import SharedSession

        options = sess_options or ort.SessionOptions()
        if not prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        chosen = list(providers or ["CPUExecutionProvider"])
        session = ort.InferenceSession(str(self.path), options, providers=chosen)
        # A SharedSession with no shared initializers, so traced calls profile (Note
        # [Profiled twins] in trims.runtime.adapters.onnxruntime) as on the store path.
        return SharedSession(
            session, {}, model=self.name, source=str(self.path), options=options, providers=chosen
        )

    def onnx_model(self) -> Any:
        """The ONNX file as an ``onnx.ModelProto``, external data loaded (see
        :meth:`trims.runtime.models.StoreModel.onnx_model`)."""
        import onnx

        if self.format != "onnx":
            raise ValidationError(f"model {self.name} is {self.format}, not ONNX")
        try:
            return onnx.load(str(self.path))
        except Exception as e:
            raise self._fail(e) from e

    def mxnet(self) -> dict[str, Any]:
        import mxnet as mx

        if self.format != "mxnet":
            return {k: mx.nd.array(v, dtype=v.dtype) for k, v in self.numpy().items()}
        try:
            return dict(mx.nd.load(str(self.path)))
        except mx.base.MXNetError as e:
            raise self._fail(e) from e

    def mxnet_executor(self, symbol: Any, input_shapes: Mapping[str, tuple[int, ...]]) -> Any:
        from trims.runtime.adapters import mxnet as mx_adapter

        return mx_adapter.bind(symbol, self.mxnet(), input_shapes)

    def close(self) -> None:
        self.__dict__.pop("_torch_state", None)
