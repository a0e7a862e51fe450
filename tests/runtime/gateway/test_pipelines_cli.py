"""`trims pipelines` (runtime/pipelines_cli.py) and `trims functions --json` as real
subprocesses against a real gateway (here for its fixtures); the common options of `trims
functions`, `trims pipelines` and `trims models` after the action."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.fixtures.gateway import RunningGateway, echo_spec
from trims.cli import build_parser

PIPELINE_YAML = """\
name: shout
steps:
  - name: say
    function: echo
  - name: loud
    function: upper
    after: [say]
"""


async def trims(gw: RunningGateway, *args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "trims",
        *args,
        env={**env, "TRIMS_GATEWAY_URL": gw.url, "TRIMS_TOKEN": "unused"},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def ok(gw: RunningGateway, *args: str) -> str:
    code, out, err = await trims(gw, *args)
    assert code == 0, err
    assert "Traceback" not in err
    return out


async def test_pipeline_lifecycle(start_gateway: Any, tmp_path: Path) -> None:
    gw = await start_gateway()
    await gw.deploy(echo_spec("echo"))
    await gw.deploy(echo_spec("upper", handler="gwfuncs:upper"))
    spec = tmp_path / "shout.yaml"
    spec.write_text(PIPELINE_YAML)

    out = await ok(gw, "pipelines", "deploy", str(spec))
    assert f"pipeline shout deployed: POST {gw.url}/v1/pipelines/shout/invoke" in out
    table = (await ok(gw, "pipelines", "ls")).splitlines()
    assert table[0].split() == ["NAME", "STEPS", "FUNCTIONS"]
    assert table[1].split() == ["shout", "2", "echo,", "upper"]
    listed = json.loads(await ok(gw, "pipelines", "ls", "--json"))
    assert [p["name"] for p in listed] == ["shout"]
    assert "loud (upper) after say" in await ok(gw, "pipelines", "get", "shout")
    got = json.loads(await ok(gw, "pipelines", "--json", "get", "shout"))
    assert got["steps"][1] == {"name": "loud", "function": "upper", "after": ["say"]}

    body = tmp_path / "body.txt"
    body.write_text("hello")
    code, out, err = await trims(
        gw, "pipelines", "invoke", "shout", "--data", f"@{body}", "--timings"
    )
    assert (code, out) == (0, "HELLO\n"), err
    assert [line.split()[0] for line in err.splitlines()] == ["say", "loud", "total"]
    envelope = json.loads(await ok(gw, "pipelines", "invoke", "shout", "-d", "hi", "--outputs"))
    assert envelope["output"]["body"] == "HI"
    assert [s["step"] for s in envelope["stages"]] == ["say", "loud"]
    accepted = json.loads(await ok(gw, "pipelines", "invoke", "shout", "-d", "x", "--async"))
    assert accepted["pipeline"] == "shout" and accepted["status_url"].startswith("/v1/invocations/")

    assert "pipeline shout deleted" in await ok(gw, "pipelines", "rm", "shout")
    assert "no pipelines" in await ok(gw, "pipelines", "ls")
    code, _, err = await trims(gw, "pipelines", "get", "shout")
    assert code == 1 and err.startswith("trims pipelines: error: ") and "shout" in err
    assert len(err.strip().splitlines()) == 1


async def test_a_bad_pipeline_spec_is_refused_with_the_gateway_reason(
    start_gateway: Any, tmp_path: Path
) -> None:
    gw = await start_gateway()
    spec = tmp_path / "p.yaml"
    spec.write_text("name: p\nsteps:\n  - name: a\n    function: nope\n")
    code, _, err = await trims(gw, "pipelines", "deploy", str(spec))
    assert code == 1 and "undeployed function 'nope'" in err
    spec.write_text("- just\n- a list\n")
    code, _, err = await trims(gw, "pipelines", "deploy", str(spec))
    assert code == 1 and "a pipeline spec is an object with 'name' and 'steps'" in err


async def test_functions_json_listing_and_get(start_gateway: Any) -> None:
    gw = await start_gateway()
    await gw.deploy(echo_spec("echo"))
    [listed] = json.loads(await ok(gw, "functions", "ls", "--json"))
    assert listed["spec"]["name"] == "echo" and "instances" in listed["status"]
    assert json.loads(await ok(gw, "functions", "--json", "get", "echo"))["spec"]["name"] == "echo"
    text = await ok(gw, "functions", "get", "echo")
    assert "handler:   gwfuncs:handler" in text and "instances: " in text
    assert (await ok(gw, "functions", "ls")).splitlines()[0].split()[0] == "NAME"


def test_common_options_go_before_or_after_the_action() -> None:
    models = build_parser("models")
    after = models.parse_args(["ls", "--socket", "/s.sock", "--no-progress", "--json"])
    assert (str(after.socket), after.no_progress, after.json) == ("/s.sock", True, True)
    before = models.parse_args(["--socket", "/s.sock", "--timeout", "5", "ls"])
    assert (str(before.socket), before.timeout, before.no_progress) == ("/s.sock", 5.0, False)
    for command in ("functions", "pipelines"):
        parser = build_parser(command)
        after = parser.parse_args(["ls", "--url", "http://h:1", "--token", "t", "--json"])
        assert (after.url, after.token, after.json) == ("http://h:1", "t", True)
        before = parser.parse_args(["--url", "http://h:1", "--json", "get", "x"])
        assert (before.url, before.json, before.token) == ("http://h:1", True, None)


def test_models_rm_help_says_it_removes_every_version() -> None:
    [sub] = [a for a in build_parser("models")._actions if hasattr(a, "choices") and a.choices]
    help_text = sub.choices["rm"].format_help()
    assert "every version" in help_text and "only this version" in help_text
