"""A model converts without two full copies of it in memory (a 1-4 GB model must fit).

Measured in a fresh process: the peak RSS while converting (the kernel's high-water mark, reset
just before) minus the RSS before. Pages of the mmapped source count once (they are the page
cache's, not a copy); a converter that also materialized the tensors would add a second model's
worth.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SIZE = 64 << 20

MEASURE = """
import sys
from pathlib import Path
if sys.argv[1].endswith(".pt"):
    import torch
from trims.daemon.formats import convert
def kib(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
Path("/proc/self/clear_refs").write_text("5")
before = kib("VmRSS")
convert(Path(sys.argv[1]), Path(sys.argv[2]), name="big", version="1")
print((kib("VmHWM") - before) * 1024)
"""


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_peak_memory_is_below_two_copies(tmp_path: Path, suffix: str) -> None:
    tensors = {f"layer{i}": torch.randn(SIZE // 4 // 16) for i in range(16)}
    source = tmp_path / f"big{suffix}"
    if suffix == ".pt":
        torch.save(tensors, source)
    else:
        pytest.importorskip("safetensors.torch").save_file(tensors, source)
    del tensors
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(source), str(tmp_path / "out")],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    grown = int(result.stdout.strip().splitlines()[-1])
    assert grown < 1.5 * SIZE, f"converting {SIZE >> 20} MiB grew the process by {grown >> 20} MiB"
    assert (tmp_path / "out").stat().st_size >= SIZE
