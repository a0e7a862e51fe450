"""The import rules in pyproject.toml ([tool.importlinter], checked by .ci/lint-imports) follow
the tree: the runtime's public-API contract forbids exactly the runtime's modules that its
``__all__`` does not name, so a module added to runtime/ is private until ``__all__`` says
otherwise, and the list cannot drift from the package."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path
from typing import Any

import trims.runtime

ROOT = Path(__file__).resolve().parents[2]


def _contract(name_starts: str) -> dict[str, Any]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (found,) = [c for c in contracts if c["name"].startswith(name_starts)]
    return dict(found)


def test_the_runtimes_private_modules_are_exactly_those_its_all_leaves_out() -> None:
    contract = _contract("benchmark functions and the operator use only the runtime's public")
    forbidden = {m for m in contract["forbidden_modules"] if m.startswith("trims.runtime.")}
    modules = {f"trims.runtime.{m.name}" for m in pkgutil.iter_modules(trims.runtime.__path__)}
    public = {f"trims.runtime.{name}" for name in trims.runtime.__all__}
    assert public <= modules, f"__all__ names modules that do not exist: {public - modules}"
    assert forbidden == modules - public, (
        "pyproject.toml's public-API contract must forbid every runtime module not in "
        f"trims.runtime.__all__: missing {sorted(modules - public - forbidden)}, "
        f"not private {sorted(forbidden - (modules - public))}"
    )


def test_the_floors_rule_is_exhaustive() -> None:
    # a module added directly under trims/ must be given a floor (lint-imports fails until it is)
    contract = _contract("floors:")
    assert contract["type"] == "layers" and contract["exhaustive"] is True
    assert contract["containers"] == ["trims"]
