"""trims.kernels: GPU kernel studies with NumPy reference paths.

Each study is a library module with a NumPy path that runs anywhere and a CuPy path for NVIDIA
GPUs (imported lazily, see :mod:`trims.kernels.gpu`):

- :mod:`trims.kernels.tcu`: reduction and scan as 16x16 matrix multiplications (tensor cores);
- :mod:`trims.kernels.klap`: kernel launch aggregation (the index math) and its benchmarks;
- :mod:`trims.kernels.transfer`: data-transfer characterization (host, between processes, GPU);
- :mod:`trims.kernels.als`: explicit and implicit ALS matrix factorization.

``trims kernels NAME --json OUT.json`` runs a study (:mod:`trims.kernels.cli`).
"""
