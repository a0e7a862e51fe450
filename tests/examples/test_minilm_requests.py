"""The minilm example refuses malformed requests with a ClientError that says what to send,
instead of failing (502) or embedding each character of a string."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import MappingProxyType, ModuleType

import pytest

from trims.runtime.functions import ClientError, Request

MINILM = Path(__file__).resolve().parents[2] / "examples" / "minilm"


@pytest.fixture(scope="module")
def handler_module() -> ModuleType:
    pytest.importorskip("torch")
    sys.path.insert(0, str(MINILM))
    try:
        spec = importlib.util.spec_from_file_location("minilm_handler", MINILM / "handler.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(MINILM))
    return module


def _json(doc: object) -> Request:
    headers = MappingProxyType({"content-type": "application/json"})
    return Request(json.dumps(doc).encode(), headers)


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"text": "a cat"}, "no 'texts'"),
        (["a cat"], "no 'texts'"),
        ({"texts": []}, "non-empty list"),
        ({"texts": "hi"}, "one string, not a list"),
        ({"texts": ["a", 3]}, "every item of 'texts' must be a string"),
    ],
)
def test_malformed_json_is_a_422_naming_the_shape(
    handler_module: ModuleType, doc: object, says: str
) -> None:
    with pytest.raises(ClientError) as refused:
        handler_module.request_texts(_json(doc))
    assert refused.value.status == 422
    assert says in refused.value.message and '{"texts": [' in refused.value.message


def test_well_formed_requests_give_their_texts(handler_module: ModuleType) -> None:
    assert handler_module.request_texts(_json({"texts": ["a", "b"]})) == ["a", "b"]
    plain = Request(b"a cat", MappingProxyType({"content-type": "text/plain"}))
    assert handler_module.request_texts(plain) == ["a cat"]
    binary = Request(b"\xff\xfe", MappingProxyType({}))
    with pytest.raises(ClientError) as refused:
        handler_module.request_texts(binary)
    assert refused.value.status == 400
