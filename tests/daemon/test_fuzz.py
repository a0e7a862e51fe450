"""A protocol fuzzer of our own: 5,000 seeded random frames against the real daemon.

Each case is one frame (or a broken piece of one): random bytes, random JSON requests, wrong
types for every argument of every operation, huge lengths, half frames then close, requests
with descriptors attached, deep nesting, huge numbers, mutated valid frames, valid frames split
into random pieces. The oracle: every reply is a well-formed frame, no request ever ends in an
``internal`` error, malformed frames are answered with a ``protocol`` error, and after every
batch a fresh client (store socket and admin socket) is still served. At the end the daemon's
descriptors and memory are back near their baseline and its log holds no traceback.

The seeds are fixed, so a failure replays; the failing case is named in the assertion.
"""

from __future__ import annotations

import array
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient, frames_until_closed
from tests.fixtures.store import DaemonProcess, seed_layout
from trims.errors import ERROR_CODES
from trims.protocol import (
    ADMIN_OPS,
    HEADER,
    MAGIC,
    MAX_REQUEST_FRAME,
    PROTOCOL_VERSION,
    Op,
    encode_frame,
    recv_frame,
)

SEEDS = (11, 23, 37, 41, 59)
CASES_PER_SEED = 1000
BATCH = 100

#: Every operation's arguments and the JSON types each accepts (for wrong-type cases).
ARGS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"client": (str,)},
    "acquire": {
        "name": (str,),
        "version": (str,),
        "digest": (str,),
        "tier": (str,),
        "device": (str, int),
    },
    "release": {"lease": (str,)},
    "info": {"name": (str,), "version": (str,)},
    "list": {},
    "stats": {},
    "load": {"name": (str,), "version": (str,), "tier": (str,)},
    "evict": {"name": (str,), "version": (str,), "tier": (str,)},
    "pin": {"name": (str,), "version": (str,), "tier": (str,)},
    "unpin": {"name": (str,), "version": (str,), "tier": (str,)},
    "add": {
        "name": (str,),
        "source": (str,),
        "version": (str,),
        "format": (str,),
        "sha256": (str,),
        "access": (dict,),
    },
    "remove": {"name": (str,), "version": (str,), "force": (bool,)},
    "verify": {"name": (str,), "version": (str,)},
}
assert set(ARGS) == {op.value for op in Op}


def _frame(payload: bytes, nfds: int = 0) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, nfds, len(payload)) + payload


class Fuzzer:
    """Generates cases from one seeded generator and checks the daemon's answers."""

    def __init__(self, daemon: DaemonProcess, seed: int) -> None:
        self.daemon = daemon
        self.rng = random.Random(seed)
        self.seed = seed
        self.next_id = 0
        self.sessions: dict[bool, socket.socket] = {}

    # -- values ------------------------------------------------------------------------------

    def scalar(self) -> Any:
        r = self.rng
        return r.choice(
            [
                lambda: None,
                lambda: r.random() < 0.5,
                lambda: r.randint(-(2**63), 2**63),
                lambda: r.uniform(-1e300, 1e300),
                lambda: "".join(
                    r.choice("abc/.:-_ \\\"'\u00e9\u2603\n") for _ in range(r.randint(0, 40))
                ),
                lambda: "tiny",
                lambda: "x" * r.randint(0, 500),
            ]
        )()

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        kind = r.random()
        if depth >= 5 or kind < 0.6:
            return self.scalar()
        if kind < 0.8:
            return [self.value(depth + 1) for _ in range(r.randint(0, 4))]
        return {str(self.scalar())[:20]: self.value(depth + 1) for _ in range(r.randint(0, 4))}

    def wrong(self, accepted: tuple[type, ...]) -> Any:
        """A value of a JSON type the argument does not accept (never None: that means unset)."""
        while True:
            v = self.value(3)
            if v is None:
                continue
            if isinstance(v, bool):
                if bool not in accepted:
                    return v
            elif not isinstance(v, accepted):
                return v

    # -- transport ---------------------------------------------------------------------------

    def connect(self, admin: bool = False) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(str(self.daemon.admin_socket if admin else self.daemon.socket))
        return s

    def session(self, admin: bool) -> socket.socket:
        if admin not in self.sessions:
            self.sessions[admin] = self.connect(admin)
        return self.sessions[admin]

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()

    def frames_until_closed(self, s: socket.socket, case: str) -> list[dict[str, Any]]:
        frames = frames_until_closed(s)
        for message in frames:
            assert isinstance(message.get("ok"), bool), (self.seed, case, message)
            if not message["ok"]:
                self.check_error(message, case)
        return frames

    def check_error(self, message: dict[str, Any], case: str) -> None:
        code = message["error"]["code"]
        assert code in ERROR_CODES and code != "internal", (self.seed, case, message)

    # -- cases -------------------------------------------------------------------------------

    def one_shot(self, data: bytes, case: str, expect: str | None) -> None:
        """Send ``data`` on a fresh connection, end our side, read what comes until closed.

        ``expect``: the ProtocolError reason the daemon must answer with, or None (anything
        well formed, possibly nothing, e.g. for a half frame).
        """
        with self.connect() as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the daemon refused the start of it and closed already
            frames = self.frames_until_closed(s, case)
        if expect is not None:
            errors = [f["error"] for f in frames if not f["ok"]]
            assert errors, (self.seed, case, frames)
            assert errors[-1]["code"] == "protocol", (self.seed, case, frames)
            assert errors[-1]["details"]["reason"] in expect.split("|"), (self.seed, case, frames)

    def request(self, message: dict[str, Any], case: str, admin: bool = False) -> None:
        """Send a well-formed frame on a session and check the reply that carries its id."""
        data = encode_frame(message)
        if len(data) > HEADER.size + MAX_REQUEST_FRAME:
            self.one_shot(data, case, "length")
            return
        s = self.session(admin)
        if self.rng.random() < 0.2:  # split into random pieces
            cuts = sorted(self.rng.sample(range(1, len(data)), min(3, len(data) - 1)))
            for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
                s.sendall(data[a:b])
        else:
            s.sendall(data)
        rid = message.get("id")
        expected = rid if isinstance(rid, int) and not isinstance(rid, bool) else None
        while True:
            reply, fds = recv_frame(s)
            for fd in fds:
                os.close(fd)
            if "progress" not in reply:
                break
        assert reply.get("id") == expected, (self.seed, case, reply)
        if not reply["ok"]:
            self.check_error(reply, case)
        lease = reply.get("result", {}).get("lease") if reply["ok"] else None
        if lease:
            self.request({"id": 1, "op": "release", "args": {"lease": lease}}, case + "/release")

    def new_id(self) -> Any:
        self.next_id += 1
        if self.rng.random() < 0.05:
            return self.wrong((int,))
        return self.next_id

    def case_random_bytes(self) -> None:
        data = self.rng.randbytes(self.rng.randint(1, 300))
        self.one_shot(data, f"random bytes {data.hex()}", None)

    def case_random_request(self) -> None:
        r = self.rng
        op = r.choice(list(ARGS)) if r.random() < 0.9 else self.scalar()
        args = self.value(1) if r.random() < 0.3 else {}
        if op in ARGS and isinstance(args, dict):
            for name in ARGS[op]:
                if r.random() < 0.5:
                    args[name] = self.value(2)
        # Store socket only: there admin operations are denied, whatever their arguments.
        self.request({"id": self.new_id(), "op": op, "args": args}, f"random request {op!r}")

    def case_wrong_types(self) -> None:
        r = self.rng
        op = r.choice(list(ARGS))
        spec = ARGS[op]
        args: dict[str, Any] = {}
        for name, accepted in spec.items():
            if r.random() < 0.5:
                args[name] = self.wrong(accepted)
        admin = Op(op) in ADMIN_OPS
        if admin:
            args["name"] = self.wrong((str,))  # never a valid name: nothing gets administered
        message = {"id": self.new_id(), "op": op, "args": args}
        self.request(message, f"wrong types {message!r}"[:300], admin=admin)

    def case_huge_length(self) -> None:
        length = self.rng.randint(MAX_REQUEST_FRAME + 1, 2**32 - 1)
        data = HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 0, length) + b"{" * self.rng.randint(0, 99)
        self.one_shot(data, f"huge length {length}", "length")

    def case_half_frame(self) -> None:
        payload = encode_frame({"id": 1, "op": "hello", "args": {"client": "x" * 100}})
        cut = self.rng.randint(1, len(payload) - 1)
        with self.connect() as s:
            s.sendall(payload[:cut])

    def case_fds_attached(self) -> None:
        nfds = self.rng.choice([0, 1])
        data = _frame(json.dumps({"id": 1, "op": "hello", "args": {}}).encode(), nfds)
        r, w = os.pipe()
        try:
            with self.connect() as s:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]).tobytes())]
                s.sendmsg([data], anc)
                if nfds:
                    frames = self.frames_until_closed(s, "fds announced")
                    assert frames[-1]["error"]["details"]["reason"] == "fds", frames
                else:
                    reply, _ = recv_frame(s)
                    assert reply["ok"] is True, reply
        finally:
            os.close(r)
            os.close(w)

    def case_nested(self) -> None:
        depth = self.rng.randint(33, 20000)
        opener, closer = self.rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        payload = b'{"id":1,"op":"hello","args":' + opener * depth + b"1" + closer * depth + b"}"
        if len(payload) > MAX_REQUEST_FRAME:
            self.one_shot(_frame(payload), f"nested {depth}", "length")
        else:
            self.one_shot(_frame(payload), f"nested {depth}", "depth")

    def case_huge_number(self) -> None:
        r = self.rng
        digits = r.choice("123456789") + "".join(
            r.choice("0123456789") for _ in range(r.randint(32, 20000))
        )
        number = r.choice([digits, "-" + digits, "1e" + digits, "NaN", "Infinity", "-Infinity"])
        payload = b'{"id":1,"op":"hello","args":{"x":' + number.encode() + b"}}"
        expect = "length" if len(payload) > MAX_REQUEST_FRAME else "number"
        self.one_shot(_frame(payload), f"number {number[:40]}", expect)

    def case_mutated(self) -> None:
        r = self.rng
        data = bytearray(encode_frame({"id": 1, "op": r.choice(list(ARGS)), "args": {"a": 1}}))
        for _ in range(r.randint(1, 4)):
            how = r.random()
            i = r.randrange(len(data))
            if how < 0.5:
                data[i] ^= 1 << r.randrange(8)
            elif how < 0.75:
                del data[i:]
                if not data:
                    data = bytearray(b"T")
            else:
                data[i:i] = r.randbytes(r.randint(1, 8))
        self.one_shot(bytes(data), f"mutated {bytes(data).hex()}", None)

    def run_case(self) -> None:
        case = self.rng.choices(
            [
                self.case_random_bytes,
                self.case_random_request,
                self.case_wrong_types,
                self.case_huge_length,
                self.case_half_frame,
                self.case_fds_attached,
                self.case_nested,
                self.case_huge_number,
                self.case_mutated,
            ],
            weights=[10, 20, 25, 5, 5, 5, 10, 10, 10],
        )[0]
        case()


def _health(daemon: DaemonProcess) -> None:
    with RawClient(daemon.socket) as client:
        assert client.result("hello")["admin"] is False
        assert [m["name"] for m in client.result("list")["models"]] == ["tiny"]
    with RawClient(daemon.admin_socket) as admin:
        assert admin.result("hello")["admin"] is True


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    # Per-uid slots raised: the fuzzer closes connections faster than the daemon may notice.
    d = DaemonProcess(root, {"max_connections_per_uid": 256, "read_timeout": 2})
    seed_layout(d.store_dir, "tiny", {"w": np.arange(64, dtype=np.float32)})
    yield d.start()
    d.stop()


@pytest.fixture(scope="module")
def baseline(daemon: DaemonProcess) -> tuple[int, int]:
    _health(daemon)
    return _fds(daemon.pid), _rss(daemon.pid)


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_frames(daemon: DaemonProcess, baseline: tuple[int, int], seed: int) -> None:
    fuzzer = Fuzzer(daemon, seed)
    try:
        for done in range(1, CASES_PER_SEED + 1):
            fuzzer.run_case()
            if done % BATCH == 0:
                _health(daemon)
    finally:
        fuzzer.close()
    assert daemon.running()


def test_after_fuzzing_descriptors_memory_and_log_are_back_to_normal(
    daemon: DaemonProcess, baseline: tuple[int, int]
) -> None:
    fds, rss = baseline
    _health(daemon)
    deadline = time.monotonic() + 30
    while _fds(daemon.pid) > fds + 4:  # connections the fuzzer closed are still being reaped
        assert time.monotonic() < deadline, (
            f"the daemon holds {_fds(daemon.pid)} descriptors, {fds} before fuzzing"
        )
        time.sleep(0.05)
    assert _rss(daemon.pid) < rss + (64 << 20)
    text = daemon.log.read_text(errors="replace")
    assert "Traceback" not in text and "never retrieved" not in text, text[-4000:]
    assert "internal error" not in text
