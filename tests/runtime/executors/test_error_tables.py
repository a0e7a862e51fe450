"""The container executors' library error tables: each client error as the trims error that
says what to do (the Kubernetes client's exceptions built as the client builds them)."""

from __future__ import annotations

import json

import pytest

from trims.errors import AlreadyExists, NotFound, PermissionDenied, Unavailable, ValidationError

client_exceptions = pytest.importorskip("kubernetes.client.exceptions")


def _api_error(status: int, message: str) -> Exception:
    error = client_exceptions.ApiException(status=status, reason="Reason")
    error.body = json.dumps({"message": message})
    return error


@pytest.mark.parametrize(
    ("status", "error", "says"),
    [
        (404, NotFound, 'read pod p: pods "p" not found'),
        (409, AlreadyExists, 'read pod p: pods "p" not found'),
        (403, PermissionDenied, "grant the gateway's service account the chart's pod role"),
        (422, ValidationError, "the API server rejected it"),
        (500, Unavailable, 'API server error 500: pods "p" not found'),
    ],
)
async def test_api_errors(status: int, error: type[Exception], says: str) -> None:
    from trims.runtime.executors.kubernetes import _call

    def fail() -> None:
        raise _api_error(status, 'pods "p" not found')

    with pytest.raises(error, match=says.replace("(", r"\(")) as info:
        await _call("read pod p", fail)
    assert isinstance(info.value.__cause__, client_exceptions.ApiException)


async def test_an_unreachable_api_server_is_unavailable() -> None:
    from trims.runtime.executors.kubernetes import _call

    def fail() -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(Unavailable, match="cannot reach the Kubernetes API server"):
        await _call("list pods", fail)


docker_errors = pytest.importorskip("docker.errors")


@pytest.mark.parametrize(
    ("error", "expected", "says"),
    [
        (docker_errors.ImageNotFound("no such image", explanation="trims-runtime:x"), NotFound,
         "image not found .trims-runtime:x.; build it with 'bash dockerfiles/build-image.sh"),
        (docker_errors.NotFound("gone", explanation="No such container: c"), NotFound,
         "No such container: c"),
        (docker_errors.DockerException("Error while fetching server API version"), Unavailable,
         "cannot reach the Docker Engine .* start dockerd or set DOCKER_HOST"),
    ],
)  # fmt: skip
async def test_engine_errors(error: Exception, expected: type[Exception], says: str) -> None:
    from trims.runtime.executors.docker import _call

    def fail() -> None:
        raise error

    with pytest.raises(expected, match=says):
        await _call("start container c", fail)
