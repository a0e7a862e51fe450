"""The four studies behind one call: settings in, the study's JSON result out.

Shared by the command line (:mod:`trims.kernels.cli`) and the runtime function
(:mod:`trims.kernels.functions`), so both produce the same JSON. Each study module is imported
only when its study runs.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Mapping
from typing import Any

from trims.errors import NotFound, ValidationError

STUDIES = ("tcu", "klap", "transfer", "als")


def settings_class(study: str) -> type[Any]:
    """The frozen settings dataclass of a study."""
    if study == "tcu":
        from trims.kernels.tcu_bench import TcuSettings

        return TcuSettings
    if study == "klap":
        from trims.kernels.klap_bench import KlapSettings

        return KlapSettings
    if study == "transfer":
        from trims.kernels.transfer import TransferSettings

        return TransferSettings
    if study == "als":
        from trims.kernels.als_bench import AlsSettings

        return AlsSettings
    raise NotFound(f"unknown study {study!r}; choose one of {', '.join(STUDIES)}")


def settings_from(study: str, values: Mapping[str, Any]) -> Any:
    """Settings from a JSON object; unknown fields are refused with the accepted ones named."""
    cls = settings_class(study)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValidationError(
            f"unknown {study} settings {unknown}; accepted: {', '.join(sorted(fields))}"
        )
    converted = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**converted)


def machine() -> dict[str, Any]:
    """Where the numbers come from (the machine may be shared: the load average says so)."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def run(study: str, settings: Any) -> dict[str, Any]:
    """Run one study. ALS returns its contract ``{"explicit": ..., "implicit": ...}``; the
    others ``{"study", "machine", "settings", "rows"}`` (klap adds ``geomean_speedup``)."""
    if study == "als":
        from trims.kernels import als_bench

        return als_bench.run(settings)
    head = {"study": study, "machine": machine(), "settings": dataclasses.asdict(settings)}
    if study == "tcu":
        from trims.kernels import tcu_bench

        return {**head, "rows": [r.to_dict() for r in tcu_bench.run(settings)]}
    if study == "klap":
        from trims.kernels import klap_bench

        rows, summary = klap_bench.run(settings)
        return {**head, "rows": [r.to_dict() for r in rows], "geomean_speedup": summary}
    if study == "transfer":
        from trims.kernels import transfer

        return {**head, "rows": [r.to_dict() for r in transfer.run(settings)]}
    raise NotFound(f"unknown study {study!r}; choose one of {', '.join(STUDIES)}")
