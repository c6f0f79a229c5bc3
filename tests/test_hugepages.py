"""Weights and the KV pool on huge pages (verifier/cpu/hugepages.py): the same bytes, zero-filled
pools, one arena for a model's own-kernel tensors, and 2 MB pages where the kernel grants them."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from verifier.attention.kv_cache import KVCache
from verifier.cpu import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= address < hi:
            return dict(line.split(":", 1) for line in block.splitlines()[1:] if ":" in line)
    raise LookupError(hex(address))


def test_gathered_tensors_keep_their_bytes_and_sit_aligned_side_by_side():
    tensors = [torch.randn(700, 1000), torch.randint(0, 255, (3, 333), dtype=torch.uint8),
               torch.randn(5, 7).to(torch.bfloat16), torch.arange(9, dtype=torch.int32)]
    moved = hugepages.gather(tensors)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, moved))
    if hugepages.enabled():
        assert all(m.data_ptr() % hugepages.ALIGN == 0 for m in moved)
        assert moved[0].data_ptr() % hugepages.HUGE == 0
        assert moved[1].data_ptr() - moved[0].data_ptr() == 700 * 1000 * 4       # one arena, in order


def test_small_sets_and_the_switch_leave_tensors_where_they_are(monkeypatch):
    small = [torch.randn(10, 10)]
    assert hugepages.gather(small)[0] is small[0]
    monkeypatch.setenv("TERCEL_HUGEPAGES", "0")
    big = [torch.randn(1000, 1000)]
    assert not hugepages.enabled() and hugepages.gather(big)[0] is big[0]


def test_the_kv_pool_starts_zeroed_and_takes_writes():
    kv = KVCache(2, 64, 16, 3, 64, torch.bfloat16, "cpu")
    assert kv.k.shape == (2, 64, 16, 3, 64) and not kv.k.any() and not kv.v.any()
    k, v = kv.layer(1)
    k[5, 3] = 1.5
    kv.copy_slots([5 * 16 + 3], [7 * 16])
    assert float(kv.k[1, 7, 0, 0, 0]) == 1.5 and float(kv.k[0].abs().sum()) == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.is_file() or "[never]" in THP.read_text(),
                    reason="transparent huge pages are off on this machine")
def test_the_arena_is_backed_by_huge_pages():
    moved = hugepages.gather([torch.randn(2000, 1000)])          # 8 MB: whole huge pages inside
    fields = _mapping_of(moved[0].data_ptr())
    assert fields["THPeligible"].strip() == "1"
    assert int(fields["AnonHugePages"].split()[0]) > 0


def test_a_quantized_models_own_kernel_tensors_share_one_arena(smollm2_dir):
    """Every decoder linear's and the head scan's kernel tensors, in one huge-page arena."""
    from verifier.quantized.quantize import timed_linears
    from verifier.target import TargetModel
    net = TargetModel(str(smollm2_dir), quantization="int4").net
    tensors = [t for lin in [*timed_linears(net), net.lm_head.scan] for t in lin.own_tensors()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if not hugepages.enabled() or nbytes < hugepages.HUGE:
        pytest.skip("huge pages off, or the model's kernels fit in one page")
    start = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    assert start % hugepages.HUGE == 0 and end - start < nbytes + hugepages.ALIGN * len(tensors)
    if THP.is_file() and "[never]" not in THP.read_text():
        assert int(_mapping_of(start)["AnonHugePages"].split()[0]) > 0
