"""The GPU check kit: every GPU path of trims, time-boxed, in one run (``bench/gpu_check.sh``).

    bash bench/gpu_check.sh                  # results in gpu-check-out/
    OUT=dir bash bench/gpu_check.sh          # results in dir/
    python bench/gpu_check.py --plan         # the steps and their time boxes; runs nothing
    python bench/gpu_check.py --only gpu-tier,pytest-gpu
    python bench/gpu_check.py --fetch-wheels .whl   # where PyPI is reachable, for offline GPUs

Steps run in order of value, each in its own process group under its time box, all within
``--budget`` seconds (480): the device, setup (see Note [installing on a GPU machine with no
index] in gpu_check_install.py), the GPU tier end to end, a CUDA torch if one is missing and an
index is reachable, torch ``cuda_tensors`` from the store, ``pytest -m gpu``, the four kernel
studies on CuPy, and four processes sharing one GPU-tier model. After every step
``$OUT/gpu-check.json`` is rewritten (atomically)::

    {"device": {...}, "budget_s": 480,
     "steps": [{"step", "status": "passed"|"failed"|"skipped"|"timeout", "seconds",
                "figures": {...}, "detail"}]}

Every step's output is appended to ``$OUT/gpu-check.log``; the kernels' JSON and the GPU tests'
JUnit XML sit beside it (seven files in all). Exit status: 0 when no step failed or timed out
(on a machine without an NVIDIA device every step is skipped, so 0), 1 otherwise, 2 for a
usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_check_figures as figures_of
import gpu_check_install as setup

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
DEFAULT_BUDGET_S = 480.0
#: A step is not started with less than this left of the budget.
MIN_STEP_S = 5.0

Outcome = dict[str, Any]


@dataclass
class Run:
    """One run of the kit: where it writes, which Python it drives, and what it found."""

    out: Path
    python: str
    work: Path
    log: IO[str]
    wheels: Path | None
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    device: dict[str, Any] = field(default_factory=dict)
    results: list[Outcome] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def summary(self) -> dict[str, Any]:
        return {"device": self.device, "budget_s": self.budget_s, "steps": self.results}

    def write(self) -> None:
        write_atomic(self.out / "gpu-check.json", json.dumps(self.summary(), indent=1) + "\n")

    def command(self, cmd: Sequence[str], deadline: float) -> tuple[int | None, str]:
        """Run ``cmd`` in its own process group, output into the log; (status, or None when it
        ran past ``deadline`` and was killed; its last line of output)."""
        self.log.write(f"$ {' '.join(cmd)}\n")
        self.log.flush()
        start = self.log.tell()
        proc = subprocess.Popen(
            list(cmd),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            rc: int | None = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        _kill_group(proc)
        with open(self.log.name, errors="replace") as f:
            f.seek(start)
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        self.log.write(f"(exit {rc if rc is not None else 'timeout'})\n")
        self.log.flush()
        return rc, (lines[-1] if lines else "(no output)")[:300]


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """End what the step left running (daemons, holders): SIGTERM, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            time.sleep(0.2)  # members of the group other than the leader get their moment
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def write_atomic(path: Path, text: str) -> None:
    """Temp file, fsync, rename. (Not trims.config.write_atomic: the summary must be written
    also when the project does not import, which is one of the things this kit reports.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- the steps ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    name: str
    box_s: float
    what: str
    run: Callable[[Run, float], Outcome]


def outcome(status: str, detail: str, **figures: Any) -> Outcome:
    return {"status": status, "figures": figures, "detail": detail}


def step_device(run: Run, deadline: float) -> Outcome:
    run.device = setup.detect_device(deadline - time.monotonic())
    if "error" in run.device:
        return outcome("skipped", f"skipped: {run.device['error']}")
    return outcome(
        "passed",
        f"{run.device.get('name')}, driver {run.device.get('driver')}, "
        f"CUDA {run.device.get('cuda')}",
    )


def step_install(run: Run, deadline: float) -> Outcome:
    result = setup.install(run.python, REPO, run.device, run.wheels, deadline)
    if result["failed"]:
        return {
            "status": "failed",
            "figures": result["figures"],
            "detail": "could not install "
            + "; ".join(result["failed"])
            + " (offline GPU machine: fill a wheelhouse with --fetch-wheels and set WHEELS)",
        }
    return {"status": "passed", "figures": result["figures"], "detail": "the GPU paths import"}


def tier_step(check: str, *extra: str) -> Callable[[Run, float], Outcome]:
    def step(run: Run, deadline: float) -> Outcome:
        result = run.work / f"{check}.json"
        rc, last = run.command(
            [
                run.python,
                str(BENCH / "gpu_tier_check.py"),
                check,
                "--work",
                str(run.work / check),
                "--json",
                str(result),
                *extra,
            ],
            deadline,
        )
        if rc is None:
            return outcome("timeout", f"{check} check ran past its time box; see gpu-check.log")
        if not result.exists():
            return outcome("failed", f"{check} check exited {rc} without a result: {last}")
        doc: Outcome = json.loads(result.read_text())
        return doc

    return step


def step_torch_install(run: Run, deadline: float) -> Outcome:
    has, what = setup.cuda_torch(run.python, deadline - time.monotonic())
    if has:
        return outcome("skipped", f"skipped: a CUDA torch is here ({what})")
    if not setup.index_reachable(run.python, min(20.0, deadline - time.monotonic())):
        return outcome("skipped", f"skipped: pip cannot reach an index ({what}, no CUDA)")
    ok, how = setup.pip_install(run.python, ["torch"], None, deadline)
    has, what = setup.cuda_torch(run.python, 60)
    if ok and has:
        return outcome("passed", f"installed {what} {how}")
    return outcome("failed", f"no CUDA torch after pip install torch ({what}; {how})")


def gpu_test_files() -> list[str]:
    """The test modules that hold GPU tests (marked ``gpu``)."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text(errors="replace")
    )


def step_pytest(run: Run, deadline: float) -> Outcome:
    xml = run.out / "pytest-gpu.xml"
    xml.unlink(missing_ok=True)
    files = gpu_test_files()
    cmd = [run.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rs",
           "--timeout=120", f"--junitxml={xml}", *files]  # fmt: skip
    rc, last = run.command(cmd, deadline)
    figures = junit_figures(xml)
    if rc is None:
        return {"status": "timeout", "figures": figures, "detail": "pytest ran past its time box"}
    if not figures:
        return outcome("failed", f"pytest exited {rc} and wrote no report: {last}")
    ran = figures["tests"] - figures["skipped"]
    failed = figures["failed_tests"]
    detail = f"{last} ({len(files)} modules)"
    if failed:
        detail += "; failed: " + ", ".join(failed)
    if rc == 0 and ran == 0:  # on a GPU machine every GPU test should run
        reason = sorted(set(figures["skipped_tests"].values()))[0]
        detail = f"no GPU test ran ({figures['skipped']} skipped); first reason: {reason}"
        return {"status": "failed", "figures": figures, "detail": detail}
    return {"status": "passed" if rc == 0 else "failed", "figures": figures, "detail": detail}


def junit_figures(xml: Path) -> dict[str, Any]:
    """Counts, failed test names and skip reasons from pytest's JUnit XML."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError):
        return {}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    skipped: dict[str, str] = {}
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        for kind, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            child = case.find(kind)
            if child is None:
                continue
            counts[key] += 1
            if kind == "skipped":
                skipped[name] = (child.get("message") or "")[:200]
            else:
                failed.append(name)
    return {**counts, "failed_tests": failed, "skipped_tests": skipped}


#: study -> its arguments for a short run on one GPU (the real flags of kernels/cli.py).
KERNEL_ARGS: dict[str, tuple[str, ...]] = {
    "tcu": (
        "--backend",
        "cupy",
        "--min-log2",
        "24",
        "--max-log2",
        "24",
        "--segments",
        "16,256,0",
        "--repeat",
        "5",
    ),
    "klap": ("--backend", "cupy", "--repeat", "3"),
    "transfer": ("--gpu", "--no-ipc", "--min-log2", "22", "--max-log2", "26", "--repeat", "3"),
    "als": (
        "--backend",
        "cupy",
        "--dataset",
        "synthetic",
        "--factors",
        "64",
        "--iterations",
        "5",
        "--explicit-iterations",
        "5",
    ),
}


def kernel_step(study: str) -> Callable[[Run, float], Outcome]:
    def step(run: Run, deadline: float) -> Outcome:
        out = run.out / f"{study}.json"
        out.unlink(missing_ok=True)
        args = list(KERNEL_ARGS[study])
        note = ""
        if study == "als" and setup.missing_modules(run.python, ["implicit"], 30):
            args.append("--no-peer")
            note = " (implicit missing: no peer)"
        rc, last = run.command(
            [run.python, "-m", "trims", "kernels", study, *args, "--json", str(out)], deadline
        )
        if rc is None:
            return outcome("timeout", f"trims kernels {study} ran past its time box")
        if rc != 0 or not out.exists():
            return outcome("failed", f"trims kernels {study} exited {rc}: {last}")
        figures = figures_of.EXTRACT[study](json.loads(out.read_text()))
        return {"status": "passed", "figures": figures, "detail": f"{out.name}{note}"}

    return step


STEPS: tuple[Step, ...] = (
    Step("device", 20, "nvidia-smi: the device, its driver and CUDA version", step_device),
    Step(
        "install",
        120,
        "the project (editable, --no-deps), missing modules, CuPy for the "
        "driver's CUDA major; from WHEELS or the index",
        step_install,
    ),
    Step(
        "gpu-tier",
        90,
        "daemon with a GPU tier: VMM fd export, a second process reads the "
        "right bytes, a write through the read-only import refused, legacy cuda_ipc",
        tier_step("tier"),
    ),
    Step(
        "torch-install",
        180,
        "a CUDA torch, only when none is here and an index answers",
        step_torch_install,
    ),
    Step(
        "torch-tensors",
        60,
        "torch cuda_tensors over a GPU-tier lease equal the arrays",
        tier_step("torch"),
    ),
    Step(
        "pytest-gpu", 180, "pytest -m gpu on the modules holding GPU tests (JUnit XML)", step_pytest
    ),
    Step(
        "kernels-tcu",
        60,
        "trims kernels tcu --backend cupy (2^24, segments 16,256,full)",
        kernel_step("tcu"),
    ),
    Step("kernels-klap", 60, "trims kernels klap --backend cupy", kernel_step("klap")),
    Step(
        "kernels-transfer",
        60,
        "trims kernels transfer --gpu (2^22..2^26 bytes)",
        kernel_step("transfer"),
    ),
    Step(
        "kernels-als",
        90,
        "trims kernels als --backend cupy (synthetic, 5 iterations)",
        kernel_step("als"),
    ),
    Step(
        "oip-cuda-shm",
        60,
        "Triton's CUDA shared memory on a real gateway: x read from exported device memory, "
        "y = 2x written back into it",
        tier_step("cuda-shm"),
    ),
    Step(
        "share-4",
        90,
        "4 processes acquire one 1 GiB GPU-tier model: acquire time, device memory",
        tier_step("share", "--processes", "4", "--model-mb", "1024"),
    ),
)


def plan() -> str:
    lines = [f"{'step':<17} {'box':>5}  what", f"{'-' * 17} {'-' * 5}  {'-' * 40}"]
    lines += [f"{s.name:<17} {s.box_s:>4.0f}s  {s.what}" for s in STEPS]
    lines.append(
        f"total budget {DEFAULT_BUDGET_S:.0f}s (--budget); a step gets min(its box, what is left)"
    )
    return "\n".join(lines)


def table(results: Sequence[Outcome]) -> str:
    lines = [f"{'step':<17} {'status':<8} {'seconds':>8}  detail"]
    for r in results:
        lines.append(f"{r['step']:<17} {r['status']:<8} {r['seconds']:>8.1f}  {r['detail'][:90]}")
    return "\n".join(lines)


def find_cuda_runtime(run: Run) -> None:
    """Put the CUDA runtime's folders (toolkit, pip packages) on LD_LIBRARY_PATH for the steps
    after this one and the daemons they start: the legacy cuda_ipc path loads libcudart."""
    dirs = setup.cudart_dirs(run.python, 30)
    old = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    os.environ["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys([*dirs, *old]))
    run.device["cudart_dirs"] = dirs


def run_steps(run: Run, names: set[str] | None) -> None:
    for step in STEPS:
        if names is not None and step.name not in names:
            continue
        t0 = time.monotonic()
        if step.name != "device" and "error" in run.device:
            result = outcome("skipped", f"skipped: {run.device['error']}")
        elif step.name != "device" and run.left() < MIN_STEP_S:
            result = outcome("skipped", f"skipped: the {run.budget_s:.0f} s budget is spent")
        else:
            run.log.write(f"\n===== {step.name} =====\n")
            run.log.flush()
            deadline = time.monotonic() + min(step.box_s, max(run.left(), MIN_STEP_S))
            try:
                result = step.run(run, deadline)
            except Exception as e:  # a broken step is reported, and the next one runs
                result = outcome("failed", f"{type(e).__name__}: {e}")
        if step.name in ("device", "install") and "error" not in run.device:
            find_cuda_runtime(run)
        result = {"step": step.name, **result, "seconds": round(time.monotonic() - t0, 2)}
        run.results.append(result)
        run.write()
        print(
            f"{step.name:<17} {result['status']:<8} {result['seconds']:>7.1f}s  "
            f"{result['detail'][:100]}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run every GPU path of trims, time-boxed.")
    p.add_argument("--plan", action="store_true", help="print the steps and exit")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT") or "gpu-check-out"),
        help="results folder [$OUT or gpu-check-out]",
    )
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all steps")
    p.add_argument("--only", help="comma-separated step names (see --plan)")
    p.add_argument(
        "--python",
        default=os.environ.get("PYTHON") or sys.executable,
        help="the Python whose packages the steps use [$PYTHON or this one]",
    )
    p.add_argument(
        "--wheels",
        type=Path,
        default=Path(os.environ.get("WHEELS") or REPO / ".whl"),
        help="wheelhouse for offline installs [$WHEELS or .whl]",
    )
    p.add_argument(
        "--fetch-wheels",
        type=Path,
        metavar="DIR",
        help="download the wheelhouse into DIR (needs PyPI) and exit",
    )
    p.add_argument("--wheels-python", default="3.12", help="target Python of --fetch-wheels")
    args = p.parse_args(argv)
    if args.plan:
        print(plan())
        return 0
    if args.fetch_wheels:
        return setup.fetch_wheels(args.fetch_wheels, args.wheels_python)
    names = None
    if args.only:
        names = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = names - {s.name for s in STEPS}
        if unknown:
            p.error(f"unknown steps {sorted(unknown)}; --plan lists them")
        names.add("device")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="trims-gpu-check-"))
    try:
        with open(out / "gpu-check.log", "a") as log:
            run = Run(out, args.python, work, log, args.wheels, args.budget)
            run.write()
            run_steps(run, names)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + table(run.results))
    print(f"\nsummary: {out / 'gpu-check.json'}")
    bad = [r["step"] for r in run.results if r["status"] in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
