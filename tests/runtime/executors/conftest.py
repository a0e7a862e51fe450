"""Fixtures for the executor tests: the docker ones live in tests/fixtures/docker.py."""

from tests.fixtures.docker import docker_client, docker_executor, runtime_image

__all__ = ["docker_client", "docker_executor", "runtime_image"]
