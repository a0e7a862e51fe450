"""trims.runtime: everything on the function side.

The modules in ``__all__`` are the runtime's public API, the only ones benchmark functions
(``trims.evaluation``, ``trims.kernels``), the operator and examples import: the handler contract
(``functions``), the store client (``client``) and models over it (``models``, ``direct``), the
gateway credentials every client finds the same way (``credentials``), and a function as
Kubernetes objects (``kubernetes_objects``). Everything else (gateway, executors, worker,
adapters, wire, the CLI modules) may change without notice; ``.ci/lint-imports`` enforces this.
"""

__all__ = ["client", "credentials", "direct", "functions", "kubernetes_objects", "models"]
