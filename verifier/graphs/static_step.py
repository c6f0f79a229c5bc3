"""The forward of a decode or verify step from buffers that never move, so that a CUDA graph can
replay it (`verifier/graphs/cuda_graphs.py`).

A step's new rows are padded to a bucket (`GraphConfig.buckets`) by one padding sequence: a causal
chain at context 0 over KV blocks set aside for it (never a request's), needing no logits. A row's
result does not depend on the rows beside it (the row invariance of `verifier/runner.py`), so the
real rows come out bit for bit as an unpadded forward gives them. Every input the forward reads
(token ids, positions, logits rows, and the attention's block tables, context lengths, ancestor
lists and KV slots) lies in two device buffers sized for the largest bucket, filled from the host
by three copies a step; the forward itself (`StaticStep.run`) reads nothing back on the host,
which `verifier/graphs/sync_guard.py:no_host_sync` checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from verifier.attention.base import AttentionBackend
from verifier.attention.kv_cache import KVCache
from verifier.attention.paged_meta import PagedAttnMeta, paged_meta_host
from verifier.batch import ForwardBatch, ForwardOutput, SeqInput, flatten
from verifier.graphs.config import GraphConfig


def pad_batch(batch: ForwardBatch, rows: int, scratch: list[int]) -> ForwardBatch:
    """`batch` with one padding sequence appended that brings its new rows to `rows`: token 0 from
    position 0 on `scratch`'s blocks, no logits."""
    missing = rows - sum(s.num_new for s in batch.seqs)
    if missing < 0:
        raise ValueError(f"{rows} rows cannot hold a step of {rows - missing}")
    if missing == 0:
        return batch
    return ForwardBatch([*batch.seqs, SeqInput([0] * missing, 0, scratch, logits_indices=[])], batch.capture_layers)


@dataclass(frozen=True)
class Loaded:
    """What `StaticStep.load` wrote: the bucket, and how to read the real rows back."""
    rows: int                   # the bucket's rows, padding included
    real_rows: int              # the batch's own new rows, first in the buffers
    logits_offsets: list[int]   # each sequence's first logits row, and the end

    def output(self, logits: torch.Tensor, taps: dict[int, torch.Tensor], copy: bool) -> ForwardOutput:
        """The batch's ForwardOutput from the bucket's outputs (copied where a replay reuses them)."""
        n, t = self.logits_offsets[-1], self.real_rows
        take = (lambda x: x.clone()) if copy else (lambda x: x)
        return ForwardOutput(take(logits[:n]), self.logits_offsets, {i: take(h[:t]) for i, h in taps.items()})


class _Fields:
    """Named views of one flat buffer, laid out in the order given."""

    def __init__(self, flat: torch.Tensor, sizes: dict[str, int]):
        self.flat, start = flat, 0
        for name, size in sizes.items():
            setattr(self, name, flat[start:start + size])
            start += size


class StaticStep:
    """A dense target's forward over fixed buffers (the Triton backend's paged attention), for
    steps whose rows fit `config`; `forward` pads, loads and runs one eagerly."""

    def __init__(self, net: nn.Module, backend: AttentionBackend, kv: KVCache, config: GraphConfig,
                 max_blocks_per_seq: int, scratch: list[int]):
        if len(scratch) * kv.block_size < config.max_rows:
            raise ValueError(f"{len(scratch)} scratch blocks of {kv.block_size} slots cannot pad {config.max_rows} rows")
        self.net, self.backend, self.kv, self.config, self.scratch = net, backend, kv, config, scratch
        # the padding sequence may need more blocks than a request can have (a short max_model_len)
        t, seqs, self.width = config.max_rows, config.max_rows + 1, max(max_blocks_per_seq, len(scratch))
        self._sizes64 = {"ids": t, "positions": t, "logits_rows": t, "slots": t, "anc_offsets": t}
        self._sizes32 = {"ctx_lens": seqs, "tok_seq": t, "n_new": t, "block_tables": seqs * self.width,
                         "anc": t * config.max_seq_rows + 1}       # each row sees at most its sequence's rows
        dev = kv.k.device
        pin = dev.type == "cuda"
        self.dev64 = _Fields(torch.zeros(5 * t, dtype=torch.int64, device=dev), self._sizes64)
        self.dev32 = _Fields(torch.zeros(sum(self._sizes32.values()), dtype=torch.int32, device=dev), self._sizes32)
        self.host64 = _Fields(torch.zeros(5 * t, dtype=torch.int64, pin_memory=pin), self._sizes64)
        self.host32 = _Fields(torch.zeros(sum(self._sizes32.values()), dtype=torch.int32, pin_memory=pin),
                              self._sizes32)
        self._copied = torch.cuda.Event() if pin else None     # the host buffers are free again after it
        self._metas: dict[int, PagedAttnMeta] = {}

    def rows_for(self, batch: ForwardBatch) -> int | None:
        """The bucket a step runs in, or None where it runs eagerly (a prompt chunk, too many rows,
        a context past the block tables' width)."""
        bs = self.kv.block_size
        if any(s.num_new > self.config.max_seq_rows or -(-s.kv_len // bs) > self.width for s in batch.seqs):
            return None
        return self.config.bucket(sum(s.num_new for s in batch.seqs))

    def forward(self, batch: ForwardBatch, rows: int) -> ForwardOutput:
        """One step, eagerly, through the buffers a graph would replay from."""
        loaded = self.load(batch, rows)
        return loaded.output(*self.run(rows, batch.capture_layers), copy=False)

    def load(self, batch: ForwardBatch, rows: int) -> Loaded:
        """Pad `batch` to `rows` and write its inputs into the buffers (host work, three copies)."""
        padded = pad_batch(batch, rows, self.scratch)
        ids, positions, logits_rows, offsets = flatten(padded)
        seqs = padded.seqs
        meta = paged_meta_host([s.num_new for s in seqs], [s.ctx_len for s in seqs],
                               [s.block_table for s in seqs], [s.mask for s in seqs], self.kv.block_size)
        if self._copied is not None:
            self._copied.synchronize()           # the last step's copies have left the host buffers
        h64, h32 = self.host64, self.host32
        h64.ids[:rows] = torch.tensor(ids)
        h64.positions[:rows] = torch.tensor(positions)
        h64.logits_rows[:rows] = 0                # rows past the batch's logits: row 0, computed and dropped
        h64.logits_rows[:len(logits_rows)] = torch.tensor(logits_rows, dtype=torch.int64)
        h64.slots[:rows] = meta.slot_mapping
        h64.anc_offsets[:rows] = meta.anc_offsets
        b, w = meta.block_tables.shape
        h32.ctx_lens[:b] = meta.ctx_lens
        h32.tok_seq[:rows] = meta.tok_seq
        h32.n_new[:rows] = meta.n_new
        h32.block_tables.view(-1, self.width)[:b, :w] = meta.block_tables
        used = meta.anc.numel()
        h32.anc[:used] = meta.anc
        head = self._sizes32["ctx_lens"] + 2 * self.config.max_rows + b * self.width    # through the used tables
        blocking = self._copied is None
        self.dev64.flat.copy_(h64.flat, non_blocking=not blocking)
        self.dev32.flat[:head].copy_(h32.flat[:head], non_blocking=not blocking)
        self.dev32.anc[:used].copy_(h32.anc[:used], non_blocking=not blocking)
        if self._copied is not None:
            self._copied.record()
        return Loaded(rows, sum(s.num_new for s in batch.seqs), offsets[:len(batch.seqs) + 1])

    def load_scratch(self, rows: int) -> None:
        """Inputs whose every row is a padding row (writing only the scratch blocks): what a
        graph is captured on."""
        self.load(ForwardBatch([]), rows)

    @torch.inference_mode()
    def run(self, rows: int, taps: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The forward over the first `rows` of the buffers: (logits [rows, vocab], taps), with no
        host work that depends on a value (what a CUDA graph captures)."""
        d64 = self.dev64
        return self.net(d64.ids[:rows], d64.positions[:rows], d64.logits_rows[:rows], self.kv, self.backend,
                        self._meta(rows), taps)

    def _meta(self, rows: int) -> PagedAttnMeta:
        """The attention's view of the buffers for a bucket, made once."""
        if rows not in self._metas:
            d32, d64 = self.dev32, self.dev64
            self._metas[rows] = PagedAttnMeta(
                block_tables=d32.block_tables.view(-1, self.width), ctx_lens=d32.ctx_lens, tok_seq=d32.tok_seq[:rows],
                n_new=d32.n_new[:rows], anc_offsets=d64.anc_offsets[:rows], anc=d32.anc, slot_mapping=d64.slots[:rows],
                block_size=self.kv.block_size, q_lens=[rows])
        return self._metas[rows]
