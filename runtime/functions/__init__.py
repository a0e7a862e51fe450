"""Functions: the spec (what a function is) and the handler contract (what its code sees)."""

from trims.runtime.functions.context import Context, Request, Response
from trims.runtime.functions.errors import ClientError
from trims.runtime.functions.spec import FunctionSpec, ModelRef, load_spec_file, parse_spec

__all__ = [
    "ClientError",
    "Context",
    "FunctionSpec",
    "ModelRef",
    "Request",
    "Response",
    "load_spec_file",
    "parse_spec",
]
