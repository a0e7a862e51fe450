"""Traced calls of a trims ONNX Runtime session: a profiled twin over the same weights.

No gateway here: the test activates a :class:`trims.tracing.active.ActiveTrace` as the worker
does around a traced call, runs the session, and reads what the trace collected. Profiles go
to the test's own temp dir (``tempfile.tempdir``), so a profile left behind is seen.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.models import MakeModel, anonymous_kib, small_cnn, store_layout
from trims.tracing.active import ActiveTrace, activate, current
from trims.tracing.levels import Level

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from trims.runtime.adapters import onnxruntime as ort_adapter  # noqa: E402


@pytest.fixture
def profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where ONNX Runtime profiles of this test go (empty again once collected)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _x(seed: int = 1) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((2, 3, 16, 16)).astype(np.float32)


def test_an_untraced_run_is_not_profiled(make_model: MakeModel, profile_dir: Path) -> None:
    shared = ort_adapter.session(store_layout(small_cnn(), make_model))
    assert current() is None
    shared.run(None, {"x": _x()})
    assert list(profile_dir.iterdir()) == []
    assert shared.session.end_profiling() == "", "the session itself never profiles"


def test_a_traced_call_runs_on_a_profiled_twin_and_hands_over_its_node_spans(
    make_model: MakeModel, profile_dir: Path
) -> None:
    shared = ort_adapter.session(store_layout(small_cnn(), make_model))
    plain = shared.run(None, {"x": _x()})[0]

    trace = ActiveTrace(Level.LAYER, process="worker 7")
    with activate(trace):
        traced = [shared.run(None, {"x": _x()})[0] for _ in range(2)]
        assert len(list(profile_dir.iterdir())) == 1, "one twin serves the whole call"
    assert current() is None
    assert all(t.tobytes() == plain.tobytes() for t in traced)

    (recording,) = trace.close()
    assert recording.error is None and recording.unavailable == {}
    setup, *layers = recording.spans
    assert (setup.name, setup.level) == ("profiled session test-model", Level.MODEL)
    assert setup.track[0] == "worker 7"
    assert {s.level for s in layers} == {Level.LAYER}
    assert all(s.track[0] == "worker 7" and s.start_ns >= setup.end_ns for s in layers)
    ops = [s.attributes["op_type"] for s in layers]
    assert ops.count("Conv") == 2 and ops.count("MatMul") == 2, ops
    assert list(profile_dir.iterdir()) == [], "the profile and its folder are removed"

    shared.run(None, {"x": _x()})
    assert list(profile_dir.iterdir()) == [], "after the traced call, runs are untraced again"


def test_deeper_levels_say_what_onnx_runtime_cannot_record(
    make_model: MakeModel, profile_dir: Path
) -> None:
    shared = ort_adapter.session(store_layout(small_cnn(), make_model))
    trace = ActiveTrace(Level.FULL, process="worker 7")
    with activate(trace):
        shared.run(None, {"x": _x()})
    (recording,) = trace.close()
    assert set(recording.unavailable) == {Level.LIBRARY, Level.KERNEL}
    assert "MLAS" in recording.unavailable[Level.LIBRARY]
    assert any(s.attributes.get("op_type") == "MatMul" for s in recording.spans)


def test_a_model_level_trace_does_not_profile(make_model: MakeModel, profile_dir: Path) -> None:
    shared = ort_adapter.session(store_layout(small_cnn(), make_model))
    trace = ActiveTrace(Level.MODEL, process="worker 7")
    with activate(trace):
        shared.run(None, {"x": _x()})
        assert list(profile_dir.iterdir()) == []
    assert trace.close() == []


def test_the_twin_maps_the_same_weights(make_model: MakeModel, profile_dir: Path) -> None:
    # 104 MiB of weights (see test_without_prepacking_the_session_copies_no_weights): a twin
    # that copied them would show as that much new anonymous memory while it is alive.
    mapping = store_layout(small_cnn(hidden=1 << 20), make_model)
    weights_kib = mapping.manifest.total_bytes // 1024
    shared = ort_adapter.session(mapping, prepack=False)
    x = _x()[:1]
    plain = shared.run(None, {"x": x})[0]
    trace = ActiveTrace(Level.LAYER, process="worker 7")
    before = anonymous_kib()
    with activate(trace):
        traced = shared.run(None, {"x": x})[0]
        grown = anonymous_kib() - before
    trace.close()
    assert grown < weights_kib // 4, f"the twin allocated {grown} KiB for {weights_kib} KiB"
    assert traced.tobytes() == plain.tobytes()


def test_a_twin_that_cannot_be_built_leaves_the_call_untraced(
    make_model: MakeModel, profile_dir: Path
) -> None:
    real = ort_adapter.session(store_layout(small_cnn(), make_model))
    broken = ort_adapter.SharedSession(
        real.session, {}, model="broken", source=b"not an onnx graph", options=ort.SessionOptions()
    )
    plain = real.run(None, {"x": _x()})[0]
    trace = ActiveTrace(Level.LAYER, process="worker 7")
    with activate(trace):
        first, second = (broken.run(None, {"x": _x()})[0] for _ in range(2))
    assert first.tobytes() == plain.tobytes() == second.tobytes()
    (recording,) = trace.close()
    assert recording.spans == []
    assert recording.error is not None
    assert "onnxruntime session of model broken failed to start" in recording.error
    assert list(profile_dir.iterdir()) == [], "the twin's profile folder is removed"


def test_a_model_loaded_directly_is_profiled_too(tmp_path: Path, profile_dir: Path) -> None:
    import onnx

    from trims.runtime.direct import DirectModel

    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), str(path))
    session = DirectModel("cnn", path).onnx_session()
    trace = ActiveTrace(Level.LAYER, process="worker 7")
    with activate(trace):
        session.run(None, {"x": _x()})
    (recording,) = trace.close()
    assert recording.spans[0].name == "profiled session cnn"
    assert "Conv" in {s.attributes.get("op_type") for s in recording.spans}
    assert list(profile_dir.iterdir()) == []


def test_a_session_its_maker_profiles_is_left_to_its_maker(
    make_model: MakeModel, profile_dir: Path
) -> None:
    from trims.tracing.sources.onnxruntime import collect, session_options

    shared = ort_adapter.session(
        store_layout(small_cnn(), make_model), sess_options=session_options(Level.LAYER)
    )
    trace = ActiveTrace(Level.LAYER, process="worker 7")
    with activate(trace):
        shared.run(None, {"x": _x()})
    assert trace.close() == []
    own = collect(shared.session, process="mine")
    assert own.error is None and any(s.attributes.get("op_type") == "Conv" for s in own.spans)
    assert list(profile_dir.iterdir()) == []


def test_two_sessions_of_one_model_each_get_their_twin(
    make_model: MakeModel, profile_dir: Path
) -> None:
    mapping = store_layout(small_cnn(), make_model)
    first, second = ort_adapter.session(mapping), ort_adapter.session(mapping, prepack=False)
    trace = ActiveTrace(Level.LAYER, process="worker 7")
    with activate(trace):
        for session in (first, second, first):
            session.run(None, {"x": _x()})
    recordings = trace.close()
    assert [r.spans[0].name for r in recordings] == ["profiled session test-model"] * 2
    convs = [sum(s.attributes.get("op_type") == "Conv" for s in r.spans) for r in recordings]
    assert convs == [2, 1]
