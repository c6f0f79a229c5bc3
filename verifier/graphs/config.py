"""Which steps a CUDA graph runs: the row buckets, and what sends a step to the eager path."""
from __future__ import annotations

from dataclasses import dataclass

from verifier.checks import positive_int


@dataclass(frozen=True)
class GraphConfig:
    """`enabled` False is vLLM's `--enforce-eager`. A step runs from a graph when its new rows fit
    `max_rows` (rounded up to the next bucket: 1, 2, 4, ... `max_rows`) and no sequence brings
    more than `max_seq_rows` of them (a decode token or a verify tree, not a prompt chunk).
    `cpu_proof`: a CPU target on the Triton backend (TRITON_INTERPRET=1) runs the same padded
    steps from the same buffers, eagerly: how the tests prove on the CPU what a GPU captures."""

    enabled: bool = True
    max_rows: int = 256
    max_seq_rows: int = 64
    cpu_proof: bool = False

    def __post_init__(self):
        positive_int("max_rows", self.max_rows)
        positive_int("max_seq_rows", self.max_seq_rows)

    @property
    def buckets(self) -> tuple[int, ...]:
        """Powers of two below `max_rows`, then `max_rows`."""
        out, b = [], 1
        while b < self.max_rows:
            out.append(b)
            b *= 2
        return (*out, self.max_rows)

    def bucket(self, rows: int) -> int | None:
        """The fewest bucketed rows that hold `rows`; None past the largest."""
        return next((b for b in self.buckets if b >= rows), None)

    def scratch_blocks(self, block_size: int) -> int:
        """KV blocks set aside for padding rows: a whole bucket of them (the capture's own step)."""
        return -(-self.max_rows // block_size)
