"""The image tests use the docker fixtures of tests/fixtures/docker.py."""

from tests.fixtures.docker import docker_client, framework_image, runtime_image

__all__ = ["docker_client", "framework_image", "runtime_image"]
