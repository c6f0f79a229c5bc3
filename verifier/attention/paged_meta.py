"""The paged attention kernels' per-forward metadata, built on the host (no Triton here: a CPU
process that never runs the kernels must not import it). `verifier/attention/triton_kernels.py`
reads it; `verifier/graphs/static_step.py` writes it into fixed buffers."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedAttnMeta:
    """Per-forward index tensors the kernels read; built once by `pack_paged_meta`.

    Each new token attends to `ctx` cached keys and then to `n_new` of the new tokens, in
    index order: tokens 0..i for causal rows, the ancestors and itself for tree rows (listed
    in `anc`; an ancestor's index is below its descendant's, so index order is depth order)."""

    block_tables: torch.Tensor   # [B, max_blocks] int32, row s padded with 0 past its blocks
    ctx_lens: torch.Tensor       # [B] int32: cached tokens each sequence attends to in full
    tok_seq: torch.Tensor        # [T] int32: the sequence of each new token
    n_new: torch.Tensor          # [T] int32: new tokens it sees (itself included)
    anc_offsets: torch.Tensor    # [T] int64: start of its list in `anc`; -1 = causal (tokens 0..i)
    anc: torch.Tensor            # [sum of n_new over tree rows + 1] int32 (a dummy 0 last)
    slot_mapping: torch.Tensor   # [T] int64: physical slot of each new token
    block_size: int
    q_lens: list[int]            # host copy


@dataclass(frozen=True)
class HostPagedMeta:
    """`PagedAttnMeta`'s tensors on the host, before their copy to the device: a CUDA graph's
    step writes them into its own fixed buffers instead (`verifier/graphs/static_step.py`)."""

    block_tables: torch.Tensor   # [B, max_blocks] int32
    ctx_lens: torch.Tensor       # [B] int32
    tok_seq: torch.Tensor        # [T] int32
    n_new: torch.Tensor          # [T] int32
    anc_offsets: torch.Tensor    # [T] int64
    anc: torch.Tensor            # [ancestors listed + 1] int32
    slot_mapping: torch.Tensor   # [T] int64


def paged_meta_host(q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]],
                    masks: list[torch.Tensor | None], block_size: int) -> HostPagedMeta:
    """One forward's plain ints as the kernels' tensors, on the host.

    masks[s] is None for a causal sequence, else a bool [q, q] (row i sees new token j)."""
    assert len(q_lens) == len(ctx_lens) == len(block_tables) == len(masks) > 0
    nblocks = [-(-(c + q) // block_size) for q, c in zip(q_lens, ctx_lens)]
    width = max(nblocks)
    bt = torch.zeros(len(q_lens), width, dtype=torch.int32)
    slots, tok_seq, n_new, offsets, flat, used = [], [], [], [], [], 0
    for s, (q, c, table, m) in enumerate(zip(q_lens, ctx_lens, block_tables, masks)):
        assert q > 0 and c >= 0, (q, c)
        assert len(table) >= nblocks[s], f"seq {s}: {len(table)} blocks for {c + q} tokens"
        bt[s, :nblocks[s]] = torch.tensor(table[:nblocks[s]], dtype=torch.int32)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + q)]
        tok_seq += [s] * q
        if m is None:
            n_new += range(1, q + 1)
            offsets += [-1] * q
            continue
        assert tuple(m.shape) == (q, q), (tuple(m.shape), q)
        m = m.detach().to("cpu", torch.bool)
        counts = m.sum(1).tolist()
        n_new += counts
        for n in counts:
            offsets.append(used)
            used += n
        flat.append(m.nonzero()[:, 1].to(torch.int32))      # row-major: each row's keys in index order
    anc = torch.cat([*flat, torch.zeros(1, dtype=torch.int32)])   # a dummy last: never empty
    i32 = dict(dtype=torch.int32)
    return HostPagedMeta(bt, torch.tensor(ctx_lens, **i32), torch.tensor(tok_seq, **i32), torch.tensor(n_new, **i32),
                         torch.tensor(offsets, dtype=torch.int64), anc, torch.tensor(slots, dtype=torch.int64))


def pack_paged_meta(q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]],
                    masks: list[torch.Tensor | None], block_size: int,
                    device: torch.device | str) -> PagedAttnMeta:
    """Turn one forward's plain ints into kernel tensors (host work, one copy per tensor)."""
    h = paged_meta_host(q_lens, ctx_lens, block_tables, masks, block_size)
    return PagedAttnMeta(
        block_tables=h.block_tables.to(device), ctx_lens=h.ctx_lens.to(device), tok_seq=h.tok_seq.to(device),
        n_new=h.n_new.to(device), anc_offsets=h.anc_offsets.to(device), anc=h.anc.to(device),
        slot_mapping=h.slot_mapping.to(device), block_size=block_size, q_lens=list(q_lens))
