"""The operator tests share the Kubernetes API server fixture of tests/fixtures/kube_api.py."""

from tests.fixtures.kube_api import kube_api

__all__ = ["kube_api"]
