"""The worker: one process that hosts one function instance and serves the wire protocol."""
