"""The benchmark functions (kernel studies, model analyses) deployed on a real gateway.

The handlers run in real local workers, as a user deploys them: specs naming the packaged
handlers, requests through the gateway's invoke endpoint, answers and errors as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.fixtures.gateway import ADMIN
from tests.fixtures.unprivileged import writable_by_functions


async def test_kernel_study_and_model_analysis_as_functions(start_gateway, tmp_path: Path):
    gw = await start_gateway(tokens=(ADMIN,))
    await gw.deploy(
        {"name": "kernels", "handler": "trims.kernels.functions:handler",
         "scaling": {"request_timeout_s": 120}}
    )  # fmt: skip
    db = writable_by_functions(tmp_path / "db") / "analyses.sqlite"  # workers run as nobody
    await gw.deploy(
        {"name": "analyze", "handler": "trims.evaluation.functions:handler",
         "config": {"db": str(db)}, "scaling": {"request_timeout_s": 120}}
    )  # fmt: skip
    json_type = {"Content-Type": "application/json"}

    tcu = {"min_log2": 10, "max_log2": 10, "segments": [16], "repeat": 1}
    study = {"study": "tcu", "settings": tcu}
    status, _, body = await gw.invoke("kernels", json.dumps(study).encode(), json_type)
    assert status == 200, body
    assert json.loads(body)["study"] == "tcu"

    request = {"analysis": "bricks", "models": "squeezenet", "granularity": [5],
               "max_time": 0.05, "min_reps": 3}  # fmt: skip
    status, _, body = await gw.invoke("analyze", json.dumps(request).encode(), json_type)
    assert status == 200, body
    answer = json.loads(body)
    (model,) = answer["models"]
    assert model["name"] == "squeezenet" and model["estimated_ms"] > 0
    assert answer["by_granularity"][0]["unique_bricks"] > 0
    assert db.stat().st_size > 0  # the deployment's database holds the measurements

    # a request cannot choose where results go: a clear error, and the function keeps serving
    bad = {"analysis": "layers", "db": "/tmp/elsewhere.sqlite"}
    status, _, body = await gw.invoke("analyze", json.dumps(bad).encode(), json_type)
    assert 400 <= status < 500
    assert "unknown settings ['db']" in json.loads(body)["error"]["message"]
    status, _, body = await gw.invoke(
        "analyze", json.dumps({"analysis": "layers", "models": ["squeezenet"]}).encode(), json_type
    )
    assert status == 200 and json.loads(body)["models"][0]["name"] == "squeezenet"


async def test_the_analysis_function_reads_its_own_model_from_the_store(
    start_gateway, start_daemon, tmp_path: Path
):
    import onnx

    from trims.evaluation import zoo
    from trims.runtime.client import StoreClient

    daemon = start_daemon()
    source = tmp_path / "sq.onnx"
    onnx.save(zoo.materialize("squeezenet"), str(source))
    with StoreClient(daemon.socket) as admin:
        admin.add("sq", source)
    gw = await start_gateway(tokens=(ADMIN,), store_socket=daemon.socket)
    await gw.deploy(
        {"name": "analyze", "handler": "trims.evaluation.functions:handler",
         "models": [{"name": "sq"}], "config": {"db": str(tmp_path / "a.sqlite")},
         "scaling": {"request_timeout_s": 120}}
    )  # fmt: skip
    request = {"analysis": "layers", "models": ["store:sq", "squeezenet"]}
    status, _, body = await gw.invoke(
        "analyze", json.dumps(request).encode(), {"Content-Type": "application/json"}
    )
    assert status == 200, body
    mine, zoo_model = json.loads(body)["models"]
    assert mine["name"] == "store:sq"
    assert mine["flops"] == zoo_model["flops"] and mine["param_bytes"] == zoo_model["param_bytes"]
    assert len(mine["layers"]) == len(zoo_model["layers"])
