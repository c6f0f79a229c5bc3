"""Attention backends: a small interface (`base.py`), one per device kind, chosen by name."""
from verifier.attention.base import AttentionBackend
from verifier.attention.torch_backend import TorchBackend

BACKENDS = ("torch", "triton")


def get_backend(name: str) -> AttentionBackend:
    """A new backend: "torch" (the CPU's) or "triton" (CUDA's, imported when first asked for, so
    that Triton is needed only where it runs)."""
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        # lazy: triton is Linux-only; importing the kernels fixes TRITON_INTERPRET (the tests set it first)
        from verifier.attention.triton_backend import TritonBackend
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}")


__all__ = ["AttentionBackend", "BACKENDS", "get_backend"]
