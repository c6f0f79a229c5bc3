"""The target side: model, kernels, KV cache, sampling."""
from verifier.cpu import machine as _machine  # noqa: F401  (applies TERCEL_CPU_ISA before torch's first kernel)
