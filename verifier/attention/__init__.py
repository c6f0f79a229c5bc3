"""Attention backends: a small interface, chosen by registry (torch on CPU, Triton on CUDA)."""
from verifier.attention.base import AttentionBackend, get_backend, register_backend

__all__ = ["AttentionBackend", "get_backend", "register_backend"]
