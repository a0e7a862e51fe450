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
