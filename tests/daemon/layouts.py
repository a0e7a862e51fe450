"""Disk-tier blobs for the tier tests: a committed layout of one tensor."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trims.daemon.formats.writer import LayoutWriter
from trims.daemon.tiers.disk import DiskTier
from trims.layout import Manifest, TensorSpec


def committed_blob(root: Path, w: np.ndarray) -> tuple[Path, Manifest]:
    """A disk tier under ``root`` holding ``w`` as tensor "w" of model m:1; (blob, manifest)."""
    disk = DiskTier(root, 1 << 30)
    temp = disk.new_temp()
    with LayoutWriter(temp, source=Path("test")) as writer:
        writer.add(TensorSpec("w", str(w.dtype), w.shape), [w.tobytes()])
        manifest: Manifest = writer.finish(name="m", version="1", framework="test", metadata={})
    disk.commit(temp, manifest)
    return disk.path(manifest.digest), manifest
