"""Triton's system shared-memory extension, driven by tritonclient's own utilities, and the
CUDA shared-memory extension's answer on a gateway without GPU support."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from tests.fixtures.gateway import ADMIN, doubler_spec
from trims.runtime.gateway.api_oip_shm import SHM, cuda_available
from trims.runtime.gateway.oip_cuda_shm import CudaSharedMemoryRegistry
from trims.runtime.gateway.oip_shm import MAX_REGIONS_PER_OWNER
from trims.runtime.settings import Token

ALICE = Token("alice-secret-1", frozenset({"invoke:*"}), "alice")
BOB = Token("bob-secret-1", frozenset({"invoke:doubler"}), "bob")
READER = Token("reader-secret-1", frozenset({"read"}), "reader")

httpclient = pytest.importorskip("tritonclient.http")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
tritonutils = pytest.importorskip("tritonclient.utils")


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> Iterator[None]:
    """tritonclient's regions are multiprocessing shared memory, which starts multiprocessing's
    resource-tracker process on first use: start it before the tests' leak snapshots and stop
    it after them."""
    from multiprocessing import resource_tracker as tracker

    tracker.ensure_running()
    yield
    tracker._resource_tracker._stop()


def _key(name: str) -> str:
    return f"/trims-test-{os.getpid()}-{name}"


@contextmanager
def _regions(*sizes: tuple[str, int]) -> Iterator[dict[str, Any]]:
    """tritonclient shared-memory regions (name -> handle), destroyed on exit."""
    handles: dict[str, Any] = {}
    try:
        for name, size in sizes:
            handles[name] = shm.create_shared_memory_region(name, _key(name), size)
        yield handles
    finally:
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


def _client(url: str) -> Any:
    return httpclient.InferenceServerClient(url=url.removeprefix("http://"))


def _auth(token: Token) -> dict[str, str]:
    return {"Authorization": f"Bearer {token.secret}"}


def _round_trip(url: str) -> None:
    x = np.arange(6, dtype=np.float32) - 2.5
    words = np.array([b"shared", b"\xff\x00bytes", b""], dtype=object)
    serialized = tritonutils.serialize_byte_tensor(words)
    s_size = serialized.item().__len__() if serialized.dtype == object else serialized.nbytes
    client = _client(url)
    headers = _auth(ALICE)
    # One input region holding x at offset 64 and the serialized strings after it.
    with _regions(("in", 64 + x.nbytes + s_size), ("out", 4096)) as regions:
        shm.set_shared_memory_region(regions["in"], [x], offset=64)
        shm.set_shared_memory_region(regions["in"], [serialized], offset=64 + x.nbytes)
        try:
            client.register_system_shared_memory(
                "in", _key("in"), x.nbytes + s_size, offset=64, headers=headers
            )
            client.register_system_shared_memory("out", _key("out"), 4096, headers=headers)
            status = client.get_system_shared_memory_status(headers=headers)
            assert sorted(status, key=lambda r: r["name"]) == [
                {"name": "in", "key": _key("in"), "offset": 64, "byte_size": x.nbytes + s_size},
                {"name": "out", "key": _key("out"), "offset": 0, "byte_size": 4096},
            ]
            xin = httpclient.InferInput("x", [6], "FP32")
            xin.set_shared_memory("in", x.nbytes)
            sin = httpclient.InferInput("s", [3], "BYTES")
            sin.set_shared_memory("in", s_size, offset=x.nbytes)
            yout = httpclient.InferRequestedOutput("y")
            yout.set_shared_memory("out", x.nbytes, offset=128)
            tout = httpclient.InferRequestedOutput("t")
            tout.set_shared_memory("out", 1024, offset=1024)
            raw = httpclient.InferRequestedOutput("raw", binary_data=True)
            result = client.infer("bytes", [xin, sin], outputs=[yout, tout, raw], headers=headers)
            y_meta = result.get_output("y")
            assert y_meta["parameters"] == {
                "shared_memory_region": "out",
                "shared_memory_byte_size": x.nbytes,
                "shared_memory_offset": 128,
            }
            assert "data" not in y_meta
            y = shm.get_contents_as_numpy(regions["out"], np.float32, y_meta["shape"], offset=128)
            np.testing.assert_array_equal(y, x * 2)
            t_meta = result.get_output("t")
            t = shm.get_contents_as_numpy(regions["out"], np.object_, t_meta["shape"], offset=1024)
            assert list(t) == list(words)
            assert result.as_numpy("raw")[0].startswith(b"\xff\xfe")
        finally:
            client.unregister_system_shared_memory(headers=headers)
            assert client.get_system_shared_memory_status(headers=headers) == []
            client.close()


async def test_tritonclient_inputs_and_outputs_by_reference(start_gateway):
    gw = await start_gateway(tokens=(ADMIN, ALICE))
    await gw.deploy(doubler_spec("bytes", with_bytes=True))
    await asyncio.to_thread(_round_trip, gw.url)


def _error(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(Exception) as info:  # InferenceServerException
        call(*args, **kwargs)
    return str(info.value)


def _ownership_and_bounds(url: str) -> None:
    client = _client(url)
    alice, bob = _auth(ALICE), _auth(BOB)
    x = np.ones(4, dtype=np.float32)
    with _regions(("a", 64)) as regions:
        shm.set_shared_memory_region(regions["a"], [x])
        try:
            client.register_system_shared_memory("a", _key("a"), 64, headers=alice)
            # Bob sees nothing of Alice's, cannot use, unregister or re-register her key.
            assert client.get_system_shared_memory_status(headers=bob) == []
            assert "no system shared-memory region named 'a'" in _error(
                client.get_system_shared_memory_status, "a", headers=bob
            )
            assert "no system shared-memory region named 'a'" in _error(
                client.unregister_system_shared_memory, "a", headers=bob
            )
            assert "registered by another caller" in _error(
                client.register_system_shared_memory, "b", _key("a"), 64, headers=bob
            )
            xin = httpclient.InferInput("x", [4], "FP32")
            xin.set_shared_memory("a", 16)
            out = httpclient.InferRequestedOutput("y")
            assert "no system shared-memory region named 'a'" in _error(
                client.infer, "doubler", [xin], outputs=[out], headers=bob
            )
            result = client.infer("doubler", [xin], outputs=[out], headers=alice)
            np.testing.assert_array_equal(result.as_numpy("y"), x * 2)

            # Bounds: the object, the region, the tensor, the output.
            assert "run past its end" in _error(
                client.register_system_shared_memory, "c", _key("a"), 64, offset=8, headers=alice
            )
            assert "is registered" in _error(
                client.register_system_shared_memory, "a", _key("a"), 8, headers=alice
            )
            past = httpclient.InferInput("x", [4], "FP32")
            past.set_shared_memory("a", 16, offset=56)
            assert "run past region a" in _error(
                client.infer, "doubler", [past], outputs=[out], headers=alice
            )
            short = httpclient.InferInput("x", [4], "FP32")
            short.set_shared_memory("a", 12)
            assert "needs 16 bytes, got 12" in _error(
                client.infer, "doubler", [short], outputs=[out], headers=alice
            )
            small = httpclient.InferRequestedOutput("y")
            small.set_shared_memory("a", 8, offset=32)
            assert "cannot hold it" in _error(
                client.infer, "doubler", [xin], outputs=[small], headers=alice
            )
            assert client.get_cuda_shared_memory_status(headers=alice) == []
            extensions = client.get_server_metadata()["extensions"]
            assert {"system_shared_memory", "model_repository"} <= set(extensions)
            assert ("cuda_shared_memory" in extensions) == cuda_available()
            if not cuda_available():
                handle = base64.b64encode(bytes(64))
                message = _error(
                    client.register_cuda_shared_memory, "g", handle, 0, 64, headers=alice
                )
                assert "CUDA shared memory is not available on this gateway" in message
                assert "cannot use the CUDA driver" in message
            # One name is one region across system and CUDA shared memory.
            assert "is a system shared-memory region" in _error(
                client.register_cuda_shared_memory,
                "a",
                base64.b64encode(bytes(64)),
                0,
                64,
                headers=alice,
            )
        finally:
            client.unregister_system_shared_memory(headers=alice)
            client.close()


async def test_regions_belong_to_their_token_and_are_bounds_checked(start_gateway):
    gw = await start_gateway(tokens=(ADMIN, ALICE, BOB, READER))
    await gw.deploy(doubler_spec())
    await asyncio.to_thread(_ownership_and_bounds, gw.url)


async def test_who_may_register_and_how_many(start_gateway):
    gw = await start_gateway(tokens=(ADMIN, ALICE, READER))
    url = f"{gw.url}/v2/systemsharedmemory/region/r0/register"
    with _regions(("cap", 64)):
        client_fds = set(_fds_on(_key("cap")))  # tritonclient's own handle
        body = {"key": _key("cap"), "offset": 0, "byte_size": 64}
        async with gw.session.post(url, json=body) as r:
            assert r.status == 401 and "token" in (await r.json())["error"]
        async with gw.session.post(url, json=body, headers=_auth(READER)) as r:
            assert r.status == 403 and "may not invoke" in (await r.json())["error"]
        for bad, message in [
            ({**body, "key": "/../etc/passwd"}, "must name a POSIX shared-memory object"),
            ({**body, "key": _key("missing")}, "create it first"),
            ({**body, "byte_size": 0}, "at least 1"),
            ({"offset": 0}, "needs a JSON object"),
        ]:
            async with gw.session.post(url, json=bad, headers=_auth(ALICE)) as r:
                doc = await r.json()
                assert r.status in (400, 404) and message in doc["error"], (bad, doc)
        for i in range(MAX_REGIONS_PER_OWNER):
            async with gw.session.post(
                f"{gw.url}/v2/systemsharedmemory/region/r{i}/register",
                json=body,
                headers=_auth(ALICE),
            ) as r:
                assert r.status == 200, await r.text()
        async with gw.session.post(
            f"{gw.url}/v2/systemsharedmemory/region/one-more/register",
            json=body,
            headers=_auth(ALICE),
        ) as r:
            assert r.status == 507 and "the most one may" in (await r.json())["error"]
        held = set(_fds_on(_key("cap"))) - client_fds
        assert len(held) == MAX_REGIONS_PER_OWNER
        # Shutting the gateway down closes every region.
        assert gw.runner is not None
        await gw.runner.cleanup()
        assert set(_fds_on(_key("cap"))) == client_fds


def _fds_on(key: str) -> list[str]:
    """This process's descriptors open on the shared-memory object ``key``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target == f"/dev/shm{key}":
            out.append(fd)
    return out


def _non_loopback_address() -> str | None:
    """An address of this host other than loopback, or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("198.51.100.1", 9))  # no packet is sent: this only picks a route
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if ipaddress.ip_address(address).is_loopback else address


def test_only_callers_on_the_host_may_use_shared_memory(gateway_process):
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback address to call the gateway from")
    gw = gateway_process("--host", "0.0.0.0")
    port = urllib.parse.urlsplit(gw.url).port
    request = urllib.request.Request(f"http://{address}:{port}/v2/systemsharedmemory/status")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 403
    assert "only for clients on the gateway's host" in json.loads(info.value.read())["error"]
    local = f"http://127.0.0.1:{port}/v2/systemsharedmemory/status"
    with urllib.request.urlopen(local, timeout=30) as response:
        assert json.loads(response.read()) == []


async def test_only_objects_of_the_calling_user_and_a_shrunk_object_is_a_400(start_gateway):
    """An object another local user owns is refused (the gateway, here root, could open it
    with its own rights); an object truncated after registering answers 400 on use, and the
    gateway keeps serving (copies are pread/pwrite: a mapping would have faulted it)."""
    gw = await start_gateway(tokens=(ADMIN, ALICE))
    await gw.deploy(doubler_spec())
    register = f"{gw.url}/v2/systemsharedmemory/region/{{}}/register"
    with _regions(("theirs", 64), ("mine", 64)) as regions:
        os.chown(f"/dev/shm{_key('theirs')}", 65534, 65534)  # nobody's, as if nobody made it
        body = {"key": _key("theirs"), "offset": 0, "byte_size": 64}
        async with gw.session.post(register.format("theirs"), json=body, headers=_auth(ALICE)) as r:
            doc = await r.json()
            assert r.status == 400 and "belongs to uid 65534" in doc["error"], doc
        body = {"key": _key("mine"), "offset": 0, "byte_size": 64}
        async with gw.session.post(register.format("mine"), json=body, headers=_auth(ALICE)) as r:
            assert r.status == 200, await r.text()
        shm.set_shared_memory_region(regions["mine"], [np.ones(4, np.float32)])
        os.truncate(f"/dev/shm{_key('mine')}", 8)
        infer = {
            "inputs": [{
                "name": "x", "datatype": "FP32", "shape": [4],
                "parameters": {"shared_memory_region": "mine", "shared_memory_byte_size": 16},
            }]
        }  # fmt: skip
        async with gw.session.post(
            f"{gw.url}/v2/models/doubler/infer", json=infer, headers=_auth(ALICE)
        ) as r:
            doc = await r.json()
            assert r.status == 400 and "shrank to 8 bytes" in doc["error"], doc
        status, _, _ = await gw.invoke("doubler", b"still serving", _auth(ALICE))
        assert status == 200


class _HostBuffer:
    """Stands in for a CUDA IPC buffer where there is no GPU (the driver calls themselves run
    in the GPU kit): the bytes a device buffer would hold, and the calls the gateway made."""

    def __init__(self, device_id: int, raw: bytes, size: int) -> None:
        self.raw, self.device_id, self.data, self.closed = raw, device_id, bytearray(size), False

    def read(self, offset: int, size: int) -> bytes:
        return bytes(self.data[offset : offset + size])

    def write(self, offset: int, data: bytes) -> None:
        self.data[offset : offset + len(data)] = data

    def close(self) -> None:
        self.closed = True


async def test_cuda_regions_carry_inputs_and_outputs_by_reference(start_gateway):
    """The CUDA extension end to end through tritonclient, the device buffer stood in for:
    registration parses Triton's body, infer reads and writes by region name, regions belong
    to their token and are bounds-checked, unregister closes the buffer."""
    gw = await start_gateway(tokens=(ADMIN, ALICE, BOB))
    await gw.deploy(doubler_spec())
    opened: list[_HostBuffer] = []

    def opener(device_id: int, raw: bytes, size: int) -> _HostBuffer:
        opened.append(_HostBuffer(device_id, raw, size))
        return opened[-1]

    gw.app[SHM].cuda = CudaSharedMemoryRegistry(opener=opener)
    await asyncio.to_thread(_cuda_round_trip, gw.url, opened)


def _cuda_round_trip(url: str, opened: list[_HostBuffer]) -> None:
    client = _client(url)
    alice, bob = _auth(ALICE), _auth(BOB)
    handle = base64.b64encode(bytes(range(64)))
    try:
        client.register_cuda_shared_memory("dev", handle, 0, 64, headers=alice)
        (buffer,) = opened
        assert buffer.raw == bytes(range(64)) and buffer.device_id == 0
        assert client.get_cuda_shared_memory_status(headers=alice) == [
            {"name": "dev", "device_id": 0, "byte_size": 64}
        ]
        assert client.get_cuda_shared_memory_status(headers=bob) == []
        x = np.arange(4, dtype=np.float32)
        buffer.write(0, x.tobytes())
        xin = httpclient.InferInput("x", [4], "FP32")
        xin.set_shared_memory("dev", 16)
        yout = httpclient.InferRequestedOutput("y")
        yout.set_shared_memory("dev", 16, offset=32)
        result = client.infer("doubler", [xin], outputs=[yout], headers=alice)
        assert result.get_output("y")["parameters"]["shared_memory_region"] == "dev"
        np.testing.assert_array_equal(np.frombuffer(buffer.read(32, 16), np.float32), x * 2)
        assert "no system shared-memory region named 'dev'" in _error(
            client.infer, "doubler", [xin], outputs=[yout], headers=bob
        )
        past = httpclient.InferInput("x", [4], "FP32")
        past.set_shared_memory("dev", 16, offset=56)
        assert "run past region dev" in _error(
            client.infer, "doubler", [past], outputs=[yout], headers=alice
        )
        for bad, message in [
            (base64.b64encode(bytes(8)), "a CUDA IPC handle (cudaIpcMemHandle_t) is 64"),
            (b"not base64!", "not base64"),
        ]:
            assert message in _error(
                client.register_cuda_shared_memory, "bad", bad, 0, 64, headers=alice
            )
        client.unregister_cuda_shared_memory("dev", headers=alice)
        assert buffer.closed
        assert client.get_cuda_shared_memory_status(headers=alice) == []
    finally:
        client.close()
