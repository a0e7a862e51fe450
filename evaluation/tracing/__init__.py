"""Leveled across-stack traces of one model: workloads, leveled runs, trace analyses, CLI.

* :mod:`.workload`: a model to trace (zoo/family name, the ResNet-50 example, an ONNX path) in
  torch, ONNX Runtime or MXNet, run untraced or under a level;
* :mod:`.leveled`: one run per level, each repeated until stable, overhead per level, and the
  trace assembled from one representative run per level;
* :mod:`.analyses`: the trace's tables (layers, op types, top-k, compare, GPU refusals);
* :mod:`.store`: traces in the results database; :mod:`.cli`: ``trims trace``;
  :mod:`.function`: the ``trace`` benchmark function.

The spans, levels, sources and exports live on the ground floor, :mod:`trims.tracing`.
"""
