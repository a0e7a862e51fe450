"""Fair limits of the socket server: one peer floods, stalls or spams; no one else notices.

Each test replays one finding of the issue-11 attack against the real daemon: a uid's connection
flood (as root and as ``nobody``), a half frame, idle connections, over-limit frames, nested JSON
and huge integers, and 1,000 bad frames in a row.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient, frames_until_closed
from tests.fixtures.gateway import wait_until
from tests.fixtures.store import DaemonProcess
from tests.fixtures.users import NOBODY, run_as
from trims.daemon.limits import ConnectionSlots, ReadBudget
from trims.protocol import (
    HEADER,
    MAGIC,
    MAX_FRAME,
    MAX_REQUEST_FRAME,
    PROTOCOL_VERSION,
    recv_frame,
    send_frame,
)

TINY = {"w": np.arange(256, dtype=np.float32)}
#: A second unprivileged uid, beside nobody.
OTHER_UID = 1000


def _frame(payload: bytes) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 0, len(payload)) + payload


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(str(path))
    return s


def _hello(s: socket.socket) -> dict[str, Any]:
    send_frame(s, {"id": 1, "op": "hello", "args": {}})
    reply, _ = recv_frame(s)
    return reply


def _only_error(s: socket.socket) -> dict[str, Any]:
    """The one error frame (id null) the daemon sends before it closes the connection."""
    frames = frames_until_closed(s)
    assert len(frames) == 1, frames
    assert frames[0]["id"] is None and frames[0]["ok"] is False
    error: dict[str, Any] = frames[0]["error"]
    return error


def _scrape(url: str | None) -> dict[str, float]:
    assert url is not None
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _assert_clean_log(daemon: DaemonProcess) -> None:
    text = daemon.log.read_text(errors="replace")
    assert "Traceback" not in text and "never retrieved" not in text, text[-4000:]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture
def open_daemon(
    shared_daemon: Callable[..., DaemonProcess],
) -> Callable[..., DaemonProcess]:
    """A daemon ``nobody`` can reach: its store socket in group nogroup."""
    return lambda **options: shared_daemon(socket_group=str(NOBODY), **options)


def _flood_as_nobody(path: Path, count: int, extra: bool = True) -> tuple[int, int, int]:
    """Fork a child that becomes ``nobody``, opens ``count`` connections (and one more).

    The child writes a JSON report to the first fd (hello answered on each connection; what
    the extra one got before it was closed), then holds its connections until a byte arrives
    on the second. Returns (pid, report fd, go fd).
    """
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(report_r)
            os.close(go_w)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            held = [_connect(path) for _ in range(count)]
            replies = [_hello(s)["ok"] for s in held]
            report: dict[str, Any] = {"served": replies}
            if extra:
                report["extra"] = frames_until_closed(_connect(path))
            os.write(report_w, json.dumps(report).encode())
            os.read(go_r, 1)
            code = 0
        except BaseException as e:
            os.write(report_w, json.dumps({"child_error": repr(e)}).encode())
        finally:
            os._exit(code)
    os.close(report_w)
    os.close(go_r)
    return pid, report_r, go_w


def test_a_root_flood_is_refused_past_the_per_uid_limit_others_still_served(
    open_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = open_daemon(max_connections_per_uid=8, metrics_address="127.0.0.1:0")
    flood = [_connect(daemon.socket) for _ in range(8)]
    try:
        assert all(_hello(s)["ok"] for s in flood)
        with _connect(daemon.socket) as extra:
            error = _only_error(extra)
        assert error["code"] == "queue_full" and error["retryable"] is True
        assert "uid 0" in error["message"] and "--max-connections-per-uid" in error["message"]
        with RawClient(daemon.admin_socket) as admin:
            assert admin.result("hello")["admin"] is True
        pid, report, go = _flood_as_nobody(daemon.socket, 1, extra=False)
        try:
            result = json.loads(os.read(report, 1 << 16))
        finally:
            os.write(go, b"x")
            os.close(go)
            os.close(report)
            _, status = os.waitpid(pid, 0)
        assert result.get("served") == [True], result
        assert os.waitstatus_to_exitcode(status) == 0
        assert _scrape(daemon.metrics_url)['trims_connections_refused_total{reason="per_uid"}'] == 1
    finally:
        for s in flood:
            s.close()
    _assert_clean_log(daemon)


def test_a_flood_from_nobody_is_refused_while_root_and_admin_are_served(
    open_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = open_daemon(max_connections_per_uid=8)
    pid, report, go = _flood_as_nobody(daemon.socket, 8)
    try:
        result = json.loads(os.read(report, 1 << 16))
        assert result.get("served") == [True] * 8, result
        [refusal] = result["extra"]
        assert refusal["error"]["code"] == "queue_full"
        assert f"uid {NOBODY}" in refusal["error"]["message"]
        with RawClient(daemon.socket) as other, RawClient(daemon.admin_socket) as admin:
            assert other.result("hello")["admin"] is False
            assert admin.result("hello")["admin"] is True
            assert admin.result("stats")["clients"] == 8 + 2
    finally:
        os.write(go, b"x")
        os.close(go)
        os.close(report)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _assert_clean_log(daemon)


def test_the_total_limit_refuses_the_store_socket_but_the_admin_socket_has_its_own_slots(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(max_connections=4, max_admin_connections=2)
    flood = [_connect(daemon.socket) for _ in range(4)]
    try:
        assert all(_hello(s)["ok"] for s in flood)
        with _connect(daemon.socket) as extra:
            assert "--max-connections)" in _only_error(extra)["message"]
        admins = [_connect(daemon.admin_socket) for _ in range(2)]
        try:
            assert all(_hello(s)["result"]["admin"] for s in admins)
            with _connect(daemon.admin_socket) as extra:
                assert "--max-admin-connections" in _only_error(extra)["message"]
        finally:
            for s in admins:
                s.close()
    finally:
        for s in flood:
            s.close()


def test_a_half_frame_is_cut_off_after_the_read_timeout(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(read_timeout=0.5, metrics_address="127.0.0.1:0")
    with RawClient(daemon.socket) as bystander, _connect(daemon.socket) as slow:
        slow.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 0, 100) + b'{"id": 1')
        error = _only_error(slow)
        assert error["code"] == "timeout" and "--read-timeout" in error["message"]
        assert bystander.result("hello")["admin"] is False
    m = _scrape(daemon.metrics_url)
    assert m['trims_connections_closed_total{reason="read_timeout"}'] == 1
    assert "left a frame incomplete for 0.5 s" in daemon.log.read_text()
    _assert_clean_log(daemon)


def test_an_idle_connection_is_closed_unless_it_holds_a_lease(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models={"tiny": TINY}, idle_timeout=0.5)
    with RawClient(daemon.socket) as holder:
        result, fds = holder.call("acquire", name="tiny")
        os.close(fds[0])
        # The holder has been silent at least as long as `idle` when `idle` is closed.
        with _connect(daemon.socket) as idle:
            assert _hello(idle)["ok"]
            error = _only_error(idle)
        assert error["code"] == "unavailable" and "--idle-timeout" in error["message"]
        assert holder.result("stats")["leases"] == 1
        # Once its last lease is released, the holder is an idle connection like any other.
        holder.result("release", lease=result["lease"])
        assert _only_error(holder.sock)["code"] == "unavailable"
    assert "idle for 0.5 s without leases or requests" in daemon.log.read_text()
    _assert_clean_log(daemon)


def test_over_limit_frames_do_not_grow_the_daemons_memory(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(metrics_address="127.0.0.1:0")
    with RawClient(daemon.socket) as client:
        client.result("hello")
    baseline = _rss(daemon.pid)
    chunk = b"x" * (1 << 20)
    for _ in range(60):
        with _connect(daemon.socket) as s:
            try:
                s.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 0, MAX_FRAME - 1))
                for _ in range(16):
                    s.sendall(chunk)
            except OSError:
                pass  # the daemon refused the header and closed
            error = _only_error(s)
            assert error["code"] == "protocol" and error["details"]["reason"] == "length"
    # 60 frames just under the request limit, each one byte short of complete, held open.
    partial = HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 0, MAX_REQUEST_FRAME) + b" " * (
        MAX_REQUEST_FRAME - 1
    )
    held = [_connect(daemon.socket) for _ in range(60)]
    try:
        for s in held:
            s.sendall(partial)
        deadline = time.monotonic() + 30
        while _scrape(daemon.metrics_url)["trims_read_buffer_bytes"] < 60 * len(partial):
            assert time.monotonic() < deadline, "the daemon did not read the partial frames"
        assert _rss(daemon.pid) < baseline + (64 << 20)
    finally:
        for s in held:
            s.close()
    m = _scrape(daemon.metrics_url)
    assert m['trims_protocol_errors_total{reason="length"}'] == 60
    _assert_clean_log(daemon)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        pytest.param(
            b'{"id": 1, "op": "hello", "args": ' + b"[" * 5000 + b"}", "depth", id="nested"
        ),
        pytest.param(b'{"id": ' + b"7" * 5000 + b', "op": "hello"}', "number", id="5000-digits"),
        pytest.param(b'{"id": 1, "op": "hello", "args": {"x": NaN}}', "number", id="nan"),
        pytest.param(b'{"id": 1, "op": "hello", "args": {"x": 1e999}}', "number", id="overflow"),
        pytest.param(b'{"id": 1, "op": "hello"', "json", id="truncated-json"),
        pytest.param(b'"just a string"', "type", id="not-an-object"),
    ],
)
def test_nested_json_and_huge_numbers_get_an_error_reply(
    start_daemon: Callable[..., DaemonProcess], payload: bytes, reason: str
) -> None:
    daemon = start_daemon(metrics_address="127.0.0.1:0")
    with _connect(daemon.socket) as s:
        s.sendall(_frame(payload))
        error = _only_error(s)
    assert error["code"] == "protocol" and error["details"]["reason"] == reason
    assert _scrape(daemon.metrics_url)[f'trims_protocol_errors_total{{reason="{reason}"}}'] == 1
    with RawClient(daemon.socket) as client:
        assert client.result("hello")["admin"] is False
    _assert_clean_log(daemon)


def test_requests_carry_no_descriptors(start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon()
    r, w = os.pipe()
    try:
        with _connect(daemon.socket) as s:
            send_frame(s, {"id": 1, "op": "hello", "args": {}}, [r])
            error = _only_error(s)
        assert error["code"] == "protocol" and error["details"]["reason"] == "fds"
    finally:
        os.close(r)
        os.close(w)


def test_the_log_of_a_thousand_bad_frames_stays_small(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(peer_log_burst=5, peer_log_interval=3600, metrics_address="127.0.0.1:0")
    before = daemon.log.stat().st_size
    for _ in range(1000):
        with _connect(daemon.socket) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert _only_error(s)["code"] == "protocol"
    assert _scrape(daemon.metrics_url)["trims_log_suppressed_total"] == 995
    daemon.stop()  # the summary of what was suppressed is written at the latest at shutdown
    text = daemon.log.read_bytes()[before:].decode()
    assert text.count("sent a bad frame") == 5
    assert "suppressed 995 more log line(s) about uid 0" in text
    assert len(text) < 8 << 10
    _assert_clean_log(daemon)


def _acquire_and_disconnect(path: Path, count: int) -> int:
    """``count`` times: connect, acquire "tiny", hang up (its lease ends); the pid."""
    for _ in range(count):
        with RawClient(path) as client:
            _, fds = client.call("acquire", name="tiny")
            for fd in fds:
                os.close(fd)
    return os.getpid()


def test_acquire_and_disconnect_loops_of_one_uid_keep_the_log_small(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Finding 8 of issue 41: every acquire + disconnect wrote an INFO line, unbounded. Lines
    about one uid share its log bucket; another uid's line still gets through."""
    daemon = start_daemon(
        models={"tiny": TINY},
        socket_mode="666",
        peer_log_burst=5,
        peer_log_interval=3600,
        metrics_address="127.0.0.1:0",
    )
    run_as(NOBODY, lambda: _acquire_and_disconnect(daemon.socket, 300))
    assert wait_until(
        lambda: _scrape(daemon.metrics_url).get("trims_log_suppressed_total") == 295
    ), _scrape(daemon.metrics_url).get("trims_log_suppressed_total")
    other = run_as(OTHER_UID, lambda: _acquire_and_disconnect(daemon.socket, 1))
    line = f"client pid {other} (uid {OTHER_UID}) disconnected; its 1 lease(s) ended"
    assert wait_until(lambda: line in daemon.log.read_text())
    text = daemon.log.read_text()
    assert text.count(f"(uid {NOBODY}) disconnected") == 5
    daemon.stop()
    assert f"suppressed 295 more log line(s) about uid {NOBODY}" in daemon.log.read_text()
    _assert_clean_log(daemon)


def test_the_read_budget_makes_readers_wait_until_bytes_free() -> None:
    async def scenario() -> None:
        budget = ReadBudget(100)
        assert await budget.reserve(60) == 60
        second = asyncio.create_task(budget.reserve(60))
        await asyncio.sleep(0)  # one loop turn: it runs until it blocks on the budget
        assert not second.done() and budget.used == 60
        budget.release(60)
        assert await second == 60 and budget.used == 60
        assert await budget.reserve(40) == 40

    asyncio.run(scenario())


def test_connection_slots_count_per_uid_and_in_total() -> None:
    slots = ConnectionSlots(total=3, per_uid=2)
    for uid in (1, 1, 2):
        assert slots.refusal(uid) is None
        slots.take(uid)
    assert slots.refusal(1) == "total"
    slots.give(2)
    assert slots.refusal(1) == "per_uid" and slots.refusal(2) is None
