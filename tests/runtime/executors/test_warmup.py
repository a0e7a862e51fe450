"""The zygote's warm-up (Note [zygote warm-up]): kernel code mapped, no thread started."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

from trims.runtime.executors import warmup

# Run in a fresh interpreter: the test process may have used torch already (its kernels mapped,
# its OpenMP team started), which would hide what the warm-up does to a process that only
# imported the frameworks, as the zygote has.
FRESH_ZYGOTE = textwrap.dedent(
    """
    import json, os, sys
    import numpy, onnxruntime, torch
    import torch.nn.functional as F
    from trims.runtime.executors.warmup import ORT_MODEL, warm_up

    def text_kib(library):
        kib, inside = 0, False
        for line in open("/proc/self/smaps"):
            if "-" in line.split()[0]:
                inside = library in line
            elif inside and line.startswith("Rss:"):
                kib += int(line.split()[1])
        return kib

    def state():
        return {
            "threads": torch.get_num_threads(),
            "tasks": len(os.listdir("/proc/self/task")),
            "torch_kib": text_kib("libtorch_cpu.so"),
            "ort_kib": text_kib("onnxruntime_pybind11_state"),
        }

    before = state()
    warmed = warm_up(["numpy", "torch", "onnxruntime"])
    after = state()
    pid = os.fork()
    if pid == 0:
        # what a worker does on its first request: multi-threaded kernels in a child
        torch.set_num_threads(2)
        F.conv2d(torch.randn(1, 16, 32, 32), torch.randn(16, 16, 3, 3))
        F.linear(torch.randn(64, 512), torch.randn(512, 512))
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = 2
        session = onnxruntime.InferenceSession(ORT_MODEL, opts, providers=["CPUExecutionProvider"])
        session.run(None, {"x": numpy.ones((1, 4, 8, 8), dtype=numpy.float32)})
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"warmed": warmed, "before": before, "after": after, "child": status}))
    """
)


def test_warm_up_maps_the_kernels_code_without_starting_a_thread() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    done = subprocess.run(
        [sys.executable, "-c", FRESH_ZYGOTE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["warmed"] == ["numpy", "torch", "onnxruntime"]
    before, after = out["before"], out["after"]
    # the kernels' code is now in the zygote's page tables (MiBs of each library's text)
    assert after["torch_kib"] - before["torch_kib"] >= 1024, (before, after)
    assert after["ort_kib"] - before["ort_kib"] >= 1024, (before, after)
    # no OpenMP team (or any other thread) was started, and the thread count is as it was
    assert after["tasks"] == before["tasks"]
    assert after["threads"] == before["threads"]
    # a forked child then runs multi-threaded kernels (it would hang on a half-made pool)
    assert out["child"] == 0


def test_only_preloaded_frameworks_are_warmed_and_a_failure_is_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    def broken() -> None:
        raise RuntimeError("no kernels here")

    monkeypatch.setattr(
        warmup,
        "WARM_UPS",
        {
            "json": broken,
            "os": lambda: ran.append("os"),
            "sys": lambda: ran.append("sys"),
            "trims_absent_module": lambda: ran.append("absent"),
        },
    )
    with caplog.at_level(logging.WARNING, logger=warmup.__name__):
        # json fails, os runs, sys was not preloaded, the absent module is not imported
        assert warmup.warm_up(["json", "os", "trims_absent_module"]) == ["os"]
    assert ran == ["os"]
    assert "warm-up of json failed" in caplog.text


def test_the_onnx_runtime_warm_up_model_is_the_one_its_comment_describes() -> None:
    """ORT_MODEL is kept as bytes (the zygote does not import onnx); rebuilt here, it must match."""
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    def zeros(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(np.zeros(shape, dtype=np.float32), name)

    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w3", "b"], ["c3"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c3"], ["r3"]),
            helper.make_node("Conv", ["r3", "w1", "b"], ["c1"]),
            helper.make_node("Add", ["c1", "x"], ["s"]),
            helper.make_node("MaxPool", ["s"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
            helper.make_node("GlobalAveragePool", ["p"], ["g"]),
            helper.make_node("Flatten", ["g"], ["f"]),
            helper.make_node("Gemm", ["f", "fc", "b"], ["h"]),
            helper.make_node("Softmax", ["h"], ["y"]),
        ],
        "trims-warm-up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [zeros("w3", 4, 4, 3, 3), zeros("w1", 4, 4, 1, 1), zeros("b", 4), zeros("fc", 4, 4)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="trims"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    assert onnx.load_from_string(warmup.ORT_MODEL) == model
