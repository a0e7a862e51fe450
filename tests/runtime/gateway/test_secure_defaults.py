"""Secure by default: deploying needs the generated admin token; names, code_dir and handler
are checked at deploy; slow or greedy clients cannot hold the gateway's connections."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.fixtures.gateway import ADMIN, FUNCS, echo_spec, wait_until
from tests.fixtures.users import NOBODY, run_as
from trims.errors import ValidationError
from trims.runtime.functions_cli import GatewayClient
from trims.runtime.gateway.admin_token import (
    admin_token_path,
    ensure_admin_token,
    read_token_file,
)


def _token_file(gw: object) -> Path:
    return admin_token_path(gw.state_home / "trims" / "gateway")  # type: ignore[attr-defined]


def _put_as_nobody(url: str, body: bytes) -> int:
    """PUT /v1/functions/x from a forked child running as uid/gid nobody; the HTTP status."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(
                    b"PUT /v1/functions/x HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
            os.write(write, reply)
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        reply = f.read()
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    return int(reply.split(b" ", 2)[1])


def test_default_gateway_refuses_unauthenticated_deploys_and_keeps_its_token(gateway_process):
    gw = gateway_process(auth=True)
    assert "auth=on" in gw.text()
    path = _token_file(gw)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    secret = read_token_file(path)
    assert str(path) in gw.text() and secret not in gw.text()

    anonymous = GatewayClient(gw.url, None)
    body = json.dumps(echo_spec("x")).encode()
    status, headers, reply = anonymous.request("PUT", "/v1/functions/x", body, "application/json")
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert str(path) in json.loads(reply)["error"]["message"]
    assert _put_as_nobody(gw.url, body) == 401
    status, _, _ = anonymous.request("DELETE", "/v1/functions/x")
    assert status == 401
    assert anonymous.json("GET", "/v1/functions") == {"functions": []}

    admin = GatewayClient(gw.url, secret)
    admin.json("PUT", "/v1/functions/echo", echo_spec())
    # Invoking and reading stay anonymous on loopback, so the README's curl examples work.
    assert anonymous.request("POST", "/v1/functions/echo/invoke", b"hi")[::2] == (200, b"hi")

    assert gw.terminate() == 0
    gw.start()
    assert read_token_file(path) == secret
    status, _, _ = GatewayClient(gw.url, secret).request("DELETE", "/v1/functions/echo")
    assert status == 404  # the token is still good; the function was in memory only


def _trims(*args: str, state_home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
    env["XDG_STATE_HOME"] = str(state_home)
    return subprocess.run(
        [sys.executable, "-m", "trims", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_trims_functions_deploy_picks_up_the_token_file(gateway_process, tmp_path):
    gw = gateway_process(auth=True)
    spec = tmp_path / "function.yaml"
    spec.write_text(f"name: echo\nhandler: gwfuncs:handler\ncode_dir: {FUNCS}\n")

    other_user = _trims(
        "functions", "--url", gw.url, "deploy", str(spec), state_home=tmp_path / "elsewhere"
    )
    assert other_user.returncode != 0
    assert "Traceback" not in other_user.stderr
    assert str(_token_file(gw)) in other_user.stderr

    same_user = _trims("functions", "--url", gw.url, "deploy", str(spec), state_home=gw.state_home)
    assert same_user.returncode == 0, same_user.stderr
    assert "function echo deployed" in same_user.stdout

    broken = tmp_path / "broken" / "trims" / "gateway" / "auth"
    broken.mkdir(parents=True)
    (broken / "admin-token").write_text("some-long-secret\n")
    (broken / "admin-token").chmod(0o644)
    unsafe = _trims("functions", "--url", gw.url, "ls", state_home=tmp_path / "broken")
    assert unsafe.returncode != 0 and "Traceback" not in unsafe.stderr
    assert "chmod 600" in unsafe.stderr and len(unsafe.stderr.strip().splitlines()) == 1


def test_no_auth_is_explicit_and_warns(gateway_process):
    gw = gateway_process()  # the fixture passes --no-auth
    assert "auth=off" in gw.text()
    assert "authentication is OFF (--no-auth)" in gw.text()
    GatewayClient(gw.url, None).json("PUT", "/v1/functions/echo", echo_spec())
    assert not (gw.state_home / "trims").exists()


def test_admin_token_is_created_once_privately_and_unsafe_files_are_refused(tmp_path):
    first = ensure_admin_token(tmp_path / "state")
    assert ensure_admin_token(tmp_path / "state").secret == first.secret
    assert "admin" in first.scopes and first.secret not in repr(first)
    path = admin_token_path(tmp_path / "state")
    path.chmod(0o640)
    with pytest.raises(ValidationError, match="chmod 600"):
        ensure_admin_token(tmp_path / "state")
    path.parent.chmod(0o770)
    with pytest.raises(ValidationError, match="mode 0700"):
        ensure_admin_token(tmp_path / "state")
    link_dir = admin_token_path(tmp_path / "linked").parent
    link_dir.mkdir(parents=True, mode=0o700)
    (link_dir / "admin-token").symlink_to(path)
    with pytest.raises(ValidationError, match="cannot read token file"):
        ensure_admin_token(tmp_path / "linked")


@pytest.mark.parametrize("name", ["echo%0A", "echo%0D", "..%2Fx", "a%2Fb", "x" * 64, "Echo"])
async def test_bad_names_in_the_path_create_nothing(start_gateway, tmp_path, name):
    state = tmp_path / "state"
    gw = await start_gateway(tokens=(ADMIN,), state_dir=state)
    async with gw.session.put(
        f"{gw.url}/v1/functions/{name}",
        json={"handler": "gwfuncs:handler", "code_dir": str(FUNCS)},
        headers=gw.headers(),
    ) as r:
        assert r.status in (400, 404, 422), await r.text()
        if r.status == 422:
            assert (await r.json())["error"]["details"]["field"] == "name"
    assert gw.gateway.pools == {}
    assert not (state / "functions").exists() or list((state / "functions").iterdir()) == []


async def test_code_dir_and_handler_rules_at_deploy(start_gateway, tmp_path):
    state = tmp_path / "state"
    roots = tmp_path / "roots"
    (roots / "inside").mkdir(parents=True)
    (roots / "inside" / "handler.py").write_text("def handler(request, ctx):\n    return b'ok'\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "handler.py").write_text("def handler(request, ctx):\n    pass\n")
    (tmp_path / "plain-file").write_text("")
    (state / "functions").mkdir(parents=True)
    gw = await start_gateway(state_dir=state)
    cases = [
        ({"handler": "os:getcwd"}, "handler", "must be a file in code_dir"),
        ({"handler": "subprocess:run", "code_dir": str(FUNCS)}, "handler", "standard library"),
        ({"handler": "builtins:eval", "code_dir": str(FUNCS)}, "handler", "standard library"),
        ({"handler": "nothere:handler", "code_dir": str(FUNCS)}, "handler", "nothere.py"),
        ({"handler": "h:h", "code_dir": "../../../../etc"}, "code_dir", "absolute"),
        ({"handler": "h:h", "code_dir": "/srv/../etc"}, "code_dir", "'..'"),
        ({"handler": "h:h", "code_dir": "/etc"}, "code_dir", "system or trims directory"),
        ({"handler": "h:h", "code_dir": "/proc/self"}, "code_dir", "system or trims directory"),
        ({"handler": "h:h", "code_dir": "/"}, "code_dir", "system or trims directory"),
        ({"handler": "h:h", "code_dir": str(state / "functions")}, "code_dir", "trims directory"),
        ({"handler": "h:h", "code_dir": str(tmp_path / "missing")}, "code_dir", "does not exist"),
        ({"handler": "h:h", "code_dir": str(tmp_path / "plain-file")}, "code_dir", "not a dir"),
    ]
    for patch, field, words in cases:
        async with gw.session.put(f"{gw.url}/v1/functions/bad", json={"name": "bad", **patch}) as r:
            doc = await r.json()
            assert r.status == 422, (patch, doc)
            assert doc["error"]["details"]["field"] == field, (patch, doc)
            assert words in doc["error"]["message"], (patch, doc)
    assert gw.gateway.pools == {} and list((state / "functions").iterdir()) == []
    await gw.deploy(echo_spec())

    rooted = await start_gateway(code_roots=(roots,))
    await rooted.deploy(
        {"name": "in", "handler": "handler:handler", "code_dir": str(roots / "inside")}
    )
    async with rooted.session.put(
        f"{rooted.url}/v1/functions/out",
        json={"handler": "handler:handler", "code_dir": str(tmp_path / "outside")},
    ) as r:
        doc = await r.json()
        assert r.status == 422 and "outside the gateway's code roots" in doc["error"]["message"]


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed the connection (a reset counts as closed: the
    server closes refused connections with our unread request head in its buffer)."""
    data = b""
    try:
        while chunk := await reader.read(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _healthz_status(url: str) -> int:
    with urllib.request.urlopen(f"{url}/healthz", timeout=30) as response:
        return int(response.status)


async def test_slowloris_connections_are_closed_while_others_are_served(gateway_process):
    gw = gateway_process("--header-timeout", "2", "--max-connections-per-peer", "50")
    assert gw.proc is not None
    baseline = _fd_count(gw.proc.pid)
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    writers = []
    waits = []
    try:
        for _ in range(300):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
            writers.append(writer)
            waits.append(asyncio.ensure_future(_until_closed(reader)))
        # Another local user's client is served meanwhile.
        assert await asyncio.to_thread(run_as, 1000, lambda: _healthz_status(gw.url)) == 200
        replies = await asyncio.wait_for(asyncio.gather(*waits), 60)
    finally:
        for writer in writers:
            writer.close()
        for wait in waits:
            wait.cancel()
    # Each was refused (503, or a reset) or closed by the head deadline: none was answered.
    assert all(r == b"" or r.startswith(b"HTTP/1.1 503") for r in replies)
    assert wait_until(lambda: _fd_count(gw.proc.pid) <= baseline + 5, 30)


async def test_a_stalled_body_is_refused(gateway_process):
    gw = gateway_process("--body-timeout", "1")
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"PUT /v1/functions/x HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n{")
        reply = await asyncio.wait_for(_until_closed(reader), 60)
    finally:
        writer.close()
    assert reply.startswith(b"HTTP/1.1 400") and b"stalled" in reply
