from __future__ import annotations

import numpy as np
import pytest

from trims.errors import UpstreamError
from trims.runtime.functions.context import Response
from trims.runtime.worker.results import check_outputs, to_reply


def test_supported_return_types_become_replies() -> None:
    assert to_reply("f", b"raw") == (200, {"content-type": "application/octet-stream"}, b"raw")
    assert to_reply("f", "text")[2] == b"text"
    assert to_reply("f", {"a": [1, 2]})[1:] == (
        {"content-type": "application/json"},
        b'{"a":[1,2]}',
    )
    assert to_reply("f", None) == (204, {}, b"")
    reply = to_reply("f", Response(b"x", status=201, headers={"x-k": "v"}))
    assert reply == (201, {"x-k": "v"}, b"x")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (object(), "returned a object; return bytes, str"),
        (42, "returned a int"),
        ({"a": {1, 2}}, "not JSON-serializable"),
        (Response(body=123), "body is a int"),  # type: ignore[arg-type]
        (Response(b"", status=99), "status 99"),
    ],
)
def test_garbage_return_values_are_upstream_errors(value: object, message: str) -> None:
    with pytest.raises(UpstreamError, match=message):
        to_reply("fn", value)


def test_infer_outputs_must_be_a_dict_of_arrays() -> None:
    assert check_outputs("f", {"y": np.zeros(2)})
    with pytest.raises(UpstreamError, match="return a dict"):
        check_outputs("f", [np.zeros(2)])
    with pytest.raises(UpstreamError, match="output 'y' as a str"):
        check_outputs("f", {"y": "nope"})
