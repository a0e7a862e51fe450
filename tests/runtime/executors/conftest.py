"""Fixtures for the executor tests: docker ones (tests/fixtures/docker.py) and a Kubernetes API
server whose kubelet runs pods as processes (tests/fixtures/kube_api.py)."""

from tests.fixtures.docker import docker_client, docker_executor, runtime_image
from tests.fixtures.kube_api import kube_api

__all__ = ["docker_client", "docker_executor", "kube_api", "runtime_image"]
