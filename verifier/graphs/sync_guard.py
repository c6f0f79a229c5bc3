"""A guard that fails on any host synchronisation inside the region a CUDA graph captures.

A captured step must never wait for the device: a `.item()`, `.tolist()`, `.cpu()`, a tensor in
an `if`, a boolean mask's indexing or a `nonzero` reads device memory on the host, which a graph
cannot replay (capture fails, or worse, the value read at capture is baked in). On CUDA torch's
own sync debug mode catches what reaches the driver; on the CPU, where the proof runs, nothing
syncs, so the guard looks at the calls themselves: torch's function layer for the Tensor methods
that hand a value to Python, its dispatcher for the operators whose output shape depends on
values. The Triton interpreter (the CPU tests' kernels) reads its tensors below both layers.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods that give Python a value (or a host copy) of the tensor's contents.
HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                        "__complex__", "__repr__", "__format__", "__array__"})
# Operators whose output's shape depends on the values: the host must wait to size it.
VALUE_SHAPED = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique",
                          "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                          "repeat_interleave", "equal", "is_nonzero", "_assert_async"})


class HostSyncError(RuntimeError):
    """A host synchronisation inside a region that must run without one."""


def _host_copy(name: str, args, kwargs) -> bool:
    """`t.to("cpu")` / `t.to(device="cpu")` of a tensor elsewhere, or any `.to` naming the host."""
    if name not in ("to", "copy_"):
        return False
    if name == "copy_":
        dst, src = args[0], args[1]
        return isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu"
    wanted = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
    return any(torch.device(a).type == "cpu" and args[0].device.type != "cpu" for a in wanted)


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS or _host_copy(name, args, kwargs):
            raise HostSyncError(f"Tensor.{name} reads a tensor on the host inside a captured region")
        return func(*args, **kwargs)


class _Operators(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in VALUE_SHAPED:
            raise HostSyncError(f"aten.{name} waits for the device inside a captured region")
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                   for i in (args[1] if len(args) > 1 else ())):
            raise HostSyncError("indexing by a boolean mask waits for the device inside a captured region")
        return func(*args, **kwargs)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, a host synchronisation raises `HostSyncError` (on CUDA also torch's own check)."""
    with ExitStack() as stack:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, before)
        stack.enter_context(_Functions())
        stack.enter_context(_Operators())
        yield
