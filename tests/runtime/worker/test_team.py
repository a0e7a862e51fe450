"""torch's thread team made before a fresh instance's first request (runtime/worker/team.py)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fixtures.workers import connect_worker, free_port
from trims.runtime.wire import Kind
from trims.runtime.worker.client import raise_for_error
from trims.runtime.worker.team import uses_torch

pytest.importorskip("torch")

# The handler counts the process's threads around a parallel kernel: with the team made ahead,
# its first call starts none.
COUNTS_THREADS = """
import os
import torch

def _threads():
    return len(os.listdir("/proc/self/task"))

def handler(request, ctx):
    before = _threads()
    x = torch.empty(torch.get_num_threads() * 65536).fill_(2.0)
    return {"threads": torch.get_num_threads(), "started": _threads() - before,
            "sum": float(x.sum())}
"""


def _module(tmp_path: Path, name: str, source: str) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "imports", ["import torch", "from torch import nn", "import torch.nn.functional as F"]
)
def test_a_handler_whose_module_imports_torch_uses_it(tmp_path: Path, imports: str) -> None:
    module = _module(tmp_path, "fn", f"{imports}\ndef handler(request, ctx):\n    return 1\n")
    assert uses_torch(module.handler)
    assert uses_torch(None, module.handler)


def test_other_functions_do_not(tmp_path: Path) -> None:
    module = _module(
        tmp_path,
        "plain",
        """
        import numpy as np
        torch = "a string is no module"
        def handler(request, ctx):
            return np.zeros(1)
        """,
    )
    assert not uses_torch(module.handler, None)
    assert not uses_torch(functools.partial(module.handler, None))
    assert not uses_torch(len)  # a builtin has no namespace
    assert not uses_torch()


def test_a_decorated_handler_is_seen_through(tmp_path: Path) -> None:
    module = _module(tmp_path, "inner", "import torch\ndef handler(request, ctx):\n    return 1\n")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            return fn(*args)

        return wrapper

    assert uses_torch(wrap(module.handler))


@pytest.mark.parametrize(("threads", "started"), [(2, True), (1, False)])
def test_make_team_starts_the_threads_ahead(threads: int, started: bool) -> None:
    probe = textwrap.dedent(
        f"""
        import os, torch
        from trims.runtime.worker.team import make_team
        torch.set_num_threads({threads})
        count = lambda: len(os.listdir("/proc/self/task"))
        before = count()
        size = make_team()
        after_team = count()
        torch.empty({threads} * 65536).fill_(1.0)
        print(size, after_team - before, count() - after_team)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    size, by_team, by_kernel = map(int, out)
    assert size == threads
    assert (by_team > 0) is started
    assert by_kernel == 0  # the team was all a parallel kernel needs


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_a_torch_functions_first_request_finds_its_team(
    tmp_path: Path, concurrency: int
) -> None:
    (tmp_path / "handler.py").write_text(textwrap.dedent(COUNTS_THREADS))
    spec = {
        "name": "team",
        "handler": "handler:handler",
        "code_dir": str(tmp_path),
        "scaling": {"concurrency": concurrency},
    }
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trims", "worker", "--spec-json", json.dumps(spec),
         "--listen", f"tcp:127.0.0.1:{port}", "--instance-id", "team-1"],
        stderr=open(tmp_path / "worker.log", "ab"),  # noqa: SIM115
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    try:
        conn = await connect_worker(f"tcp:127.0.0.1:{port}")
        assert (await conn.hello())["state"] == "ready"
        frame = await conn.request(Kind.INVOKE, None, b"", timeout=60)
        raise_for_error(frame)
        assert json.loads(frame.body) == {"threads": 2, "started": 0, "sum": 2.0 * 2 * 65536}
        conn.close()
    finally:
        proc.kill()
        proc.wait()
