"""`trims gateway` as a process: SIGTERM drains, SIGKILL loses nothing that was deployed."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid

import pytest

from tests.fixtures.gateway import echo_spec, pid_alive, wait_until
from trims.runtime.functions_cli import GatewayClient


def test_sigterm_drains_in_flight_requests_then_exits(gateway_process):
    gw = gateway_process()
    client = GatewayClient(gw.url, None, timeout_s=60)
    client.json("PUT", "/v1/functions/echo", echo_spec())
    _, _, pid = client.request("POST", "/v1/functions/echo/invoke", b"pid")
    results: list[tuple[int, bytes]] = []

    def slow() -> None:
        status, _, body = client.request("POST", "/v1/functions/echo/invoke", b"sleep:2")
        results.append((status, body))

    thread = threading.Thread(target=slow)
    thread.start()
    assert wait_until(lambda: client.json("GET", "/v1/functions/echo")["status"]["inflight"] == 1)
    assert gw.proc is not None
    gw.proc.send_signal(15)
    assert wait_until(lambda: client.request("GET", "/readyz")[0] == 503, 10)
    status, _, body = client.request("POST", "/v1/functions/echo/invoke", b"late")
    assert status == 503 and b"shutting down" in body
    thread.join(30)
    assert results == [(200, b"slept")]
    assert gw.terminate() == 0
    assert wait_until(lambda: not pid_alive(int(pid)), 10)
    assert "secret" not in gw.text()


def test_kill_9_then_restart_restores_deployed_functions(gateway_process, tmp_path):
    state = tmp_path / "state"
    tokens = tmp_path / "tokens"
    tokens.write_text("admin-secret-xyz admin\n")
    gw = gateway_process("--state-dir", str(state), "--tokens-file", str(tokens))
    client = GatewayClient(gw.url, "admin-secret-xyz")
    client.json("PUT", "/v1/functions/echo", echo_spec())
    client.json(
        "POST", "/v1/pipelines", {"name": "p", "steps": [{"name": "a", "function": "echo"}]}
    )
    _, _, pid = client.request("POST", "/v1/functions/echo/invoke", b"pid")
    gw.kill()
    assert wait_until(lambda: not pid_alive(int(pid)), 15), "workers must die with the gateway"

    gw = gateway_process("--state-dir", str(state), "--tokens-file", str(tokens))
    client = GatewayClient(gw.url, "admin-secret-xyz")
    assert [f["spec"]["name"] for f in client.json("GET", "/v1/functions")["functions"]] == ["echo"]
    assert client.request("POST", "/v1/pipelines/p/invoke", b"back")[::2] == (200, b"back")
    client.json("PUT", "/v1/functions/echo", echo_spec(concurrency=2))
    status, _, body = client.request("POST", "/v1/functions/echo/invoke", b"again")
    assert (status, body) == (200, b"again")
    assert "admin-secret-xyz" not in gw.text()
    assert gw.terminate() == 0


def test_functions_cli_deploys_lists_invokes_and_removes(gateway_process, tmp_path):
    gw = gateway_process()
    spec_file = tmp_path / "echo.json"
    spec_file.write_text(json.dumps(echo_spec()))

    def cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "trims", "functions", "--url", gw.url, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "deployed" in cli("deploy", str(spec_file))
    assert cli("invoke", "echo", "--data", "hi there") == "hi there\n"
    assert "echo" in cli("ls")
    assert json.loads(cli("get", "echo", "--json"))["spec"]["name"] == "echo"
    assert "deleted" in cli("rm", "echo")
    out = subprocess.run(
        [sys.executable, "-m", "trims", "functions", "--url", gw.url, "invoke", "echo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "no function named 'echo'" in out.stderr
    assert gw.terminate() == 0


def test_spans_are_exported_over_otlp_when_configured(gateway_process):
    import http.server

    received: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        gw = gateway_process("--otlp-endpoint", endpoint)
        client = GatewayClient(gw.url, None)
        client.json("PUT", "/v1/functions/echo", echo_spec())
        assert client.request("POST", "/v1/functions/echo/invoke", b"hi")[0] == 200
        assert gw.terminate() == 0  # exit flushes the batch of spans
    finally:
        server.shutdown()
        server.server_close()
    exported = b"".join(received)
    for name in (b"gateway request", b"queue", b"instance start", b"invoke"):
        assert name in exported


@pytest.mark.docker
def test_kill_9_then_restart_under_the_same_name_removes_the_orphaned_containers(
    gateway_process, docker_client, runtime_image, tmp_path
):
    if runtime_image != "trims-runtime:latest":
        pytest.skip("the gateway process starts the default image trims-runtime:latest")
    name = f"gw-{uuid.uuid4().hex[:8]}"
    owned = {"label": f"org.trims.owner={name}"}
    code = tmp_path / "fn"
    code.mkdir()
    (code / "handler.py").write_text("def handler(request, ctx):\n    return request.text()\n")
    spec = {"name": "echo", "handler": "handler:handler", "code_dir": str(code)}

    try:
        first = gateway_process("--executor", "docker", "--name", name)
        client = GatewayClient(first.url, None, timeout_s=120)
        client.json("PUT", "/v1/functions/echo", spec)
        status, _, body = client.request("POST", "/v1/functions/echo/invoke", b"hi")
        assert (status, body) == (200, b"hi")
        assert len(docker_client.containers.list(filters=owned)) == 1
        first.kill()  # SIGKILL: the executor never closes, its container keeps running
        assert len(docker_client.containers.list(filters=owned)) == 1

        neighbour = gateway_process("--executor", "docker", "--name", f"{name}-other")
        second = gateway_process("--executor", "docker", "--name", name)
        assert wait_until(lambda: not docker_client.containers.list(all=True, filters=owned), 30)
        assert neighbour.terminate() == 0 and second.terminate() == 0
        assert "orphaned trims containers" in second.text()
    finally:  # whatever failed above, no container of this test outlives it
        for prefix in (name, f"{name}-other"):
            for c in docker_client.containers.list(
                all=True, filters={"label": f"org.trims.owner={prefix}"}
            ):
                c.remove(force=True)
