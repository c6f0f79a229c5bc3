"""What a load measures of a CPU target once per machine and target shape, beside the kernels'
own timings ($TERCEL_CACHE/kernels, through `verifier.cpu.machine.cached_measurement`: keyed by
the CPU, its flags, torch and the thread count, and not kept when other processes took the CPUs
while it was measured):

- the adaptive controller's cost curve (spec/step_cost.py): a load reads it where a quiet load
  of a target of the same shapes, weights and kernel plan timed it; steps then rescale it to the
  forwards they run (StepCost), as they do a curve timed at load;
- whether the forward gives the same bits on fewer threads (the thread governor's condition):
  the kernels split their work by shapes and thread counts, never by the weights' values, so
  the answer for one target's shapes, kernels and plan holds for every load of them."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from spec.step_cost import CostCurve
from verifier.cpu import cpu_ops
from verifier.cpu.cache import cache_root
from verifier.cpu.machine import cached_measurement
from verifier.target import TargetModel

FORMAT = 1      # bump when what a cached curve means changes


def cached_curve(target: TargetModel, rows: list[int], context: int, block_size: int, rounds: int,
                 time_curve: Callable[[], CostCurve]) -> CostCurve:
    """This machine's cached curve for `target` at these row counts after `context` tokens, else
    `time_curve()`'s, cached. Only a CPU target on one process is cached (a GPU's is timed at
    each load: the machine key names the CPU)."""
    cpu = target.device.type == "cpu" and target.shard.size == 1
    key = {"format": FORMAT, "target": target_key(target), "rows": rows, "context": context,
           "block_size": block_size, "rounds": rounds, "sources": cpu_ops.sources_digest()}
    return cached_measurement(cache_root() / "kernels" if cpu else None, "curve-", key, time_curve,
                              _to_json, _from_json)


def cached_thread_check(target: TargetModel, counts: list[int], check: Callable[[], bool]) -> bool:
    """`check()`'s answer (the same bits on each of `counts` threads), cached as the curve is."""
    cpu = target.device.type == "cpu" and target.shard.size == 1
    key = {"format": FORMAT, "target": target_key(target), "counts": counts, "sources": cpu_ops.sources_digest()}
    return cached_measurement(cache_root() / "kernels" if cpu else None, "threads-", key, check,
                              lambda same: {"same": same}, lambda d: bool(d["same"]))


def target_key(target: TargetModel) -> dict:
    """What a forward's speed depends on, beside the machine: the model's shapes, the weights'
    precision and the kernel plan their timings chose, the KV cache's dtype."""
    return {"config": dataclasses.asdict(target.config), "quantization": target.quantization,
            "runner": type(target.runner).__name__, "plan": repr(getattr(target.runner, "plan", None)),
            "dtype": str(target.dtype), "kv_dtype": str(target.kv_dtype)}


def _to_json(curve: CostCurve) -> dict:
    return {"rows": list(curve.rows), "ms": list(curve.ms)}


def _from_json(d: dict) -> CostCurve:
    return CostCurve(tuple(d["rows"]), tuple(d["ms"]))
