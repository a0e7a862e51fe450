"""The benchmark functions (kernel studies, model analyses) deployed on a real gateway.

The handlers run in real local workers, as a user deploys them: specs naming the packaged
handlers, requests through the gateway's invoke endpoint, answers and errors as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.runtime.gateway.conftest import ADMIN


async def test_kernel_study_and_model_analysis_as_functions(start_gateway, tmp_path: Path):
    gw = await start_gateway(tokens=(ADMIN,))
    await gw.deploy(
        {"name": "kernels", "handler": "trims.kernels.functions:handler",
         "scaling": {"request_timeout_s": 120}}
    )  # fmt: skip
    db = tmp_path / "analyses.sqlite"
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
