"""Tensor-parallel target: rank 0 in the engine's process, ranks 1 .. N-1 in spawned workers.

Rank 0 runs the whole engine (scheduler, block manager, drafters) once, as vLLM's driver
worker does. Its target is a `ParallelTarget`: each operation the engine asks of the target
(`allocate_kv`, `forward`, `copy_slots`) is first sent to every worker, then run on rank 0's
own shard; the workers run the same operation on theirs, and the forward's collectives
(`verifier/model/parallel_layers.py`) join the ranks. Only rank 0 gets the logits.

Two channels, for two jobs:
- the plan of each operation (a `ForwardBatch`: ints, lists and small bool masks) goes over a
  multiprocessing pipe per worker, pickled: a worker idles on its pipe between requests for as
  long as the server does, where a torch.distributed broadcast would time out, and it reads
  EOF, and exits, when rank 0's process is gone;
- tensors cross through torch.distributed: NCCL on CUDA, gloo on CPU, rendezvous over a free
  localhost port (TP runs on one node).
"""
from __future__ import annotations

import atexit
import logging
import pickle
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verifier.batch import ForwardBatch, ForwardOutput
from verifier.model.loader import resolve_model_dir
from verifier.model.shard import TensorShard, check_tp_quantization
from verifier.target import TargetModel, default_device, load_config

log = logging.getLogger("tercel.parallel")
# A collective that waits this long has lost a rank; also the rendezvous's limit.
TIMEOUT_S = 300
JOIN_S = 30            # a worker asked to stop gets this long before it is terminated


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to load its shard and join the group (pickled into the worker)."""
    model: str
    device: str               # this rank's device: "cpu" or "cuda:<rank>"
    backend: str | None       # attention backend; None: the device's default
    shard: TensorShard
    port: int                 # rank 0's TCP store on 127.0.0.1
    num_threads: int          # torch CPU threads of this process

    @property
    def group_backend(self) -> str:
        return "nccl" if self.device.startswith("cuda") else "gloo"


# ---- operations sent to the workers (each runs the same call on the worker's shard) -------
# `replies`: the worker answers with a Reply (set-up steps, which may fail on one rank: out of
# memory); the per-step operations do not, so a step costs one message per worker.
@dataclass(frozen=True)
class AllocateKV:
    replies = True
    num_blocks: int
    block_size: int

    def run(self, target: TargetModel) -> None:
        target.allocate_kv(self.num_blocks, self.block_size)


@dataclass(frozen=True)
class Forward:
    replies = False
    batch: ForwardBatch

    def run(self, target: TargetModel) -> None:
        target.forward(self.batch)          # the logits were gathered on rank 0: drop this rank's


@dataclass(frozen=True)
class CopySlots:
    replies = False
    src: list[int]
    dst: list[int]

    def run(self, target: TargetModel) -> None:
        target.copy_slots(self.src, self.dst)


@dataclass(frozen=True)
class Shutdown:
    replies = False

    def run(self, target: TargetModel) -> None:
        pass


@dataclass(frozen=True)
class Reply:
    """A worker's answer to loading and to AllocateKV: None, or the error it raised."""
    error: str | None = None


# ---- rank 0 -------------------------------------------------------------------------------
class ParallelTarget(TargetModel):
    """Rank 0 of a tensor-parallel target: the engine sees a TargetModel whose `forward` returns
    the full logits and the full tapped hidden states (the residual stream is whole after each
    all-reduce), so drafters that run on rank 0 read what they would read on one device."""

    def __init__(self, model: str, size: int, device: str | None = None, backend: str | None = None,
                 num_threads: int | None = None):
        TensorShard(0, size).check(load_config(resolve_model_dir(model)))   # before any process starts
        specs = _rank_specs(model, size, device, backend, num_threads or torch.get_num_threads())
        self._closed, self._joined = False, False
        self._conns, self._procs = _spawn(specs[1:])
        atexit.register(self.close)
        try:
            _join_group(specs[0])
            self._joined = True
            super().__init__(model, device=specs[0].device, backend=backend, quantization="none",
                             shard=specs[0].shard)     # the workers load their shards meanwhile
            self._replies("load")
        except BaseException:
            self.close()
            raise

    @property
    def worker_processes(self) -> list:
        """Ranks 1 .. N-1, in order (multiprocessing Process objects)."""
        return list(self._procs)

    def allocate_kv(self, num_blocks: int, block_size: int) -> None:
        self._send(AllocateKV(num_blocks, block_size))
        super().allocate_kv(num_blocks, block_size)
        self._replies("allocate the KV cache")

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        self._send(Forward(batch))
        return super().forward(batch)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self._send(CopySlots(src, dst))
        super().copy_slots(src, dst)

    def close(self) -> None:
        """Stop the workers (they leave the group) and leave it; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(Shutdown()))
            except (BrokenPipeError, OSError):
                pass                                  # that worker is gone already
        for proc in self._procs:
            proc.join(JOIN_S)
            if proc.is_alive():     # it ignores SIGTERM (worker_main): kill it
                log.warning("tensor-parallel worker %s did not stop; killing it", proc.name)
                proc.kill()
                proc.join(JOIN_S)
        if self._joined:               # never a group this process had before (_join_group refuses one)
            dist.destroy_process_group()

    def _send(self, op) -> None:
        data = pickle.dumps(op)      # plain pickle: tensors by value, not torch's shared-memory handles
        for conn in self._conns:
            conn.send_bytes(data)

    def _replies(self, what: str) -> None:
        """Every worker's Reply to the last operation; RuntimeError naming a rank that failed."""
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            while not conn.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.exitcode}) "
                                       f"before it could {what}")
            reply = pickle.loads(conn.recv_bytes())
            if reply.error is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to {what}: {reply.error}")


def open_target(model: str, tensor_parallel_size: int = 1, device: str | None = None,
                backend: str | None = None, quantization: str = "none",
                kernel_rows: tuple[int, ...] | None = None, num_threads: int | None = None) -> TargetModel:
    """The engine's target: one TargetModel, or rank 0 of a tensor-parallel one (dense weights;
    `quantization` must then be "auto" or "none", `verifier/model/shard.py:check_tp_quantization`)."""
    if tensor_parallel_size == 1:
        return TargetModel(model, device=device, backend=backend, quantization=quantization,
                           kernel_rows=kernel_rows, tune_threads=num_threads)
    check_tp_quantization(quantization, tensor_parallel_size)
    return ParallelTarget(model, tensor_parallel_size, device=device, backend=backend, num_threads=num_threads)


def _rank_specs(model: str, size: int, device: str | None, backend: str | None,
                num_threads: int) -> list[RankSpec]:
    kind, port = torch.device(device).type if device else default_device().type, _free_port()
    return [RankSpec(model, _rank_device(kind, r, size), backend, TensorShard(r, size), port, num_threads)
            for r in range(size)]


def _spawn(specs: list[RankSpec]) -> tuple[list, list]:
    """One worker process per spec (spawned: a CUDA context must not be forked) and rank 0's end
    of its pipe: (connections, processes), in rank order."""
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for spec in specs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(spec, child), daemon=True,
                           name=f"tercel-tp-rank{spec.shard.rank}")
        proc.start()
        child.close()                # the worker holds it now; rank 0 keeps its own end
        conns.append(parent)
        procs.append(proc)
    return conns, procs


def _rank_device(kind: str, rank: int, size: int) -> str:
    if kind != "cuda":
        return "cpu"
    if torch.cuda.device_count() < size:
        raise ValueError(f"tensor_parallel_size {size} needs {size} CUDA devices, "
                         f"torch sees {torch.cuda.device_count()}")
    return f"cuda:{rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(spec: RankSpec) -> None:
    if dist.is_initialized():
        raise RuntimeError("tensor parallelism starts its own torch.distributed group, "
                           "but this process already has one")
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))
    dist.init_process_group(spec.group_backend, init_method=f"tcp://127.0.0.1:{spec.port}",
                            rank=spec.shard.rank, world_size=spec.shard.size, timeout=timedelta(seconds=TIMEOUT_S))


# ---- ranks 1 .. N-1 -----------------------------------------------------------------------
def worker_main(spec: RankSpec, conn) -> None:
    """A worker process: join the group, load this rank's shard, then run each operation rank 0
    sends until Shutdown, or until rank 0's end of the pipe closes."""
    # Rank 0 owns this process's life. Ctrl-C in a terminal, or a SIGTERM sent to the process
    # group, reaches every rank: rank 0 then lets running requests finish (the server's grace),
    # which needs this rank alive until rank 0 sends Shutdown or exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.num_threads)
    _join_group(spec)
    try:
        try:
            target = TargetModel(spec.model, device=spec.device, backend=spec.backend, quantization="none",
                                 load_tokenizer_files=False, shard=spec.shard)
        except Exception as e:
            conn.send_bytes(pickle.dumps(Reply(f"{type(e).__name__}: {e}")))
            return
        conn.send_bytes(pickle.dumps(Reply()))
        _serve(target, conn)
    finally:
        dist.destroy_process_group()
        conn.close()


def _serve(target: TargetModel, conn) -> None:
    while True:
        try:
            op = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return                                  # rank 0's process is gone
        if isinstance(op, Shutdown):
            return
        error = None
        try:
            op.run(target)
        except Exception as e:
            if not op.replies:
                raise     # a failed forward: exiting closes this rank's sockets, so rank 0's collective
                          # fails too instead of waiting for the timeout
            error = f"{type(e).__name__}: {e}"
        if op.replies:
            conn.send_bytes(pickle.dumps(Reply(error)))
