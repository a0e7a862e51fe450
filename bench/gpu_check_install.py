"""The GPU check kit's setup: what the device is, and installing what the GPU paths need.

Note [installing on a GPU machine with no index]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
GPU machines are often lent bare and offline, with their own Python that already holds CUDA
builds of torch and CuPy. So nothing here resolves the project's whole dependency tree (that
could replace the machine's numpy or torch): the project goes in editable with ``--no-deps``,
then each module the GPU paths import that is missing is installed by name, first from a
wheelhouse (``WHEELS``, default ``.whl/`` in the repository; ``python bench/gpu_check.py
--fetch-wheels .whl`` fills it on a machine that reaches PyPI), then from the index with a
short timeout. Every failure is reported, never raised: the steps that need the module fail
with their own message.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: import name -> the requirement that provides it, for what the GPU steps import.
MODULES: dict[str, str] = {
    "numpy": "numpy",
    "uvloop": "uvloop",
    "aiohttp": "aiohttp",
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "tqdm": "tqdm",
    "opentelemetry.trace": "opentelemetry-api",
    "opentelemetry.sdk": "opentelemetry-sdk",
    "opentelemetry.semconv": "opentelemetry-semantic-conventions",
    "pytest": "pytest",
    "pytest_asyncio": "pytest-asyncio",
    "pytest_timeout": "pytest-timeout",
    "scipy": "scipy",
    "threadpoolctl": "threadpoolctl",
    "implicit": "implicit",
    "posix_ipc": "posix-ipc",
}
#: Missing these is not a failure: the ALS step then runs without its peer; the gateway's shared
#: memory (posix_ipc) is not on any GPU path.
OPTIONAL = {"implicit", "posix_ipc"}
#: What --fetch-wheels downloads (pure Python, or with wheels for the target Python).
WHEELHOUSE = (
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-semantic-conventions",
    "pytest-asyncio",
    "implicit",
    "posix-ipc",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def sh(cmd: Sequence[str], timeout: float, cwd: Path | None = None) -> tuple[int, str]:
    """(exit status, stdout+stderr); 124 when it ran past ``timeout``, 127 when not found."""
    try:
        p = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=max(1.0, timeout),
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return 124, out + f"\n(timed out after {timeout:.0f} s)"
    except OSError as e:
        return 127, str(e)
    return p.returncode, p.stdout + p.stderr


def detect_device(timeout: float) -> dict[str, Any]:
    """The first NVIDIA device from nvidia-smi; ``{"error": ...}`` when there is none."""
    rc, listing = sh(["nvidia-smi", "-L"], timeout)
    if rc != 0 or "GPU" not in listing:
        return {"error": f"no NVIDIA device: nvidia-smi -L failed ({listing.strip()[:200]})"}
    rc, query = sh(
        [
            "nvidia-smi",
            "--query-gpu=name,uuid,driver_version,memory.total",
            "--format=csv,noheader",
            "-i",
            "0",
        ],
        timeout,
    )
    fields = [f.strip() for f in query.split(",")] if rc == 0 else []
    _, banner = sh(["nvidia-smi"], timeout)
    cuda = re.search(r"CUDA Version:\s*([0-9]+)\.([0-9]+)", banner)
    device: dict[str, Any] = {"list": listing.strip().splitlines()}
    if len(fields) == 4:
        device.update(name=fields[0], uuid=fields[1], driver=fields[2], memory=fields[3])
    if cuda:
        device.update(cuda=f"{cuda.group(1)}.{cuda.group(2)}", cuda_major=int(cuda.group(1)))
    return device


def missing_modules(python: str, names: Sequence[str], timeout: float) -> list[str]:
    code = (
        "import importlib.util, sys\n"
        "def have(n):\n"
        "    try:\n        return importlib.util.find_spec(n) is not None\n"
        "    except ImportError:\n        return False\n"
        "print(' '.join(n for n in sys.argv[1:] if not have(n)))"
    )
    rc, out = sh([python, "-c", code, *names], timeout)
    return out.split() if rc == 0 else list(names)


def pip_install(
    python: str, reqs: Sequence[str], wheels: Path | None, deadline: float, no_deps: bool = False
) -> tuple[bool, str]:
    """Install ``reqs``: from the wheelhouse when there is one, else from the index."""
    base = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input"]
    if no_deps:
        base.append("--no-deps")
    tried = []
    if wheels is not None and wheels.is_dir():
        rc, out = sh(
            [*base, "--no-index", "--find-links", str(wheels), *reqs], deadline - time.monotonic()
        )
        if rc == 0:
            return True, f"from {wheels}"
        tried.append(f"wheelhouse {wheels}: {_last(out)}")
    rc, out = sh([*base, "--timeout", "10", "--retries", "0", *reqs], deadline - time.monotonic())
    if rc == 0:
        return True, "from the index"
    tried.append(f"index: {_last(out)}")
    return False, "; ".join(tried)


def _last(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def project_importable(python: str, repo: Path, timeout: float) -> tuple[bool, str]:
    modules = "trims.daemon.tiers.gpu, trims.runtime.client, trims.kernels.cli"
    code = f"import {modules}; print(trims.__file__)"
    rc, out = sh([python, "-c", code], timeout)
    if rc != 0:
        return False, _last(out)
    where = Path(out.strip().splitlines()[-1]).resolve()
    if repo.resolve() not in where.parents:
        return False, f"trims is imported from {where}, not from {repo}"
    return True, str(where)


def install(
    python: str, repo: Path, device: dict[str, Any], wheels: Path | None, deadline: float
) -> dict[str, Any]:
    """Make the GPU paths importable; ``{"figures", "failed": [...]}`` (what could not)."""
    figures: dict[str, Any] = {}
    failed: list[str] = []

    def left() -> float:
        return deadline - time.monotonic()

    absent = missing_modules(python, list(MODULES), left())
    needed = sorted({MODULES[m] for m in absent})
    if needed:
        ok, how = pip_install(python, needed, wheels, deadline, no_deps=True)
        results = {" ".join(needed): how}
        if not ok:  # one bad requirement fails the whole command: try them one by one
            results = {
                r: pip_install(python, [r], wheels, deadline, no_deps=True)[1] for r in needed
            }
        figures["pip"] = results
    still = missing_modules(python, list(MODULES), left())
    for m in still:
        (figures.setdefault("optional_missing", []) if m in OPTIONAL else failed).append(MODULES[m])

    ok, where = project_importable(python, repo, left())
    if not ok:
        rc, out = sh(
            [
                python,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-e",
                str(repo),
            ],
            left(),
        )
        ok, where = project_importable(python, repo, left())
        if not ok:
            failed.append(f"trims ({where}; pip: {_last(out)})")
    figures["trims"] = where if ok else "not importable"

    rc, out = sh(
        [python, "-c", "import cupy; print(cupy.__version__, cupy.cuda.runtime.getDeviceCount())"],
        left(),
    )
    if rc != 0:
        major = int(device.get("cuda_major", 12))
        wheel = f"cupy-cuda{13 if major >= 13 else 12}x[ctk]"  # as pyproject's gpu extras
        got, how = pip_install(python, [wheel], wheels, deadline)
        rc, out = sh(
            [
                python,
                "-c",
                "import cupy; print(cupy.__version__, cupy.cuda.runtime.getDeviceCount())",
            ],
            left(),
        )
        if rc != 0:
            failed.append(f"{wheel} ({how if not got else _last(out)})")
    figures["cupy"] = out.strip().splitlines()[-1] if rc == 0 else "not working"
    return {"figures": figures, "failed": failed}


def cudart_dirs(python: str, timeout: float) -> list[str]:
    """Folders holding a CUDA runtime library (libcudart.so*), which the legacy cuda_ipc path
    loads: the toolkit's, and the pip packages' (nvidia-cuda-runtime) of ``python``."""
    roots = [Path(p) for p in ("/usr/local/cuda", "/usr/local/cuda/targets/x86_64-linux")]
    roots += sorted(Path("/usr/local").glob("cuda-*"))
    rc, out = sh([python, "-c", "import site; print(*site.getsitepackages())"], timeout)
    sites = [Path(p) / "nvidia" for p in out.split()] if rc == 0 else []
    found: list[str] = []
    for lib in [p for r in roots for p in r.glob("lib*/libcudart.so*")] + [
        p for s in sites for p in s.glob("**/lib/libcudart.so*")
    ]:
        if str(lib.parent) not in found:
            found.append(str(lib.parent))
    return found


def cuda_torch(python: str, timeout: float) -> tuple[bool, str]:
    """Whether this Python's torch sees a CUDA device, and its version (or why not)."""
    rc, out = sh(
        [python, "-c", "import torch; print(int(torch.cuda.is_available()), torch.__version__)"],
        timeout,
    )
    if rc != 0:
        return False, "torch does not import"
    flag, version = out.strip().splitlines()[-1].split()
    return flag == "1", f"torch {version}"


def index_reachable(python: str, timeout: float) -> bool:
    rc, _ = sh(
        [
            python,
            "-m",
            "pip",
            "index",
            "versions",
            "torch",
            "--timeout",
            "5",
            "--retries",
            "0",
            "--disable-pip-version-check",
        ],
        timeout,
    )
    return rc == 0


def fetch_wheels(folder: Path, python_version: str) -> int:
    """Download the wheelhouse for an offline GPU machine (run where PyPI is reachable)."""
    from importlib.metadata import PackageNotFoundError, version

    reqs = []
    for name in WHEELHOUSE:
        try:
            reqs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            reqs.append(name)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(folder),
        *reqs,
    ]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode
