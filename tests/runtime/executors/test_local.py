"""The local executor with real zygote and worker processes: happy path and misbehaviour."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.unprivileged import writable_by_functions
from trims.errors import Timeout, UpstreamError, ValidationError
from trims.runtime.executors.base import Instance
from trims.runtime.executors.local import LocalExecutor, LocalInstance
from trims.runtime.functions.spec import FunctionSpec

MakeFunction = Callable[..., FunctionSpec]
StartInstance = Callable[..., Awaitable[Instance]]

ECHO = """
def handler(request, ctx):
    return request.body
"""


async def _invoke(instance: Instance, body: bytes = b"", timeout: float = 30.0) -> bytes:
    reply = await instance.invoke(body, {}, timeout=timeout, trace={})
    return reply.body


def _gone(pid: int) -> bool:
    """True when no process (not even a zombie) has this pid any more."""
    return not Path(f"/proc/{pid}").exists()


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "spawn"])
async def test_echo_round_trip(
    make_function: MakeFunction, start_instance: StartInstance, zygote: bool
) -> None:
    instance = await start_instance(make_function(ECHO), zygote=zygote)
    reply = await instance.invoke(b"\x00hello\xff", {"content-type": "x/y"}, timeout=30, trace={})
    assert (reply.status, reply.body) == (200, b"\x00hello\xff")
    assert reply.headers["content-type"] == "application/octet-stream"
    assert instance.alive() and instance.exit_reason is None
    with pytest.raises(ValidationError, match="serves no model"):
        await instance.infer({"x": np.zeros(1)}, timeout=30, trace={})


async def test_init_runs_once_and_config_and_headers_reach_the_handler(
    make_function: MakeFunction, start_instance: StartInstance, tmp_path: Path
) -> None:
    # The function runs as nobody under a root test run: give it a directory it may write.
    marker = writable_by_functions(tmp_path / "out") / "init-calls"
    spec = make_function(
        f"""
        from trims.runtime.functions import Response

        def init(ctx):
            with open({str(marker)!r}, "a") as f:
                f.write("x")
            ctx.state["greeting"] = ctx.config["greeting"]

        def handler(request, ctx):
            body = {{"greeting": ctx.state["greeting"], "got": request.json(),
                     "type": request.content_type, "fn": ctx.function}}
            return Response(status=201, body=__import__("json").dumps(body),
                            headers={{"x-fn": ctx.function}})
        """,
        name="greeter",
        config={"greeting": "hi"},
    )
    instance = await start_instance(spec)
    for i in range(3):
        reply = await instance.invoke(
            json.dumps({"i": i}).encode(), {"Content-Type": "application/json"},
            timeout=30, trace={},
        )  # fmt: skip
        assert reply.status == 201 and reply.headers["x-fn"] == "greeter"
        assert json.loads(reply.body) == {
            "greeting": "hi", "got": {"i": i}, "type": "application/json", "fn": "greeter"
        }  # fmt: skip
    assert marker.read_text() == "x"


async def test_async_handler_and_concurrent_requests(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        """
        import asyncio
        waiting = []

        async def handler(request, ctx):
            event = asyncio.Event()
            waiting.append(event)
            if len(waiting) == 2:
                for e in waiting:
                    e.set()
            await asyncio.wait_for(event.wait(), 20)
            return request.text().upper()
        """
    )
    instance = await start_instance(spec)
    replies = await asyncio.gather(_invoke(instance, b"a"), _invoke(instance, b"b"))
    assert replies == [b"A", b"B"]


async def test_sync_handlers_run_concurrently_up_to_the_concurrency(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        """
        import threading
        barrier = threading.Barrier(3, timeout=20)

        def handler(request, ctx):
            barrier.wait()
            return threading.current_thread().name
        """,
        scaling={"concurrency": 3},
    )
    instance = await start_instance(spec)
    names = await asyncio.gather(*(_invoke(instance) for _ in range(3)))
    assert len(set(names)) == 3


async def test_cpus_cap_the_framework_thread_pools(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        """
        import os

        def handler(request, ctx):
            return {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        """,
        resources={"cpus": 1.5},
        env={"MKL_NUM_THREADS": "1"},
    )
    instance = await start_instance(spec)
    assert json.loads(await _invoke(instance)) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "1"}


async def test_openmp_threads_wait_passively_unless_the_spec_says_otherwise(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    """Note [passive OpenMP threads]: instances sharing cores do not spin on them."""
    code = """
        import os

        def handler(request, ctx):
            return os.environ.get("OMP_WAIT_POLICY") or "unset"
        """
    default = await start_instance(make_function(code))
    assert await _invoke(default) == b"PASSIVE"
    chosen = await start_instance(make_function(code, env={"OMP_WAIT_POLICY": "ACTIVE"}))
    assert await _invoke(chosen) == b"ACTIVE"


async def test_trace_context_reaches_the_handler(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        """
        from opentelemetry import trace

        def handler(request, ctx):
            with ctx.tracer.start_as_current_span("inner"):
                span = trace.get_current_span().get_span_context()
            return {"trace_id": format(span.trace_id, "032x")}
        """
    )
    instance = await start_instance(spec)
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    reply = await instance.invoke(
        b"", {}, timeout=30, trace={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    )
    assert json.loads(reply.body) == {"trace_id": trace_id}


async def test_infer_round_trips_arrays(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        """
        def handler(request, ctx):
            return "use infer"

        def infer(inputs, ctx):
            return {"y": inputs["x"] * 2, "n": inputs["x"].sum(keepdims=True)}
        """,
        serves={
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
        },
    )
    instance = await start_instance(spec)
    x = np.arange(5, dtype=np.float32)
    out = await instance.infer({"x": x}, timeout=30, trace={})
    np.testing.assert_array_equal(out["y"], x * 2)
    assert out["n"].tolist() == [10.0]


async def test_handler_exception_and_garbage_are_upstream_errors(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        """
        from trims.errors import ValidationError

        def handler(request, ctx):
            kind = request.text()
            if kind == "raise":
                raise ValueError("bad pixel")
            if kind == "invalid":
                raise ValidationError("field x is missing")
            return object()
        """
    )
    instance = await start_instance(spec)
    with pytest.raises(UpstreamError, match="handler of fn raised ValueError: bad pixel"):
        await _invoke(instance, b"raise")
    with pytest.raises(ValidationError, match="field x is missing"):
        await _invoke(instance, b"invalid")
    with pytest.raises(UpstreamError, match="returned a object"):
        await _invoke(instance, b"garbage")
    assert instance.alive()


async def test_init_failure_reports_the_reason(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        """
        def init(ctx):
            raise RuntimeError("weights missing")

        def handler(request, ctx):
            return b""
        """
    )
    instance = await start_instance(spec, ready=False)
    with pytest.raises(UpstreamError, match="RuntimeError: weights missing"):
        await instance.wait_ready(30)
    assert instance.exit_reason is not None and "weights missing" in instance.exit_reason


async def test_import_error_of_the_handler_module_is_reported(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function("import no_such_module_anywhere\n")
    instance = await start_instance(spec, ready=False)
    with pytest.raises(UpstreamError, match="no_such_module_anywhere"):
        await instance.wait_ready(30)


CRASHER = """
import ctypes, os, time

def handler(request, ctx):
    kind = request.text()
    if kind == "exit":
        os._exit(3)
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "hang":
        time.sleep(3600)
    if kind == "alloc":
        block = bytearray(512 << 20)
        return str(len(block))
    return "ok"
"""


@pytest.mark.parametrize(
    ("kind", "reason"),
    [("exit", "exited with code 3"), ("segfault", "killed by SIGSEGV")],
)
async def test_crash_mid_request_names_the_reason(
    make_function: MakeFunction, start_instance: StartInstance, kind: str, reason: str
) -> None:
    instance = await start_instance(make_function(CRASHER, name="crasher"))
    assert isinstance(instance, LocalInstance)
    with pytest.raises(UpstreamError, match=f"instance .* of crasher died: {reason}"):
        await _invoke(instance, kind.encode())
    assert instance.exit_reason is not None and instance.exit_reason.startswith(reason)
    assert not instance.alive()
    await asyncio.sleep(0.1)
    assert _gone(instance.process.pid), "the crashed worker was not reaped"


async def test_kill_9_mid_request(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    instance = await start_instance(make_function(CRASHER, name="crasher"))
    assert isinstance(instance, LocalInstance)
    call = asyncio.ensure_future(_invoke(instance, b"hang"))
    await asyncio.sleep(0.2)
    os.kill(instance.process.pid, signal.SIGKILL)
    with pytest.raises(UpstreamError, match="died: killed by SIGKILL"):
        await call


async def test_hang_times_out_and_stop_ends_the_instance(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    executor = local_executor()
    instance = await executor.start(make_function(CRASHER, name="crasher"), "hang-1")
    await instance.wait_ready(30)
    with pytest.raises(Timeout, match=r"did not answer within 0\.3 s"):
        await _invoke(instance, b"hang", timeout=0.3)
    assert instance.alive()
    await executor.stop(instance, grace_s=5)
    assert not instance.alive()
    # The caller gave up on the hung request (CANCEL), so nothing is left to drain.
    assert instance.exit_reason == "exited with code 0"


async def test_memory_limit_kills_the_instance_with_the_reason(
    make_function: MakeFunction, start_instance: StartInstance
) -> None:
    spec = make_function(
        CRASHER, name="hog", resources={"memory": "128MiB"}, scaling={"concurrency": 8}
    )
    instance = await start_instance(spec)
    assert await _invoke(instance, b"small") == b"ok"
    with pytest.raises(UpstreamError, match="ran out of memory"):
        await _invoke(instance, b"alloc")
    assert isinstance(instance, LocalInstance)
    reason = await instance.wait_exit_reason(10)
    assert reason is not None and reason.startswith("out of memory (limit 128.0 MiB)")


async def test_sigterm_drains_in_flight_requests(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    spec = make_function(
        """
        import time

        def handler(request, ctx):
            time.sleep(0.5)
            return "done"
        """
    )
    executor = local_executor()
    instance = await executor.start(spec, "drain-1")
    await instance.wait_ready(30)
    call = asyncio.ensure_future(_invoke(instance))
    await asyncio.sleep(0.1)
    await executor.stop(instance, grace_s=20)
    assert await call == b"done"
    assert instance.exit_reason == "exited with code 0"
    assert isinstance(instance, LocalInstance) and not instance.log_path.exists()


async def test_close_stops_every_worker_and_the_zygote(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    executor = local_executor()
    spec = make_function(ECHO)
    instances = [await executor.start(spec, f"echo-{i}") for i in range(2)]
    for instance in instances:
        await instance.wait_ready(30)
    pids = [i.process.pid for i in instances if isinstance(i, LocalInstance)]
    assert len(executor.instances) == 2
    await executor.close()
    assert executor.instances == ()
    await asyncio.sleep(0.1)
    assert all(_gone(pid) for pid in pids)
    with pytest.raises(ValidationError, match="closed"):
        await executor.start(spec, "late")


async def test_image_only_functions_are_refused_with_the_fix(
    local_executor: Callable[..., LocalExecutor],
) -> None:
    from trims.runtime.functions.spec import parse_spec

    spec = parse_spec({"name": "boxed", "image": "registry.local/fn:1"})
    with pytest.raises(ValidationError, match="docker or kubernetes executor"):
        await local_executor().start(spec, "boxed-1")


async def test_zygote_children_inherit_preloaded_modules(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    spec = make_function(
        """
        import sys
        PRELOADED = "numpy.random" in sys.modules

        def handler(request, ctx):
            import numpy
            return {"preloaded": PRELOADED, "random": float(numpy.random.random())}
        """
    )
    executor = local_executor()
    a = await executor.start(spec, "a")
    b = await executor.start(spec, "b")
    await a.wait_ready(30)
    await b.wait_ready(30)
    ra, rb = json.loads(await _invoke(a)), json.loads(await _invoke(b))
    assert ra["preloaded"] and rb["preloaded"]
    assert ra["random"] != rb["random"], "forked workers share the zygote's random state"


async def test_a_warmed_up_zygote_forks_workers_that_run_multithreaded_kernels(
    make_function: MakeFunction,
    local_executor: Callable[..., LocalExecutor],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The zygote ran torch's kernels (Note [zygote warm-up]); its children must still get
    their own thread pools (Note [fork safety]): a pool inherited half-made would hang here."""
    pytest.importorskip("torch")
    spec = make_function(
        """
        import os
        import torch
        import torch.nn.functional as F

        def handler(request, ctx):
            torch.set_num_threads(2)
            y = F.linear(torch.ones(64, 512), torch.ones(512, 512))
            F.conv2d(torch.ones(1, 16, 32, 32), torch.ones(16, 16, 3, 3))
            return {"sum": float(y[0, 0]), "threads": torch.get_num_threads()}
        """
    )
    with caplog.at_level("INFO", logger="trims.runtime.executors.zygote"):
        instance = await local_executor(preload=("numpy", "torch")).start(spec, "warm")
        await instance.wait_ready(60)
    assert "preloaded (numpy, torch warmed up)" in caplog.text
    assert json.loads(await asyncio.wait_for(_invoke(instance), 60)) == {
        "sum": 512.0,
        "threads": 2,
    }


RUN_AS_HANDLER = """
import os
from trims.errors import TrimsError
from trims.runtime.client import StoreClient

def handler(request, ctx):
    try:
        StoreClient(os.environ["TRIMS_SOCKET"], timeout=5).evict("vec")
        admin = "allowed"
    except TrimsError as e:
        admin = type(e).__name__
    model = ctx.models["vec"]
    return {"uid": os.getuid(), "sum": float(model.numpy()["w"].sum()), "via": model.via,
            "admin": admin}
"""


@pytest.mark.skipif(os.getuid() != 0, reason="dropping to another user needs root")
async def test_run_as_drops_privileges_but_keeps_the_store(
    start_daemon: Callable[..., object], local_executor: Callable[..., LocalExecutor]
) -> None:
    """The worker connects to the store before dropping to ``nobody``; the admin socket
    (0600, the store's owner) stays out of the function's reach."""
    import pwd
    import shutil

    from trims.runtime.functions.spec import parse_spec

    daemon = start_daemon(models={"vec": {"w": np.ones(10, dtype=np.float32)}})
    code = Path(tempfile.mkdtemp(prefix="trims-runas-"))
    try:
        code.chmod(0o755)
        (code / "handler.py").write_text(RUN_AS_HANDLER)
        (code / "handler.py").chmod(0o644)
        spec = parse_spec(
            {"name": "whoami", "handler": "handler:handler", "code_dir": str(code),
             "models": [{"name": "vec"}]}
        )  # fmt: skip
        executor = local_executor(
            run_as="nobody",
            state_dir=None,
            store_socket=daemon.socket,  # type: ignore[attr-defined]
        )
        instance = await executor.start(spec, "whoami-1")
        await instance.wait_ready(30)
        reply = json.loads(await _invoke(instance))
        assert reply["uid"] == pwd.getpwnam("nobody").pw_uid
        assert (reply["sum"], reply["via"]) == (10.0, "store")
        assert reply["admin"] != "allowed"
        await executor.close()
    finally:
        shutil.rmtree(code, ignore_errors=True)


async def test_models_are_acquired_through_the_store_and_shared(
    start_daemon: Callable[..., object],
    make_function: MakeFunction,
    local_executor: Callable[..., LocalExecutor],
) -> None:
    weights = np.arange(1000, dtype=np.float32)
    daemon = start_daemon(models={"vec": {"w": weights}})
    spec = make_function(
        """
        def handler(request, ctx):
            model = ctx.models["v"]
            return {"sum": float(model.numpy()["w"].sum()), "via": model.via}
        """,
        models=[{"name": "vec", "alias": "v"}],
    )
    executor = local_executor(store_socket=daemon.socket)  # type: ignore[attr-defined]
    a = await executor.start(spec, "vec-a")
    b = await executor.start(spec, "vec-b")
    await a.wait_ready(30)
    await b.wait_ready(30)
    for instance in (a, b):
        assert json.loads(await _invoke(instance)) == {"sum": float(weights.sum()), "via": "store"}
    stats = daemon.request("stats")["result"]  # type: ignore[attr-defined]
    assert stats["leases"] >= 2
    await executor.stop(a, grace_s=5)
    await executor.stop(b, grace_s=5)


async def test_missing_model_fails_init_with_the_reason(
    store_daemon: object, make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    spec = make_function(ECHO, models=[{"name": "ghost"}])
    executor = local_executor(store_socket=store_daemon.socket)  # type: ignore[attr-defined]
    instance = await executor.start(spec, "ghost-1")
    with pytest.raises(UpstreamError, match="ghost"):
        await instance.wait_ready(30)


async def test_a_dead_zygote_takes_its_workers_and_is_replaced(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    executor = local_executor()
    spec = make_function(ECHO)
    first = await executor.start(spec, "first")
    await first.wait_ready(30)
    zygote = executor.zygote_pid
    assert zygote is not None
    os.kill(zygote, signal.SIGKILL)
    assert isinstance(first, LocalInstance)
    assert await first.wait_exit_reason(30) == "killed by SIGKILL"
    with pytest.raises(UpstreamError, match="died: killed by SIGKILL"):
        await _invoke(first)
    assert not first.alive()
    second = await executor.start(spec, "second")
    await second.wait_ready(30)
    assert await _invoke(second, b"again") == b"again"
    assert executor.zygote_pid != zygote
    await executor.stop(first)


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "spawn"])
async def test_stop_right_after_start(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor], zygote: bool
) -> None:
    executor = local_executor(zygote=zygote)
    instance = await executor.start(make_function(ECHO), "brief")
    await executor.stop(instance, grace_s=30)
    assert not instance.alive()
    assert instance.exit_reason in ("killed by SIGTERM", "exited with code 0")
    with pytest.raises(UpstreamError, match="died"):
        await instance.wait_ready(5)


async def test_worker_spans_are_exported_in_the_callers_trace(
    start_daemon: Callable[..., object],
    make_function: MakeFunction,
    local_executor: Callable[..., LocalExecutor],
) -> None:
    """Init and model spans join the trace that started the instance; request spans join the
    request's trace; both reach an OTLP/HTTP receiver."""
    from aiohttp import web
    from opentelemetry import trace
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[bytes] = []

    async def traces(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    start_trace, request_trace = "11" * 16, "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        port = runner.addresses[0][1]
        daemon = start_daemon(models={"vec": {"w": np.ones(4, dtype=np.float32)}})
        executor = local_executor(
            otlp_endpoint=f"http://127.0.0.1:{port}/v1/traces",
            store_socket=daemon.socket,  # type: ignore[attr-defined]
        )
        spec = make_function(ECHO, name="traced", models=[{"name": "vec"}])
        starter = trace.NonRecordingSpan(
            trace.SpanContext(
                int(start_trace, 16), 0x22, is_remote=True,
                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED),
            )
        )  # fmt: skip
        with trace.use_span(starter):
            instance = await executor.start(spec, "traced-1")
        await instance.wait_ready(30)
        await instance.invoke(
            b"x", {}, timeout=30, trace={"traceparent": f"00-{request_trace}-00f067aa0ba902b7-01"}
        )
        await executor.stop(instance, grace_s=20)
    finally:
        await runner.cleanup()
    spans: dict[str, str] = {}
    for body in received:
        export = ExportTraceServiceRequest.FromString(body)
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    spans[span.name] = span.trace_id.hex()
    assert spans["worker.init"] == spans["model.acquire"] == start_trace
    assert spans["handler traced"] == request_trace


async def test_a_zygote_that_cannot_start_falls_back_to_spawning(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    (tmp_path / "broken_framework.py").write_text("raise SystemExit('cannot initialise')\n")
    executor = local_executor(preload=("broken_framework",), env={"PYTHONPATH": str(tmp_path)})
    await executor.prepare()
    assert executor.zygote_pid is None
    instance = await executor.start(make_function(ECHO), "fallback")
    await instance.wait_ready(60)
    assert await _invoke(instance, b"still works") == b"still works"
