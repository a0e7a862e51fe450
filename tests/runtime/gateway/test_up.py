"""`trims up --examples`: daemon + gateway + examples, stopped cleanly by SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

from trims.runtime.functions_cli import GatewayClient

from tests.runtime.gateway.conftest import PRELOAD, pid_alive, wait_until


def test_up_serves_the_echo_example_and_stops_everything(tmp_path):
    log = tmp_path / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
    env["TRIMS_RUNTIME_DIR"] = str(tmp_path / "run")
    cmd = [
        sys.executable, "-m", "trims", "up", "--examples", "--port", "0",
        "--store-dir", str(tmp_path / "store"), "--preload", ",".join(PRELOAD),
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
        client = GatewayClient(url, None)
        status, _, body = client.request("POST", "/v1/functions/echo/invoke", b"hello")
        assert (status, body) == (200, b"hello")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not pid_alive(daemon_pid), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
