"""One CUDA graph per row bucket of a `StaticStep`, captured at load and replayed each step (as
vLLM, SGLang and gpt-fast do): a step then costs the host three copies and one launch instead of
a dozen launches per layer from Python.

The largest bucket is captured first and the others share its memory pool. Each capture runs
on inputs whose every row is a padding row, so it writes only the scratch KV blocks, and under
`no_host_sync`: a forward that reads a value on the host cannot be captured.
"""
from __future__ import annotations

import logging

import torch

from verifier.batch import ForwardBatch, ForwardOutput
from verifier.graphs.static_step import StaticStep
from verifier.graphs.sync_guard import no_host_sync

log = logging.getLogger(__name__)

WARMUP_RUNS = 2      # Triton compiles and cuBLAS sizes its workspace before a capture, not during


class StepGraphs:
    """`step`'s forward captured at each bucket, for the forwards that ask for `taps`."""

    def __init__(self, step: StaticStep, taps: tuple[int, ...]):
        self.step, self.taps = step, taps
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()      # capturing empties the cache too: it must not count against the graphs
        before = torch.cuda.memory_reserved()
        pool = None
        for rows in sorted(step.config.buckets, reverse=True):
            graph = torch.cuda.CUDAGraph()
            step.load_scratch(rows)
            self._warm_up(rows)
            # the guard inside the capture: entering and leaving it synchronise, by design
            with torch.cuda.graph(graph, pool=pool), no_host_sync():
                out = step.run(rows, taps)
            pool = graph.pool()
            self.graphs[rows] = (graph, out)
        torch.cuda.synchronize()
        self.bytes = torch.cuda.memory_reserved() - before
        log.info("CUDA graphs: %d buckets of up to %d rows captured, %.0f MB", len(self.graphs),
                 max(self.graphs), self.bytes / 1e6)

    def _warm_up(self, rows: int) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.step.run(rows, self.taps)
        torch.cuda.current_stream().wait_stream(side)

    def rows_for(self, batch: ForwardBatch) -> int | None:
        return self.step.rows_for(batch)

    def forward(self, batch: ForwardBatch, rows: int) -> ForwardOutput:
        loaded = self.step.load(batch, rows)
        graph, (logits, taps) = self.graphs[rows]
        graph.replay()
        return loaded.output(logits, taps, copy=True)     # the next replay writes the same tensors
