"""Each read-only page against a seeded results database, served by a real gateway."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from tests.evaluation.ui.seed import SPAN_NAMES, Seeded
from tests.fixtures.ui import ADMIN, UIClient, deploy, page

Start = Callable[..., Awaitable[UIClient]]


def rows_of(html: str, table_id: str) -> list[str]:
    """The body rows of the table with this id, as HTML."""
    m = re.search(rf'<table id="{table_id}">(.*?)</table>', html, re.S)
    assert m, f"no table {table_id}"
    body = re.search(r"<tbody>(.*?)</tbody>", m.group(1), re.S)
    assert body
    return re.findall(r"<tr>(.*?)</tr>", body.group(1), re.S)


async def test_ui_redirects_to_its_slash_and_every_page_is_accessible_html(
    ui_gateway: Start,
) -> None:
    client = await ui_gateway()
    async with client.get("/ui", allow_redirects=False) as r:
        assert r.status == 308 and r.headers["Location"] == "/ui/"
    for path in ("/ui/", "/ui/evaluations", "/ui/traces", "/ui/layers", "/ui/run", "/ui/login"):
        async with client.get(path) as r:
            html = await r.text()
            assert r.status == 200, (path, html)
            assert "Content-Security-Policy" in r.headers and "'unsafe-eval'" not in html
            assert '<a class="skip-link" href="#content">' in html
            assert '<main id="content"' in html
            assert "<th>" not in html  # every header cell says its scope
            assert "<script" not in html  # no page needs JavaScript


async def test_overview_lists_deployed_functions_and_says_the_store_is_unreachable(
    ui_gateway: Start,
) -> None:
    client = await ui_gateway()
    await deploy(client, "evaluate", "evaluate", db="/nonexistent.sqlite")
    html = await page(client, "/ui/")
    (row,) = rows_of(html, "functions")
    assert ">evaluate</th>" in row and "uifuncs:evaluate" in row
    assert "0 / 0 / 1" in row  # none alive, none started, at most one
    assert 'http-equiv="refresh"' in html
    assert "did not answer" in html or "not reachable" in html


async def test_evaluations_list_shows_the_seeded_rows_newest_first(
    ui_gateway: Start, seeded: Seeded
) -> None:
    html = await page(await ui_gateway(), "/ui/evaluations")
    rows = rows_of(html, "evaluations")
    ids = [int(re.search(r'href="/ui/evaluations/(\d+)"', r).group(1)) for r in rows]  # type: ignore[union-attr]
    assert ids == sorted(seeded.ids, reverse=True)
    assert "digits-mlp" in rows[0] and "4,200.0" in rows[0] and "96.20%" in rows[0]
    assert "3 of 3 evaluations" in html


async def test_evaluations_filters_by_model_scenario_system_and_date(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway()
    html = await page(client, "/ui/evaluations?model=mnist-cnn-onnxruntime")
    assert len(rows_of(html, "evaluations")) == 2
    assert '<option value="mnist-cnn-onnxruntime" selected>' in html
    html = await page(client, "/ui/evaluations?model=mnist-cnn-onnxruntime&scenario=offline")
    (row,) = rows_of(html, "evaluations")
    assert f'href="/ui/evaluations/{seeded.ids[0]}"' in row
    assert len(rows_of(await page(client, "/ui/evaluations?system=Test"), "evaluations")) == 3
    html = await page(client, "/ui/evaluations?since=2999-01-01")
    assert 'id="evaluations"' not in html and "No evaluations match" in html
    html = await page(client, "/ui/evaluations?since=yesterday", status=422)
    assert "YYYY-MM-DD" in html


async def test_evaluation_detail_shows_loadgen_summary_latency_plot_and_accuracy(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway()
    html = await page(client, f"/ui/evaluations/{seeded.ids[0]}")
    assert "Result is : VALID" in html
    assert re.search(r'<svg role="img" aria-label="Per-query latency', html)
    assert html.count('id="latency-bar-0-') == 4  # p50, p90, p99, mean
    (acc,) = rows_of(html, "accuracy")
    assert "98.50%" in acc and "98.00%" in acc and "+0.50 points" in acc
    by_run_id = await page(client, f"/ui/evaluations/{seeded.run_ids[0][:13]}")
    assert seeded.run_ids[0] in by_run_id


async def test_unknown_evaluations_and_pages_are_404_pages(ui_gateway: Start) -> None:
    client = await ui_gateway()
    assert "no evaluation 999" in await page(client, "/ui/evaluations/999", status=404)
    assert "no evaluation &#39;ffffffff&#39;" in await page(
        client, "/ui/evaluations/ffffffff", status=404
    )
    await page(client, "/ui/no-such-page", status=404)
    await page(client, "/ui/traces/" + "0" * 32, status=404)
    await page(client, "/ui/traces/not-hex", status=404)


async def test_comparison_renders_bar_charts_scatter_and_models_by_scenarios(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway()
    query = "&".join(f"e={i}" for i in seeded.ids)
    html = await page(client, f"/ui/compare?{query}")
    assert html.count('id="qps-bar-0-') == 3
    assert html.count('id="tail-bar-0-') == 3 and html.count('id="tail-bar-1-') == 3  # p90, p99
    assert html.count('id="accuracy-point-') == 3
    grid = rows_of(html, "grid")
    assert [re.search(r'<th scope="row">([^<]+)', r).group(1) for r in grid] == [  # type: ignore[union-attr]
        "digits-mlp",
        "mnist-cnn-onnxruntime",
    ]
    assert "<td>–</td>" in grid[0]  # digits-mlp has no single-stream evaluation
    assert "310.0 QPS" in grid[1]
    assert "pick the evaluations" in await page(client, "/ui/compare", status=422)


async def test_trace_page_draws_the_span_tree_and_offers_the_chrome_trace(
    ui_gateway: Start, seeded: Seeded
) -> None:
    client = await ui_gateway()
    html = await page(client, "/ui/traces")
    (row,) = rows_of(html, "stored-traces")
    assert seeded.trace_id in row and "87.5%" in row
    html = await page(client, f"/ui/traces/{seeded.trace_id}")
    names = re.findall(r'class="span-name">([^<]+)</text>', html)
    assert tuple(names) == SPAN_NAMES
    depth = {
        n: int(x)
        for x, n in re.findall(r'<text x="(\d+)" y="\d+" font-size="12"[^>]*>([^<]+)<', html)
    }
    assert depth["gateway request"] < depth["model mnist-cnn"] < depth["cudnn conv kernel"]
    assert f'href="/ui/traces/{seeded.trace_id}?format=chrome"' in html
    async with client.get(f"/ui/traces/{seeded.trace_id}?format=chrome") as r:
        assert r.status == 200 and "attachment" in r.headers["Content-Disposition"]
        chrome = json.loads(await r.read())
    assert {e["name"] for e in chrome["traceEvents"] if e.get("ph") == "X"} == set(SPAN_NAMES)


async def test_layers_page_plots_bound_vs_measured_and_op_types(ui_gateway: Start) -> None:
    html = await page(await ui_gateway(), "/ui/layers")
    assert len(rows_of(html, "layer-results")) == 4
    (bound,) = rows_of(html, "bounds")
    assert "13.200" in bound and "10.000" in bound  # trimmed mean 12*1.1; best 5+1+4
    assert html.count('id="bounds-bar-') == 2
    assert html.count('id="ops-bar-') == 3  # Conv, Gemm, Relu for one model
    html = await page(await ui_gateway(), "/ui/layers?kind=model")
    assert len(rows_of(html, "layer-results")) == 1


async def test_a_missing_database_is_an_empty_state_not_an_error(
    ui_gateway: Start, tmp_path: Path
) -> None:
    client = await ui_gateway(results_db=str(tmp_path / "absent.sqlite"))
    for path in ("/ui/evaluations", "/ui/traces", "/ui/layers"):
        html = await page(client, path)
        assert "no results database at" in html
    await page(client, "/ui/evaluations/1", status=404)
    assert not (tmp_path / "absent.sqlite").exists()  # read-only: never created


async def test_a_trace_the_gateway_keeps_is_listed_drawn_and_downloadable(
    ui_gateway: Start,
) -> None:
    client = await ui_gateway()
    await deploy(client, "echo", "echo")
    async with client.post(
        "/v1/functions/echo/invoke", data=b"hi", headers={"trims-trace-level": "model"}
    ) as r:
        assert r.status == 200, await r.text()
        trace_id = r.headers["trims-trace-id"]
    (row,) = rows_of(await page(client, "/ui/traces"), "kept-traces")
    assert f'<a href="/ui/traces/{trace_id}"><code>{trace_id}</code></a>' in row
    assert "<td>echo</td><td>model</td>" in row
    html = await page(client, f"/ui/traces/{trace_id}")
    assert "kept by the gateway" in html and 'class="span-name">' in html
    async with client.get(f"/ui/traces/{trace_id}?format=chrome") as r:
        assert r.status == 200 and (await r.json())["traceEvents"]


async def test_kept_traces_need_the_trace_scope(ui_gateway: Start) -> None:
    html = await page(
        await ui_gateway(tokens=(ADMIN,), anonymous_scopes=frozenset({"read"})), "/ui/traces"
    )
    assert "needs the trace scope" in html and 'id="stored-traces"' in html
