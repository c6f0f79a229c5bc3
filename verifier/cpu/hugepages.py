"""CPU tensors on transparent huge pages: the weights every decode step streams, and the KV pool.

A step reads every weight once, tens of megabytes: in 4 KB pages that is thousands of TLB
entries per step, far more than a TLB holds, and in a virtual machine each miss walks two page
tables. Linux backs memory with 2 MB pages where madvise(MADV_HUGEPAGE) marked it before its
first touch (transparent huge pages in "madvise" mode, the usual default; "always" backs any
large mapping, "never" none). Figures: docs/performance.md, "Huge pages".

Memory here comes from its own anonymous mapping (untouched, zero-filled by the kernel), so the
marking precedes every touch whatever malloc would have reused. Elsewhere, or where madvise
fails, the tensors are ordinary ones: the same bytes, on small pages.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys

import torch

log = logging.getLogger("tercel.hugepages")
HUGE = 2 << 20           # bytes per huge page (x86-64, aarch64 with 4 KB base pages)
ALIGN = 64               # bytes between tensors in an arena: a cache line, as torch's allocator aligns


def enabled() -> bool:
    """Whether tensors are put on huge pages: on Linux unless TERCEL_HUGEPAGES=0."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") \
        and os.environ.get("TERCEL_HUGEPAGES", "1") != "0"


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with `nbytes` from a huge-page boundary marked MADV_HUGEPAGE;
    returns it and that boundary's offset in it."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -_address(m) % HUGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, (nbytes + HUGE - 1) // HUGE * HUGE)
    except OSError as e:              # THP "never", or a kernel without it: small pages
        log.debug("madvise(MADV_HUGEPAGE) refused: %s", e)
    return m, start


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on huge pages where `enabled()`, else `torch.zeros`."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not enabled() or nbytes < HUGE:
        return torch.zeros(shape, dtype=dtype)
    m, start = _mapping(nbytes)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU `tensors` side by side in one huge-page arena (each `ALIGN`ed),
    in order; the originals where not `enabled()` or all of them fit in one page."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    if not enabled() or total < HUGE:
        return tensors
    m, start = _mapping(total)
    arena = torch.frombuffer(m, dtype=torch.uint8, count=total, offset=start)
    out = []
    for t, at, n in zip(tensors, offsets, sizes):
        copy = arena[at:at + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    return out
