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
    import numpy, torch
    import torch.nn.functional as F
    from trims.runtime.executors.warmup import warm_up

    def torch_text_kib():
        kib, inside = 0, False
        for line in open("/proc/self/smaps"):
            if "-" in line.split()[0]:
                inside = line.rstrip().endswith("libtorch_cpu.so")
            elif inside and line.startswith("Rss:"):
                kib += int(line.split()[1])
        return kib

    tasks = lambda: len(os.listdir("/proc/self/task"))
    before = {"threads": torch.get_num_threads(), "tasks": tasks(), "rss": torch_text_kib()}
    warmed = warm_up(["numpy", "torch"])
    after = {"threads": torch.get_num_threads(), "tasks": tasks(), "rss": torch_text_kib()}
    pid = os.fork()
    if pid == 0:
        # what a worker does on its first request: multi-threaded kernels in a child
        torch.set_num_threads(2)
        F.conv2d(torch.randn(1, 16, 32, 32), torch.randn(16, 16, 3, 3))
        F.linear(torch.randn(64, 512), torch.randn(512, 512))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"warmed": warmed, "before": before, "after": after, "child": status}))
    """
)


def test_warm_up_maps_the_kernels_code_without_starting_a_thread() -> None:
    pytest.importorskip("torch")
    done = subprocess.run(
        [sys.executable, "-c", FRESH_ZYGOTE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["warmed"] == ["numpy", "torch"]
    before, after = out["before"], out["after"]
    # the kernels' code is now in the zygote's page tables (a few MiB of libtorch_cpu's text)
    assert after["rss"] - before["rss"] >= 1024, (before, after)
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
