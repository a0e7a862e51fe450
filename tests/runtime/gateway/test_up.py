"""`trims up --examples`: daemon + gateway + examples, stopped cleanly by SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.fixtures.gateway import PRELOAD, pid_alive, wait_until
from tests.fixtures.net import free_port
from trims.runtime.functions_cli import GatewayClient

REPO_EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

PREPARE = """
import sys
from pathlib import Path
assert sys.argv[1] == "--socket" and Path(sys.argv[2]).is_socket(), sys.argv
(Path(__file__).parent / "prepared.txt").write_text("weights ready")
"""
HANDLER = """
from pathlib import Path
def handler(request, ctx):
    return (Path(__file__).parent / "prepared.txt").read_text()
"""


def _examples(root: Path) -> Path:
    """The echo example, one whose prepare.py works and one whose prepare.py fails."""
    shutil.copytree(REPO_EXAMPLES / "echo", root / "echo")
    for name, prepare in (("prepared", PREPARE), ("broken", "raise SystemExit('no weights')")):
        (root / name).mkdir()
        (root / name / "prepare.py").write_text(prepare)
        (root / name / "handler.py").write_text(HANDLER)
        (root / name / "function.yaml").write_text(f"name: {name}\nhandler: handler:handler\n")
    # One that needs a Python environment this gateway does not declare (as mxnet_digits does).
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "handler.py").write_text(HANDLER)
    (root / "elsewhere" / "function.yaml").write_text(
        "name: elsewhere\nhandler: handler:handler\nenvironment: mxnet\n"
    )
    return root


def test_up_serves_the_echo_example_and_stops_everything(tmp_path):
    log = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
    env["TRIMS_RUNTIME_DIR"] = str(tmp_path / "run")
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    examples = _examples(tmp_path / "examples")
    metrics_port = free_port()
    cmd = [
        sys.executable, "-m", "trims", "up", "--examples", "--port", "0",
        "--examples-dir", str(examples),
        "--store-dir", str(tmp_path / "store"), "--preload", ",".join(PRELOAD),
        "--daemon-metrics-address", f"127.0.0.1:{metrics_port}",
    ]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env)
    try:
        assert wait_until(lambda: "trims gateway ready url=" in log.read_text(), 90), (
            log.read_text()
        )
        text = log.read_text()
        url = re.search(r"trims gateway ready url=(\S+)", text).group(1)
        daemon_pid = int(re.search(r"store daemon started \(pid (\d+)", text).group(1))
        assert f"curl -d hello {url}/v1/functions/echo/invoke" in text
        # Not the default address: the banner says how to point the CLI at it.
        assert f"export TRIMS_GATEWAY_URL={url}" in text and f"{url}/ui/" in text
        # Deploying the examples used the generated admin token; invoking needs none.
        token_file = tmp_path / "state" / "trims" / "gateway" / "auth" / "admin-token"
        assert f"admin token in {token_file}" in text
        client = GatewayClient(url, None)
        status, _, body = client.request("POST", "/v1/functions/echo/invoke", b"hello")
        assert (status, body) == (200, b"hello")
        status, _, _ = client.request("DELETE", "/v1/functions/echo")
        assert status == 401
        status, _, body = client.request("POST", "/v1/functions/prepared/invoke", b"")
        assert (status, body) == (200, b"weights ready")
        assert "example broken skipped: prepare.py exited 1: no weights" in text
        assert "functions      echo, prepared\n" in text
        assert "example elsewhere not deployed" in text
        assert "environment 'mxnet' is not declared" in text
        # The daemon serves its metrics where `trims up --daemon-metrics-address` said.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
            assert b"trims_connections" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not pid_alive(daemon_pid), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
