"""The kernel plan an earlier load of a GGUF chose, found before its first layer is packed.

A load packs the first layer for every kernel that takes it, to time them or to read this
machine's timings for its shapes (`verifier.quantized.quantize.tune`). A later load of the same
file needs only the kernel those timings chose: `remember` notes, per file (its tensors' names,
kinds and shapes, never their values) and machine, the timings' key and the kernels the plan
chooses among; `recall` reads both back into the plan and the timings, so that the first layer
is packed like the others, straight from the file. Nothing is timed here: the timings stay
`verifier.quantized.matmul_paths`'s, kept only where measured quiet.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from verifier.cpu.machine import cached_measurement, cached_only
from verifier.model.gguf_quant import INDEX_FILE
from verifier.quantized.matmul_paths import KernelPlan, KernelTimings, cached_timings

FORMAT = 1


def _key(model_dir: Path, model_key: dict, rows: tuple[int, ...], sources: dict) -> dict | None:
    """What a file's plan depends on beside the machine: its tensors, how it is served, the row
    counts timed, the kernels' sources. None where the folder holds no GGUF's tensor index."""
    index = Path(model_dir) / INDEX_FILE
    tensors = json.loads(index.read_text()).get("all") if index.is_file() else None
    if tensors is None:
        return None
    shapes = json.dumps([[t["name"], t["kind"], t["shape"]] for t in tensors])
    return {"format": FORMAT, "tensors": hashlib.sha256(shapes.encode()).hexdigest()[:16], **model_key,
            "rows": list(rows), **sources}


def remember(model_dir: Path, model_key: dict, rows: tuple[int, ...], sources: dict, timings_key: dict,
             choices: tuple[str, ...], cache_dir: Path | None, threads: int | None) -> None:
    key = _key(model_dir, model_key, rows, sources)
    if key is not None and cache_dir is not None:
        memo = {"timings_key": timings_key, "choices": list(choices)}
        cached_measurement(cache_dir, "plan-", key, lambda: memo, dict, dict, threads=threads)


def recall(model_dir: Path, model_key: dict, rows: tuple[int, ...], sources: dict, cache_dir: Path | None,
           threads: int | None) -> tuple[KernelPlan, KernelTimings] | None:
    """The plan and timings an earlier load of this file found on this machine, or None."""
    key = _key(model_dir, model_key, rows, sources)
    memo = None if key is None else cached_only(cache_dir, "plan-", key, dict, threads)
    timings = None if memo is None else cached_timings(rows, memo["timings_key"], cache_dir, threads)
    return None if timings is None else (timings.plan(tuple(memo["choices"])), timings)
