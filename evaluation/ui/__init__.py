"""The results web UI the gateway serves at ``/ui/``: evaluations, comparisons, traces, layer
analyses, deployed functions and store models, and forms that start evaluations and traces.

:func:`create_ui_app` builds an aiohttp sub-application; the gateway mounts it lazily
(``trims.runtime.gateway.app``), so a core install without the evaluation extra still starts.
Pages are rendered on the server (Jinja2 templates, matplotlib SVG charts, an SVG span
timeline) and work with JavaScript disabled; nothing is fetched from the internet.

Where the data comes from: the results database (:class:`trims.evaluation.db.ResultsDB`,
opened read-only), the gateway's own JSON API called with the browser user's token (functions,
instances, kept traces, invocations: the API checks the scopes, so the UI grants nothing the
API would refuse), and the store daemon's socket (models and their residency per tier).
"""

from trims.evaluation.ui.app import create_ui_app
from trims.evaluation.ui.config import UIConfig

__all__ = ["UIConfig", "create_ui_app"]
