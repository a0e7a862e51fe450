"""The top-level CLI: fast help without heavy imports, clear errors for unknown commands."""

from __future__ import annotations

import subprocess
import sys


def _trims(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trims", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_command_and_imports_no_framework() -> None:
    code = (
        "import sys; from trims.cli import main, COMMANDS\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = {'torch', 'onnxruntime', 'mxnet', 'cupy', 'docker', 'kubernetes', 'onnx'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    for name in ("daemon", "models", "up", "gateway", "analyze", "kernels"):
        assert name in out.stdout


def test_unknown_command_says_what_exists() -> None:
    out = _trims("frobnicate")
    assert out.returncode == 2
    assert "unknown command 'frobnicate'" in out.stderr
    assert "daemon" in out.stderr


def test_version() -> None:
    out = _trims("--version")
    assert out.returncode == 0
    assert out.stdout.startswith("trims ")
