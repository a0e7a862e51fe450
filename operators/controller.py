"""The operator's control loop: watch Function objects and reconcile each one.

A plain kubernetes-client loop (list, then watch from the list's resourceVersion; list again
when the watch expires or the server answers 410 Gone; a full resync every ``resync_s``).
For each Function it server-side-applies the Deployment and Service from
:func:`trims.operators.reconcile.desired_objects` (field manager ``trims-operator``, so fields
set by others are left alone) and writes the Function's status. Deleting a Function needs no
handler: the owner references let the garbage collector delete what it owned. An invalid spec
sets ``Ready=False`` with the parse error and applies nothing. A failing Function never stops
the loop; API errors are logged and retried on the next event or resync.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trims.errors import Unavailable, ValidationError
from trims.operators.crd import GROUP, PLURAL, VERSION
from trims.operators.reconcile import MANAGER, Desired, desired_objects, function_status
from trims.runtime.kubernetes_objects import KubernetesExecutorSettings

log = logging.getLogger(__name__)

APPLY = "application/apply-patch+yaml"


@dataclass(frozen=True)
class OperatorSettings:
    #: Namespace to watch; None = every namespace (needs the chart's ClusterRole).
    namespace: str | None = None
    #: Seconds between full resyncs (each Function reconciled even without an event).
    resync_s: float = 300.0
    #: Seconds to wait after an API error before listing again.
    retry_s: float = 5.0
    #: Path of a kubeconfig file; None = in-cluster config, else ~/.kube/config.
    kubeconfig: str | None = None
    #: How worker pods look (image, store socket, node selector, ...).
    pods: KubernetesExecutorSettings = field(default_factory=KubernetesExecutorSettings)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Operator:
    """Reconciles Functions into Deployments and Services until ``stop`` is set."""

    def __init__(self, settings: OperatorSettings, api_client: Any = None) -> None:
        from kubernetes import client

        self.settings = settings
        self.api_client = api_client or _api_client(settings.kubeconfig)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.apps = client.AppsV1Api(self.api_client)
        self.core = client.CoreV1Api(self.api_client)
        self.stop = threading.Event()

    def reconcile(self, obj: Mapping[str, Any]) -> Desired | None:
        """Apply what Function ``obj`` should have and write its status; the desired state."""
        from kubernetes.client.exceptions import ApiException

        meta = obj.get("metadata") or {}
        name, namespace = meta.get("name"), meta.get("namespace") or "default"
        if meta.get("deletionTimestamp"):
            return None
        desired: Desired | None = None
        error: str | None = None
        deployment_status: Mapping[str, Any] | None = None
        try:
            desired = desired_objects(obj, self.settings.pods)
        except ValidationError as e:
            error = e.message
            log.warning("function %s/%s has an invalid spec, nothing applied: %s",
                        namespace, name, error)  # fmt: skip
        if desired is not None:
            deployment, service = desired.objects
            self.apps.patch_namespaced_deployment(
                deployment["metadata"]["name"], namespace, deployment,
                field_manager=MANAGER, force=True, _content_type=APPLY,
            )  # fmt: skip
            self.core.patch_namespaced_service(
                service["metadata"]["name"], namespace, service,
                field_manager=MANAGER, force=True, _content_type=APPLY,
            )  # fmt: skip
            try:
                applied = self.apps.read_namespaced_deployment_status(
                    deployment["metadata"]["name"], namespace
                )
                deployment_status = self.api_client.sanitize_for_serialization(applied.status)
            except ApiException as e:
                log.debug("deployment status of %s/%s unreadable: %s", namespace, name, e.reason)
        status = function_status(
            obj, desired=desired, error=error, deployment_status=deployment_status,
            settings=self.settings.pods, now=_now(),
        )  # fmt: skip
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}
        )
        log.info("function %s/%s reconciled: %s", namespace, name,
                 status["conditions"][0]["message"])  # fmt: skip
        return desired

    def _list(self) -> tuple[list[dict[str, Any]], str]:
        if self.settings.namespace:
            result = self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.settings.namespace, PLURAL
            )
        else:
            result = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
        return list(result.get("items", [])), str(result["metadata"]["resourceVersion"])

    def _reconcile_quietly(self, obj: Mapping[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        meta = obj.get("metadata") or {}
        try:
            self.reconcile(obj)
        except (ApiException, HTTPError, OSError) as e:
            log.warning("function %s/%s not reconciled (%s); retrying on the next event",
                        meta.get("namespace"), meta.get("name"), e)  # fmt: skip

    def sync_once(self) -> str:
        """List every Function and reconcile each; the list's resourceVersion."""
        items, version = self._list()
        for obj in items:
            self._reconcile_quietly(obj)
        return version

    def run(self) -> None:
        """List, reconcile, watch; until :attr:`stop` is set."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        scope = self.settings.namespace or "all namespaces"
        log.info("operator watching functions.%s in %s", GROUP, scope)
        while not self.stop.is_set():
            try:
                version = self.sync_once()
                resync_at = time.monotonic() + self.settings.resync_s
                while not self.stop.is_set() and time.monotonic() < resync_at:
                    version = self._watch(watch.Watch(), version, resync_at)
            except _Gone:
                log.info("watch expired; listing functions again")
            except (ApiException, HTTPError, OSError) as e:
                log.warning("operator lost the API server (%s); retrying in %.0f s",
                            e, self.settings.retry_s)  # fmt: skip
                self.stop.wait(self.settings.retry_s)

    def _watch(self, w: Any, version: str, until: float) -> str:
        """Reconcile watch events until ``until``; the last resourceVersion seen."""
        kwargs: dict[str, Any] = {
            "resource_version": version,
            "timeout_seconds": max(1, min(60, int(until - time.monotonic()))),
            "allow_watch_bookmarks": True,
        }
        if self.settings.namespace:
            fn: Any = self.custom.list_namespaced_custom_object
            args: tuple[Any, ...] = (GROUP, VERSION, self.settings.namespace, PLURAL)
        else:
            fn, args = self.custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL)
        from kubernetes.client.exceptions import ApiException

        try:
            for event in w.stream(fn, *args, **kwargs):
                kind, obj = event["type"], event["object"]
                version = str(obj["metadata"]["resourceVersion"])
                if kind in ("ADDED", "MODIFIED"):
                    self._reconcile_quietly(obj)
                if self.stop.is_set():
                    w.stop()
                    break
        except ApiException as e:
            # The client turns a watch ERROR event into an exception; 410: version too old.
            if e.status == 410:
                raise _Gone from e
            raise
        return version


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def _api_client(kubeconfig: str | None) -> Any:
    from kubernetes import client, config

    try:
        if kubeconfig:
            return config.new_client_from_config(config_file=kubeconfig)
        try:
            config.load_incluster_config()
            return client.ApiClient()
        except config.ConfigException:
            return config.new_client_from_config()
    except (config.ConfigException, OSError) as e:
        raise Unavailable(
            f"operator: no cluster configuration ({e}); run it in a pod or pass --kubeconfig"
        ) from e
