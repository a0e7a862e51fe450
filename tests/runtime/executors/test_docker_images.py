"""Which image a docker function runs, and the deploy-time check of what that image imports.

The selection is pure (no engine). The refusals read real images' labels from the real Docker
Engine; the end-to-end tests serve a torch and an MXNet function on the ``trims-runtime:torch``
and ``:mxnet`` images that dockerfiles/build-image.sh builds (the ``framework_image`` fixture;
.ci/run builds them first).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from tests.fixtures.docker import framework_image
from trims.errors import ValidationError
from trims.runtime.executors.docker import (
    LABEL_FRAMEWORKS,
    LABEL_FUNCTION,
    DockerExecutor,
    DockerExecutorSettings,
    image_for,
)
from trims.runtime.functions.spec import FunctionSpec, parse_spec

__all__ = ["framework_image"]

MakeExecutor = Callable[..., DockerExecutor]
MakeFunction = Callable[..., FunctionSpec]


def spec_with(*frameworks: str, image: str | None = None) -> FunctionSpec:
    models = [{"name": f"m{i}", "framework": f} for i, f in enumerate(frameworks)]
    data: dict[str, Any] = {"name": "fn", "handler": "h:f", "models": models}
    if image is not None:
        data["image"] = image
    return parse_spec(data)


@pytest.mark.parametrize(
    ("frameworks", "image"),
    [
        ((), "trims-runtime:latest"),
        (("numpy",), "trims-runtime:latest"),
        (("torch",), "trims-runtime:torch"),
        (("torch", "numpy", "torch"), "trims-runtime:torch"),
        (("onnxruntime",), "trims-runtime:onnx"),
        (("mxnet",), "trims-runtime:mxnet"),
        (("onnxruntime", "torch"), "trims-runtime:all"),
    ],
)
def test_the_image_follows_the_models_frameworks(frameworks: tuple[str, ...], image: str) -> None:
    assert image_for(spec_with(*frameworks), DockerExecutorSettings()) == image


def test_a_named_image_wins_and_a_repository_of_none_means_the_default_image() -> None:
    settings = DockerExecutorSettings()
    assert image_for(spec_with("torch", image="mine:1"), settings) == "mine:1"
    own = DockerExecutorSettings(image="reg.example/fn:2", image_repository=None)
    assert image_for(spec_with("torch"), own) == "reg.example/fn:2"
    moved = DockerExecutorSettings(image_repository="reg.example/trims-runtime")
    assert image_for(spec_with("onnxruntime"), moved) == "reg.example/trims-runtime:onnx"


def test_mxnet_beside_another_framework_has_no_image_and_says_what_to_do() -> None:
    with pytest.raises(ValidationError, match="function of their own") as caught:
        image_for(spec_with("mxnet", "torch"), DockerExecutorSettings())
    assert caught.value.details["field"] == "models"


@pytest.mark.docker
def test_deploy_refuses_an_image_whose_label_lacks_the_module(
    docker_executor: MakeExecutor, runtime_image: str, docker_client: Any
) -> None:
    label = docker_client.images.get(runtime_image).labels[LABEL_FRAMEWORKS]
    assert "torch" not in label.split(",")
    executor = docker_executor()
    with pytest.raises(ValidationError) as caught:
        executor.check(spec_with("torch", image=runtime_image))
    message = str(caught.value)
    assert "cannot import module 'torch'" in message and "m0 (torch)" in message
    assert "trims-runtime:torch" in message and "build-image.sh torch" in message
    assert caught.value.details["field"] == "image"
    executor.check(spec_with("onnxruntime", image=runtime_image))  # what it has passes


@pytest.mark.docker
def test_deploy_refuses_a_framework_image_that_is_not_built(docker_executor: MakeExecutor) -> None:
    executor = docker_executor(image_repository="trims-test-never-built")
    with pytest.raises(ValidationError) as caught:
        executor.check(spec_with("torch"))
    message = str(caught.value)
    assert "image trims-test-never-built:torch is not on this Docker host" in message
    assert "build-image.sh torch" in message
    with pytest.raises(ValidationError, match=r"build-image\.sh all'"):
        executor.check(spec_with(image="trims-test-never-built:all"))
    with pytest.raises(ValidationError, match="pull or build it"):
        executor.check(spec_with(image="trims-test-never-built-elsewhere:1"))


@pytest_asyncio.fixture
async def gateway(
    docker_executor: MakeExecutor, start_daemon: Callable[..., Any], tmp_path: Path
) -> AsyncIterator[tuple[str, Any]]:
    """A gateway on the docker executor and a daemon holding the 4x3 matrix ``lin``."""
    from aiohttp import web

    from trims.runtime.gateway.app import create_app
    from trims.runtime.settings import GatewaySettings

    weights = np.arange(12, dtype=np.float32).reshape(4, 3)
    daemon = start_daemon(models={"lin": {"w": weights}})
    settings = GatewaySettings(port=0, store_socket=daemon.socket, drain_timeout_s=5.0, auth=False)
    app = create_app(settings, lambda name: docker_executor(store_socket=daemon.socket))
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", weights
    finally:
        await runner.cleanup()


#: framework -> (handler computing w @ x on the framework's tensors over the mapping, the
#: image's frameworks label, the version the image holds)
SERVED = {
    "torch": (
        """
import torch

def handler(request, ctx):
    w = ctx.models["lin"].torch()["w"]
    x = torch.tensor(request.json()["x"], dtype=torch.float32)
    return {"y": (w @ x).tolist(), "version": torch.__version__}
""",
        "numpy,torch",
        "2.13.0+cpu",
    ),
    "mxnet": (
        """
import mxnet as mx

def handler(request, ctx):
    w = ctx.models["lin"].mxnet()["w"]
    x = mx.nd.array(request.json()["x"])
    return {"y": mx.nd.dot(w, x).asnumpy().tolist(), "version": mx.__version__}
""",
        "mxnet,numpy",
        "1.9.1",
    ),
}


@pytest.mark.docker
@pytest.mark.parametrize("framework", sorted(SERVED))
async def test_a_framework_function_is_served_on_its_image(
    framework: str,
    gateway: tuple[str, Any],
    make_function: MakeFunction,
    framework_image: Callable[[str], str],
    runtime_image: str,
    docker_client: Any,
) -> None:
    import aiohttp

    code, label, version = SERVED[framework]
    image = framework_image(framework)
    assert docker_client.images.get(image).labels[LABEL_FRAMEWORKS] == label
    url, weights = gateway
    name = f"lin-{framework}"
    spec = make_function(code, name=name, models=[{"name": "lin", "framework": framework}])
    body = {**spec.to_dict(), "executor": "docker"}
    async with aiohttp.ClientSession() as session:
        # the default image cannot import the framework: refused at deploy, nothing started
        refused = {**body, "name": f"{name}-default", "image": runtime_image}
        async with session.put(f"{url}/v1/functions/{name}-default", json=refused) as r:
            text = await r.text()
            assert r.status == 422, text
            assert f"cannot import module '{framework}'" in text and image in text
        async with session.put(f"{url}/v1/functions/{name}", json=body) as r:
            assert r.status in (200, 201), await r.text()
        async with session.post(f"{url}/v1/functions/{name}/invoke", json={"x": [1, 0, 2]}) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        containers = docker_client.containers.list(filters={"label": f"{LABEL_FUNCTION}={name}"})
        assert [c.image.tags for c in containers] == [[image]]
    assert answer["y"] == (weights @ np.array([1, 0, 2], dtype=np.float32)).tolist()
    assert answer["version"] == version
