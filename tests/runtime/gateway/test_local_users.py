"""Local users on the gateway's host are told apart by their uid (issue 41, findings 1 and 5).

Every local user reaches a loopback gateway from 127.0.0.1, so neither an address nor the one
anonymous token tells them apart; the kernel says which user owns the caller's socket
(runtime/gateway/peer_cred.py). Each test replays an attack by one local user on another,
both forked children of this (root) process that setuid to uids 1000, 1001, 1002 or 65534,
against a real gateway in this event loop; the children talk plain HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fixtures.gateway import ADMIN, RunningGateway, doubler_spec
from tests.fixtures.users import NOBODY, run_as
from trims import peer_cred
from trims.runtime.gateway.connections import ConnectionGuard, GuardedTCPSite
from trims.runtime.gateway.oip_shm import MAX_REGIONS_PER_OWNER
from trims.runtime.settings import LOCAL_ANONYMOUS_SCOPES

VICTIM, OTHER, THIRD = 1000, 1001, 1002

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="forks children as other uids")


def _port(gw: RunningGateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


def _guard(gw: RunningGateway) -> ConnectionGuard:
    assert gw.runner is not None
    site = next(iter(gw.runner.sites))
    assert isinstance(site, GuardedTCPSite)
    return site.guard


def _http(port: int, method: str, path: str, doc: Any = None) -> tuple[int, Any]:
    """One request without a token on its own connection: (status, JSON body or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = None if doc is None else json.dumps(doc)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, None
    finally:
        conn.close()


async def _as_user(uid: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` in a child running as ``uid``, without blocking the gateway's event loop."""
    return await asyncio.to_thread(run_as, uid, fn)


async def _until(what: str, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# -- finding 1: shared-memory regions belong to the local user that registered them ----------

SECRET = [3.14, 2.71, 1.41, 1.73]


def _key(name: str) -> str:
    return f"/trims-test-{os.getpid()}-{name}"


@pytest.fixture
def shm_keys() -> Iterator[Callable[[str], str]]:
    """Names of shared-memory objects the test's children create; unlinked at teardown."""
    made: list[str] = []

    def key(name: str) -> str:
        made.append(_key(name))
        return made[-1]

    yield key
    for name in made:
        try:
            os.unlink(f"/dev/shm{name}")
        except FileNotFoundError:
            pass


def _create(key: str, data: bytes) -> None:
    """A 0600 object of the calling user holding ``data`` (what shm_open would make)."""
    fd = os.open(f"/dev/shm{key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _register(port: int, name: str, key: str, size: int) -> int:
    doc = {"key": key, "offset": 0, "byte_size": size}
    return _http(port, "POST", f"/v2/systemsharedmemory/region/{name}/register", doc)[0]


def _shm_tensor(region: str) -> dict[str, Any]:
    return {"shared_memory_region": region, "shared_memory_byte_size": 16}


def _reading(region: str) -> dict[str, Any]:
    """An infer request whose input x comes from ``region``, asking for y in the body."""
    x = {"name": "x", "datatype": "FP32", "shape": [4], "parameters": _shm_tensor(region)}
    return {"inputs": [x], "outputs": [{"name": "y"}]}


def _attack(port: int, key: str) -> dict[str, Any]:
    """What uid OTHER, without a token, tries on uid VICTIM's region "v"."""
    out: dict[str, Any] = {"listed": _http(port, "GET", "/v2/systemsharedmemory/status")}
    read = _reading("v")
    out["read"] = _http(port, "POST", "/v2/models/doubler/infer", read)
    write = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "data": [333.0] * 4}],
        "outputs": [{"name": "y", "parameters": _shm_tensor("v")}],
    }
    out["write"] = _http(port, "POST", "/v2/models/doubler/infer", write)
    _create(key, bytes(64))
    out["fill"] = [_register(port, f"r{i}", key, 64) for i in range(MAX_REGIONS_PER_OWNER + 1)]
    out["unregister"] = _http(port, "POST", "/v2/systemsharedmemory/region/v/unregister")
    return out


async def test_anonymous_local_users_neither_see_use_nor_crowd_out_each_others_regions(
    start_gateway: Any, shm_keys: Callable[[str], str]
) -> None:
    """A default loopback gateway (anonymous callers may invoke): uid 1000 registers its own
    0600 object; uid 1001, also without a token, could list it, read it and write into it
    through infer, fill the one anonymous cap and unregister it. Each is refused now."""
    gw = await start_gateway(tokens=(ADMIN,), anonymous_scopes=LOCAL_ANONYMOUS_SCOPES)
    await gw.deploy(doubler_spec())
    port = _port(gw)
    victim_key, other_key = shm_keys("victim"), shm_keys("other")

    def register_own() -> int:
        _create(victim_key, struct.pack("4f", *SECRET))
        return _register(port, "v", victim_key, 16)

    assert await _as_user(VICTIM, register_own) == 200
    attack = await _as_user(OTHER, lambda: _attack(port, other_key))
    assert attack["listed"] == [200, []]
    for what in ("read", "write"):
        status, doc = attack[what]
        assert status == 400 and "no system shared-memory region named 'v'" in doc["error"], doc
    assert attack["fill"] == [200] * MAX_REGIONS_PER_OWNER + [507]
    assert attack["unregister"][0] == 404

    def victim_after() -> dict[str, Any]:
        return {
            "listed": _http(port, "GET", "/v2/systemsharedmemory/status")[1],
            "one_more": _register(port, "w", victim_key, 16),
        }

    after = await _as_user(VICTIM, victim_after)
    assert after["one_more"] == 200
    assert [r["name"] for r in after["listed"]] == ["v"]
    with open(f"/dev/shm{victim_key}", "rb") as f:
        assert struct.unpack("4f", f.read(16)) == pytest.approx(SECRET)
    # The victim's own infer still reads its region.
    read = _reading("v")
    status, doc = await _as_user(
        VICTIM, lambda: _http(port, "POST", "/v2/models/doubler/infer", read)
    )
    assert status == 200, doc
    y = next(o for o in doc["outputs"] if o["name"] == "y")
    assert status == 200 and y["data"] == pytest.approx([2 * v for v in SECRET])


# -- finding 5: connection caps count local users, and head-less connections leave room ------


def _hold_heads(uid: int, port: int, count: int, host: str = "127.0.0.1") -> tuple[int, int]:
    """Fork a child as ``uid`` that opens ``count`` connections, sends each a request head
    without its end (slowloris), and holds them until the returned fd is closed: (pid, fd)."""
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            # Only go_r: a pipe of another holder inherited here would never see its EOF.
            os.closerange(3, go_r)
            os.closerange(go_r + 1, 1 << 16)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            held = []
            for _ in range(count):
                s = socket.create_connection((host, port), timeout=30)
                try:
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Slow: ")
                except OSError:
                    pass  # refused (503 and closed) before the head went out
                held.append(s)
            os.read(go_r, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    return pid, go_w


async def _release(pid: int, go: int) -> None:
    os.close(go)
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _healthz(port: int, times: int = 3) -> list[int]:
    return [_http(port, "GET", "/healthz")[0] for _ in range(times)]


async def test_a_local_slowloris_takes_only_its_own_users_connections(
    start_gateway: Any,
) -> None:
    """uid 65534 holds half-sent heads up to its cap (and more are refused); users 1000 and
    1001 on the same 127.0.0.1 are answered, not 503."""
    gw = await start_gateway(max_connections_per_peer=20, header_timeout_s=60.0)
    guard, port = _guard(gw), _port(gw)
    pid, go = _hold_heads(NOBODY, port, 25)
    try:
        await _until("5 of 25 slowloris connections refused", lambda: guard.refused >= 5)
        for uid in (VICTIM, OTHER):
            assert await _as_user(uid, lambda: _healthz(port)) == [200] * 3
        assert guard.open == {f"uid {NOBODY}": 20}
    finally:
        await _release(pid, go)
    await _until("the slowloris connections closed", lambda: not guard.open)


async def _get_healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
    """GET /healthz on a kept-alive connection: the status."""
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    length = next(
        int(line.split(":", 1)[1]) for line in head.split("\r\n")
        if line.lower().startswith("content-length:")
    )  # fmt: skip
    await reader.readexactly(length)
    return int(head.split(" ", 2)[1])


async def test_head_less_connections_leave_room_for_requests_and_served_ones_stay(
    start_gateway: Any,
) -> None:
    """Two local users' slowloris fill every slot a head-less connection may hold: a
    connection already served keeps its place, and a newcomer that sends its request at once
    takes the oldest half-sent one of the biggest holder, so it is answered, not 503; the two
    holders are left evicting only each other's excess."""
    gw = await start_gateway(
        max_connections_per_peer=25, max_connections=40, reserved_connections=10,
        header_timeout_s=60.0,
    )  # fmt: skip
    guard, port = _guard(gw), _port(gw)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    children = []
    try:
        assert await _get_healthz(reader, writer) == 200
        children.append(_hold_heads(NOBODY, port, 25))
        await _until(
            "uid 65534's 25 connections accepted",
            lambda: sum(guard.open.values()) + guard.refused == 26,
        )
        children.append(_hold_heads(THIRD, port, 25))
        await _until("10 of uid 1002's refused", lambda: guard.refused >= 10)
        # 30 head-less now (the most there may be), 15 each: 10 of the first's made room.
        assert await _as_user(VICTIM, lambda: _healthz(port)) == [200] * 3
        # The first of these made room too; each left when answered, leaving room for the next.
        assert guard.evicted == 11 and guard.headless_total == 29
        assert {p: len(c) for p, c in guard.headless.items()} == {
            f"uid {NOBODY}": 14,
            f"uid {THIRD}": 15,
        }
        assert await _get_healthz(reader, writer) == 200
    finally:
        writer.close()
        for pid, go in children:
            await _release(pid, go)
    await _until("the slowloris connections closed", lambda: not guard.open)


# -- reading the owner of a loopback connection ----------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_both_ways_of_asking_the_kernel_name_the_callers_user(host: str) -> None:
    """sock_diag and the /proc/net table agree on the owner of another user's socket, on the
    caller's side of the connection only."""
    family = socket.AF_INET if ":" not in host else socket.AF_INET6
    with socket.socket(family) as listener:
        try:
            listener.bind((host, 0))
        except OSError:
            pytest.skip(f"no {host} on this host")
        listener.listen()
        port = listener.getsockname()[1]
        pid, go = _hold_heads(OTHER, port, 1, host)
        try:
            accepted, _ = listener.accept()
            with accepted:
                peer = peer_cred._ip(accepted.getpeername()[0]), accepted.getpeername()[1]
                ours = peer_cred._ip(accepted.getsockname()[0]), accepted.getsockname()[1]
                assert peer_cred._diag_owner(peer, ours) == OTHER
                assert peer_cred._table_owner(peer, ours) == OTHER
                # The listener's own end of the connection is root's.
                assert peer_cred._diag_owner(ours, peer) == 0
        finally:
            os.close(go)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
