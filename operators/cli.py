"""`trims operator`: run the Kubernetes operator, or print the Function CRD.

trims operator run [--namespace NS] [--image IMG] ...   reconcile Functions until SIGTERM
trims operator crd                                      the CRD as YAML (helm/trims/crds/)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("crd", help="print the Function CustomResourceDefinition as YAML")
    run = sub.add_parser("run", help="watch Function objects and reconcile them")
    run.add_argument("--namespace", help="watch one namespace [$TRIMS_K8S_NAMESPACE; all]")
    run.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, ~/.kube/config)")
    run.add_argument("--image", help="worker image for Functions naming none [$TRIMS_K8S_IMAGE]")
    run.add_argument("--store-socket", help="daemon socket on the node [$TRIMS_K8S_STORE_SOCKET]")
    run.add_argument(
        "--node-selector", help="JSON object of node labels [$TRIMS_K8S_NODE_SELECTOR]"
    )
    run.add_argument("--resync", type=float, default=300.0, help="seconds between full resyncs")
    run.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING [INFO]")


def settings_from_args(args: argparse.Namespace, env: dict[str, str]) -> Any:
    from trims.operators.controller import OperatorSettings
    from trims.runtime.kubernetes_objects import KubernetesExecutorSettings

    overrides = {
        "TRIMS_K8S_IMAGE": args.image,
        "TRIMS_K8S_STORE_SOCKET": args.store_socket,
        "TRIMS_K8S_NODE_SELECTOR": args.node_selector,
    }
    merged = {**env, **{k: v for k, v in overrides.items() if v}}
    pods = KubernetesExecutorSettings.from_env(merged)
    return OperatorSettings(
        namespace=args.namespace or env.get("TRIMS_K8S_NAMESPACE") or None,
        resync_s=args.resync,
        kubeconfig=args.kubeconfig,
        pods=pods,
    )


def run(args: argparse.Namespace) -> int:
    if args.action == "crd":
        import yaml

        from trims.operators.crd import crd_manifest

        # Through JSON so YAML sees only plain types; stable key order for diffs.
        sys.stdout.write(yaml.safe_dump(json.loads(json.dumps(crd_manifest())), sort_keys=False))
        return 0
    from trims.operators.controller import Operator

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    operator = Operator(settings_from_args(args, dict(os.environ)))

    def _stop(signum: int, _frame: Any) -> None:
        operator.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    operator.run()
    return 0
