"""What ``trims trace MODEL`` may name, and how a manifest becomes a workload source.

Besides the names :mod:`trims.evaluation.tracing.workload` knows (zoo names, ``torch:<arch>``,
``example:resnet50``, ``.onnx`` paths), MODEL may be an evaluation manifest: the name of a
shipped one (``trims evaluate manifests``) or a ``.yaml`` path. The manifest's model source
decides what is traced: a ``torch:<arch>`` or ``example:`` builder is that model, an ONNX file
(a local or ``package:`` path, checked against its sha256) or a ``prepare:`` builder's ONNX
output is that file. A manifest whose model is neither (a URL not yet in the store, a torch
state dict) is refused with the reason.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from trims.errors import ValidationError

__all__ = ["resolve_model"]

#: builders whose name the workload takes as it is
_WORKLOAD_BUILDERS = ("torch:", "example:")


def _manifest_path(model: str) -> Path | None:
    from trims.evaluation.harness.manifest import shipped_manifest_paths

    if model.endswith((".yaml", ".yml")):
        return Path(model)
    return next((p for p in shipped_manifest_paths() if p.stem == model), None)


def resolve_model(model: str, work_dir: Path | None = None) -> str:
    """The workload source for ``model``: itself, or what its manifest names (see above).

    ``work_dir`` receives files a ``prepare:`` builder makes (a temporary folder by default).
    """
    path = _manifest_path(model)
    if path is None:
        return model
    from trims.evaluation.harness.manifest import load_manifest

    manifest = load_manifest(path, check_dataset=False)
    source = manifest.model.sources[0]
    if source.builder is not None and source.builder.startswith(_WORKLOAD_BUILDERS):
        return source.builder
    if manifest.model.format == "onnx":
        from trims.evaluation.harness.manifest_run import manifest_model_file

        folder = work_dir or Path(tempfile.mkdtemp(prefix="trims-trace-"))
        return str(manifest_model_file(manifest, folder))
    raise ValidationError(
        f"model: manifest {manifest.name} names {source.describe()} ({manifest.model.format}); "
        "trims trace runs ONNX files, torch:<arch> and example: builders: trace the ONNX "
        "variant of this model or its .onnx file",
        field="model",
    )
