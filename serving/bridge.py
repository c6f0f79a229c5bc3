"""The async bridge: the engine runs in one background thread; HTTP handlers talk to it
through a thread-safe inbox, and each request's outputs flow back into its own asyncio
queue (handed over with `loop.call_soon_threadsafe`, the only cross-thread path).

Lifecycle of one request: `submit()` (event loop) -> inbox -> `engine.add_request`
(engine thread; a ValueError goes back to the stream as an error) -> each step's
RequestOutput -> the stream's queue -> the handler. `cancel()` (client gone) puts an
abort in the inbox; the engine thread frees the request's KV blocks before its next step.

`EngineBridge.launch` also builds the engine on that thread, so that one thread does all
the tensor work. On CPU, OpenMP (libgomp) stops spin-waiting between parallel regions once
more threads run them than there are cores: an engine loaded on the main thread and stepped
on another left two OpenMP teams, and every matmul of every step paid a thread wake-up
(SmolLM2 decode step, 2 threads: 43 ms against 28 ms with one team).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from drafters.config import SpecConfig
from spec.engine import LLMEngine
from spec.request import RequestOutput
from verifier.sampling_params import SamplingParams
from serving.metrics import Metrics

log = logging.getLogger("tercel.serve")


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue allows."""


@dataclass
class Submission:
    prompt_token_ids: list[int]
    params: SamplingParams
    speculate: bool = True
    speculation: SpecConfig | None = None


class RequestStream:
    """One request's outputs as an async iterator; ends after the finished output."""

    def __init__(self, bridge: "EngineBridge", request_id: str, loop: asyncio.AbstractEventLoop,
                 num_prompt_tokens: int):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._bridge, self._loop = bridge, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def _push(self, item) -> None:          # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Exception):
            self.done = True
            raise item
        self.done = item.finished
        return item

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._bridge.abort(self.request_id)


class EngineBridge:
    def __init__(self, metrics: Metrics, max_queue: int = 256):
        """Use `launch`: it builds the engine on the bridge's own thread."""
        self.engine: LLMEngine | None = None
        self.metrics, self.max_queue = metrics, max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._in_flight = 0                # submitted, not yet finished; both threads change it
        self._count_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_token_time: dict[str, float] = {}

    # ---- event-loop side --------------------------------------------------------------
    @classmethod
    def launch(cls, make_engine: Callable[[], LLMEngine], metrics: Metrics, max_queue: int = 256) -> "EngineBridge":
        """Build the engine on the engine thread, start stepping it there, and return once it
        is loaded; a failure to build is raised here."""
        bridge = cls(metrics, max_queue)
        ready, failed = threading.Event(), []

        def main() -> None:
            try:
                bridge.engine = make_engine()
            except BaseException as e:   # handed to the caller, which reports it
                failed.append(e)
                return
            finally:
                ready.set()
            bridge._run()

        bridge._thread = threading.Thread(target=main, name="tercel-engine", daemon=True)
        bridge._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return bridge

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, sub: Submission) -> RequestStream:
        # Capacity = the running slots plus the queue; counted here, on the event loop, so a
        # burst is refused before the engine thread has even seen it.
        slots = self.engine.config.max_num_seqs
        if self._in_flight >= slots + self.max_queue:
            raise QueueFullError(f"{self._in_flight - slots} requests are waiting (limit {self.max_queue})")
        rid = f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, asyncio.get_running_loop(), len(sub.prompt_token_ids))
        self._add_in_flight(1)
        self._inbox.put(("add", rid, sub, stream))
        self._wake.set()
        return stream

    def _add_in_flight(self, delta: int) -> None:
        with self._count_lock:
            self._in_flight += delta

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id, None, None))
        self._wake.set()

    def abort_all(self) -> None:
        """Abort every request now: each ends with finish_reason "abort", which its handler
        sends as a normal reply, and the engine frees its KV blocks (shutdown's grace is over)."""
        self._inbox.put(("abort_all", None, None, None))
        self._wake.set()

    async def reset_prefix_cache(self) -> int:
        """Drop the unused cached blocks; returns how many."""
        return await self._on_engine_thread(lambda engine: engine.blocks.reset_prefix_cache())

    async def _on_engine_thread(self, fn: Callable[[LLMEngine], object]):
        """fn(engine) between two steps, on the thread that owns the engine; its result or
        its exception comes back here."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(("call", None, fn, done))
        self._wake.set()
        return await done

    def shutdown(self, grace_s: float) -> None:
        """Stop after in-flight requests finish, or abort them once grace_s has passed."""
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self.abort_all()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    # ---- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            self._drain_inbox()
            if self._stop.is_set() and not engine.has_unfinished:
                return
            if not engine.has_unfinished:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:   # an engine bug: fail every request rather than hang them
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self.metrics.engine_state(engine)
            for out in outputs:
                self._deliver(out)

    def _drain_inbox(self) -> None:
        while True:
            try:
                # (op, request id, payload, where the answer goes): ("add", rid, Submission,
                # RequestStream), ("abort", rid, None, None), ("call", None, fn, Future), ("abort_all", ...)
                op, rid, payload, reply = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                self._add(rid, payload, reply)
            elif op == "abort":
                self.engine.abort(rid)
            elif op == "call":
                self._call(payload, reply)
            else:
                for r in list(self._streams):
                    self.engine.abort(r)

    def _call(self, fn, done: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as e:   # the caller gets it; the engine thread carries on
            done.get_loop().call_soon_threadsafe(done.set_exception, e)
            return
        done.get_loop().call_soon_threadsafe(done.set_result, result)

    def _add(self, rid: str, sub: Submission, stream: RequestStream) -> None:
        if self._stop.is_set():
            self._add_in_flight(-1)
            stream._push(RuntimeError("the server is shutting down"))
            return
        try:
            self.engine.add_request(rid, None, sub.params, prompt_token_ids=sub.prompt_token_ids,
                                    speculate=sub.speculate, speculation=sub.speculation)
        except ValueError as e:
            self._add_in_flight(-1)
            self.metrics.errors.labels(reason="invalid_request").inc()
            stream._push(e)
            return
        self._streams[rid] = stream

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        now = time.perf_counter()
        if out.delta_token_ids:
            last = self._last_token_time.get(out.request_id)
            if last is None and out.ttft is not None:
                self.metrics.ttft.observe(out.ttft)
            elif last is not None:
                self.metrics.itl.observe((now - last) / len(out.delta_token_ids))
            self._last_token_time[out.request_id] = now
        if out.finished:
            del self._streams[out.request_id]
            self._last_token_time.pop(out.request_id, None)
            self._add_in_flight(-1)
            self.metrics.finished(out, stream.num_prompt_tokens)
            if out.finish_reason == "abort":
                self.metrics.errors.labels(reason="cancelled").inc()
            self._log(out, stream)
        stream._push(out)

    def _fail_all(self, e: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream._push(RuntimeError(f"engine error: {e}"))
            self.metrics.errors.labels(reason="engine_error").inc()
            self._add_in_flight(-1)
        self._streams.clear()
        try:
            self.engine.step()   # drain the abort outputs; the pool is whole again
        except Exception:        # the thread must survive to serve the next requests
            log.exception("engine step failed again while aborting the failed requests")

    @staticmethod
    def _log(out: RequestOutput, stream: RequestStream) -> None:
        tps = len(out.token_ids) / out.total_time if out.total_time else 0.0
        ttft = f"{out.ttft * 1e3:.0f}ms" if out.ttft is not None else "-"
        log.info("%s prompt=%d completion=%d ttft=%s tok/s=%.1f accepted_len=%.2f finish=%s",
                 out.request_id, stream.num_prompt_tokens, len(out.token_ids), ttft, tps,
                 out.stats.mean_accepted_length, out.finish_reason)
