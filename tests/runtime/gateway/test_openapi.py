"""The OpenAPI document matches the running gateway (routes, and responses via schemathesis)."""

from __future__ import annotations

import asyncio

from tests.fixtures.gateway import echo_spec

#: Operations schemathesis drives. Deploying random specs is left out on purpose: a valid random
#: spec may ask for hundreds of min_instances; the functions tests cover deploy and update.
_NOT_GENERATED = {("POST", "/v1/functions"), ("PUT", "/v1/functions/{name}")}


async def test_document_lists_exactly_the_routes(start_gateway):
    gw = await start_gateway()
    async with gw.session.get(f"{gw.url}/openapi.json") as r:
        doc = await r.json()
    assert doc["openapi"].startswith("3.1")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served = {
        (route.method, route.resource.canonical)
        for route in gw.app.router.routes()
        if route.method != "HEAD"
        and route.resource is not None
        and not route.resource.canonical.startswith("/ui")  # HTML pages, not API operations
    }
    assert documented == served
    assert doc["components"]["schemas"]["FunctionSpec"]["properties"]["scaling"]


def _run_schemathesis(url: str) -> list[str]:
    import hypothesis
    import schemathesis
    from schemathesis.specs.openapi import checks

    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    selected = [
        checks.status_code_conformance,
        checks.content_type_conformance,
        checks.response_schema_conformance,
    ]
    for result in schema.get_all_operations():
        operation = result.ok()  # type: ignore[union-attr]
        if (operation.method.upper(), operation.path) in _NOT_GENERATED:
            continue

        @hypothesis.settings(
            max_examples=6,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        )
        @hypothesis.given(case=operation.as_strategy())
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=url, timeout=30)
            assert response.status_code < 500 or response.status_code in (502, 503, 504), (
                f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:200]}"
            )
            case.validate_response(response, checks=selected)

        try:
            check()
        except AssertionError as e:
            failures.append(f"{operation.method.upper()} {operation.path}: {e}")
        except Exception as e:
            failures.append(f"{operation.method.upper()} {operation.path}: {type(e).__name__}: {e}")
    return failures


async def test_schemathesis_finds_no_mismatch(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec())
    failures = await asyncio.to_thread(_run_schemathesis, gw.url)
    assert not failures, "\n\n".join(failures)
