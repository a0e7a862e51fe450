"""Across-stack traces: one span model for every level, from the HTTP request to kernels.

The ground floor of tracing, shared by the function side (a worker traces an invocation that
asks for it) and the benchmark functions (``trims.evaluation.tracing``: leveled runs and trace
analyses), which may not import each other. It holds:

* :mod:`trims.tracing.levels`: the levels (none, model, layer, library, kernel, full);
* :mod:`trims.tracing.spans`: :class:`Span` and :class:`Trace`, one clock (Unix epoch
  nanoseconds), parents from time containment per track;
* the framework sources (``trims.tracing.sources``: torch.profiler, ONNX Runtime session
  profiling, the MXNet profiler) that turn a profiler's events into spans;
* the exports: Chrome trace-event JSON and OTLP.

Heavy imports (torch, onnxruntime, mxnet, the OpenTelemetry SDK) happen only where used.
"""
