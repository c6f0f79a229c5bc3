"""The async bridge: the engine runs in one background thread, and every call from the server
into the engine goes through here.

The event loop never calls the engine. It puts one typed message in the inbox (`Add`,
`Abort`, `AbortAll`, `Call`) and wakes the engine thread, which handles the messages between
two steps. Each request's outputs flow back into its own asyncio queue, handed over with
`loop.call_soon_threadsafe`, the only path from the engine thread to the loop.

What the event loop reads without a message, all of it safe on any thread: `limits` (the
engine's EngineLimits, frozen, captured at launch) to refuse a request before it queues;
`tokenizer`, to tokenize prompts and apply the chat template (it reads only files loaded at
launch, no engine state); `stats`, the EngineStats snapshot the engine thread publishes after
each step and when it goes idle; and the bridge's own counters (`in_flight`, `alive`).

Lifecycle of one request: `submit()` (event loop) -> Add -> `engine.add_request` (engine
thread; a ValueError goes back to the stream as an error) -> each step's RequestOutput -> the
stream's queue (all of a step's outputs in one hand-over) -> the handler. `cancel()` (client gone) sends an Abort; the engine thread
frees the request's KV blocks before its next step.

With `check_integrity_when_idle` (TERCEL_DEBUG=1, `tercel serve --log-level debug`, the tests'
LiveServer) the engine thread checks the KV block pool and the scheduler each time it goes
idle. A failure is logged as critical, kept in `integrity_error`, and /health answers 503.

`EngineBridge.launch` also builds the engine on that thread, so that one thread does all
the tensor work. On CPU, OpenMP (libgomp) stops spin-waiting between parallel regions once
more threads run them than there are cores: an engine loaded on the main thread and stepped
on another left two OpenMP teams, and every matmul of every step paid a thread wake-up: a
decode step took far longer than with one team (figures: docs/performance.md, "OpenMP thread
teams").
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from serving.metrics import Metrics
from spec.engine import LLMEngine
from spec.faults import RequestError
from spec.request import RequestOutput, Submission
from spec.stats import EngineLimits, EngineStats

log = logging.getLogger("tercel.serve")


def debug_from_env() -> bool:
    """TERCEL_DEBUG=1 (any value but empty or 0) turns on the bridge's self-checks."""
    return os.environ.get("TERCEL_DEBUG", "") not in ("", "0")


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-queue allows."""


class EngineUnavailable(RuntimeError):
    """The engine cannot serve this request: it stopped, failed a step no request owns, or is
    shutting down (a 503). The message is safe to show a client."""


class RequestFailed(RuntimeError):
    """The engine failed this request alone (spec/faults.py): `error.invalid` is its own fault
    (a 400 with the message), else a 500 whose details stay in the server's log."""

    def __init__(self, error: RequestError):
        super().__init__(error.message)
        self.error = error


class SlowReader(RuntimeError):
    """The client read so little that its stream's buffer filled: its request was aborted."""


# ---- the inbox: one message per operation, handled on the engine thread between two steps ----
@dataclass(frozen=True)
class Add:
    """Queue a request; its outputs (or its refusal, an exception) go to `stream`."""
    request_id: str
    submission: Submission
    stream: RequestStream


@dataclass(frozen=True)
class Abort:
    """End one request now (finish_reason "abort"); its KV blocks go back to the pool."""
    request_id: str


@dataclass(frozen=True)
class AbortAll:
    """Abort every request added so far."""


@dataclass(frozen=True)
class Call:
    """Run fn(engine); its result or its exception is set on `done`, a future of the event loop."""
    fn: Callable[[LLMEngine], object]
    done: asyncio.Future


Message = Add | Abort | AbortAll | Call


class RequestStream:
    """One request's outputs as an async iterator; ends after the finished output. At most
    `buffer` outputs wait unread (each holds the whole output so far): past that the client is
    not reading, and its request is aborted (SlowReader)."""

    def __init__(self, bridge: "EngineBridge", request_id: str, loop: asyncio.AbstractEventLoop,
                 num_prompt_tokens: int, buffer: int = 64):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._bridge, self._loop = bridge, loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer = buffer
        self._overflowed = False
        self.done = False

    def _push(self, item) -> None:          # engine thread (or the loop, for a refusal)
        _call_soon(self._loop, self._offer, item)

    def _offer(self, item) -> None:         # event loop
        if self._overflowed:
            return
        if isinstance(item, RequestOutput) and not item.finished and self._queue.qsize() >= self._buffer:
            self._overflowed = True
            self._queue.put_nowait(SlowReader(f"the client read none of the last {self._buffer} outputs"))
            self._bridge.abort(self.request_id)
            return
        self._queue.put_nowait(item)

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
    def __init__(self, metrics: Metrics, max_queue: int = 256, check_integrity_when_idle: bool | None = None,
                 stream_buffer: int = 64):
        """Use `launch`: it builds the engine on the bridge's own thread.
        `check_integrity_when_idle`: None takes it from TERCEL_DEBUG (see the module's docstring)."""
        self.engine: LLMEngine | None = None   # the engine thread's alone (tests reach in on purpose)
        self.limits: EngineLimits | None = None   # set at launch, frozen
        self.tokenizer = None                    # set at launch; safe on the event loop
        self.grammars = None                     # the engine's GrammarBackend, set at launch; thread-safe
        self.stats = EngineStats()               # the engine's last published snapshot
        self.metrics, self.max_queue = metrics, max_queue
        self.check_integrity_when_idle = debug_from_env() if check_integrity_when_idle is None \
            else check_integrity_when_idle
        self.integrity_error: Exception | None = None   # the first failed idle check
        # A step failed that no request owned; cleared once a probe forward and the pool check pass.
        self.step_error: Exception | None = None
        self._died: BaseException | None = None       # what ended the engine thread, if anything
        self.stream_buffer = stream_buffer
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
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
    def launch(cls, make_engine: Callable[[], LLMEngine], metrics: Metrics, max_queue: int = 256,
               check_integrity_when_idle: bool | None = None, stream_buffer: int = 64) -> "EngineBridge":
        """Build the engine on the engine thread, start stepping it there, and return once it
        is loaded; a failure to build is raised here."""
        bridge = cls(metrics, max_queue, check_integrity_when_idle, stream_buffer)
        ready, failed = threading.Event(), []

        def main() -> None:
            try:
                engine = bridge.engine = make_engine()
                bridge.limits, bridge.tokenizer, bridge.grammars = engine.limits(), engine.tokenizer, engine.grammars
                bridge._publish()
            except BaseException as e:   # handed to the caller, which reports it
                failed.append(e)
                return
            finally:
                ready.set()
            try:
                bridge._run()
            except BaseException as e:   # noqa: BLE001 - no request may wait on a dead thread
                bridge._die(e)
            engine.close()           # the tensor-parallel worker processes, if any

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
    def problem(self) -> str | None:
        """Why the engine cannot be trusted to serve (/health answers 503 with it), or None."""
        if not self.alive:
            return "engine stopped"
        if self.step_error is not None:
            return "an engine step failed; recovering"
        if self.integrity_error is not None:
            return f"KV block pool failed its integrity check: {self.integrity_error}"
        return None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, sub: Submission) -> RequestStream:
        # Capacity = the running slots plus the queue; counted here, on the event loop, so a
        # burst is refused before the engine thread has even seen it.
        problem = self.problem
        if problem is not None and self.integrity_error is None:
            raise EngineUnavailable(problem)
        slots = self.limits.max_num_seqs
        if self._in_flight >= slots + self.max_queue:
            raise QueueFullError(f"{self._in_flight - slots} requests are waiting (limit {self.max_queue})")
        rid = f"req-{next(self._ids)}"
        stream = RequestStream(self, rid, asyncio.get_running_loop(), len(sub.prompt_token_ids),
                               self.stream_buffer)
        self._add_in_flight(1)
        self._send(Add(rid, sub, stream))
        if not self.alive:        # the thread died after the check: nothing will drain the inbox
            self._drain_dead()
        return stream

    def _add_in_flight(self, delta: int) -> None:
        with self._count_lock:
            self._in_flight += delta

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def abort_all(self) -> None:
        """Abort every request now: each ends with finish_reason "abort", which its handler
        sends as a normal reply, and the engine frees its KV blocks (shutdown's grace is over)."""
        self._send(AbortAll())

    async def reset_prefix_cache(self) -> int:
        """Drop the unused cached blocks; returns how many."""
        return await self.call(LLMEngine.reset_prefix_cache)

    async def call(self, fn: Callable[[LLMEngine], object]):
        """fn(engine) between two steps, on the thread that owns the engine; its result or
        its exception comes back here."""
        done = asyncio.get_running_loop().create_future()
        self._send(Call(fn, done))
        return await done

    def _send(self, msg: Message) -> None:
        self._inbox.put(msg)
        self._wake.set()

    def shutdown(self, grace_s: float) -> None:
        """Stop after in-flight requests finish, or abort them once grace_s has passed."""
        deadline = time.monotonic() + grace_s
        while self._in_flight and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        self.abort_all()
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._release_engine()

    def _release_engine(self) -> None:
        """The engine thread has ended: close the engine and drop it, so that its weights and KV
        pool go now, not with the bridge (FastAPI's dependency caches keep the routes, which hold
        the bridge, for the life of the process)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    # ---- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine, idle_seen = self.engine, False
        while True:
            if self._drain_inbox():
                idle_seen = False            # a call may have changed the pool
            if self._stop.is_set() and not engine.has_unfinished:
                return
            if not engine.has_unfinished:
                if self.step_error is not None and not self._recover():
                    time.sleep(0.5)                  # unhealthy: probe again, no tight loop
                if not idle_seen:
                    self._on_idle()
                    idle_seen = True
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            idle_seen = False
            try:
                outputs = engine.step()
            except Exception as e:   # no request owns it (the engine isolates those): fail them all
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self._publish()
            self._deliver_all(outputs)

    def _die(self, e: BaseException) -> None:
        """The engine thread is ending on an exception: every request waiting now or later is told."""
        log.critical("the engine thread died", exc_info=e)
        self._died = e
        self._stop.set()
        self._drain_dead()

    def _drain_dead(self) -> None:
        """With no engine thread: refuse every message in the inbox and fail every stream."""
        gone = EngineUnavailable("the engine stopped")
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(msg, Add):
                msg.stream._push(gone)
                self._add_in_flight(-1)
            elif isinstance(msg, Call):
                msg.done.get_loop().call_soon_threadsafe(_set_exception, msg.done, gone)
        for rid, stream in list(self._streams.items()):
            stream._push(gone)
            self._add_in_flight(-1)
        self._streams.clear()

    def _publish(self) -> None:
        self.stats = self.engine.stats()     # one reference swap: readers see this or the last
        self.metrics.engine_state(self.stats)

    def _on_idle(self) -> None:
        self._publish()
        if not self.check_integrity_when_idle:
            return
        try:
            self.engine.check_integrity()
        except Exception as e:   # AssertionError names the inconsistency; anything else is as bad
            log.critical("KV block pool failed its integrity check while idle: %s", e, exc_info=True)
            self.integrity_error = self.integrity_error or e

    def _drain_inbox(self) -> int:
        """Handle every waiting message; returns how many."""
        handled = 0
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return handled
            handled += 1
            match msg:
                case Add(rid, sub, stream):
                    self._add(rid, sub, stream)
                case Abort(rid):
                    self.engine.abort(rid)
                case AbortAll():
                    for rid in list(self._streams):
                        self.engine.abort(rid)
                case Call(fn, done):
                    self._call(fn, done)
                case _:
                    raise TypeError(f"not a bridge message: {msg!r}")

    def _call(self, fn: Callable[[LLMEngine], object], done: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except Exception as e:   # the caller gets it; the engine thread carries on
            done.get_loop().call_soon_threadsafe(done.set_exception, e)
            return
        done.get_loop().call_soon_threadsafe(done.set_result, result)

    def _add(self, rid: str, sub: Submission, stream: RequestStream) -> None:
        if self._stop.is_set():
            self._add_in_flight(-1)
            stream._push(EngineUnavailable("the server is shutting down"))
            return
        try:
            self.engine.add_request(rid, sub)
        except Exception as e:   # noqa: BLE001 - this request's alone; a ValueError is its own fault
            self._add_in_flight(-1)
            invalid = isinstance(e, ValueError)
            self.metrics.errors.labels(reason="invalid_request" if invalid else "request_error").inc()
            if not invalid:
                log.error("%s could not be queued", rid, exc_info=e)
            stream._push(e if invalid else RequestFailed(RequestError.of(e)))
            return
        self._streams[rid] = stream

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs reach the event loop in one wake-up, not one per request: each
        `call_soon_threadsafe` writes to the loop's self-pipe, and on a busy CPU every wake-up
        waits for a time slice (docs/performance.md, "Shared CPUs")."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = {}
        for out in outputs:
            delivery = self._deliver(out)
            if delivery is not None:
                by_loop.setdefault(delivery[0]._loop, []).append(delivery)
        for loop, deliveries in by_loop.items():
            _call_soon(loop, _offer_each, deliveries)

    def _deliver(self, out: RequestOutput) -> tuple[RequestStream, object] | None:
        """The bookkeeping for one output; returns (its stream, what to hand it), or None."""
        stream = self._streams.get(out.request_id)
        if stream is None:
            return None
        now = time.perf_counter()
        if out.delta_token_ids:
            last = self._last_token_time.get(out.request_id)
            if last is None and out.ttft is not None:
                self.metrics.ttft.observe(out.ttft)
            elif last is not None:
                self.metrics.itl.observe((now - last) / len(out.delta_token_ids))
            self._last_token_time[out.request_id] = now
        if out.error is not None:
            return stream, self._fail_one(out)
        if out.finished:
            del self._streams[out.request_id]
            self._last_token_time.pop(out.request_id, None)
            self._add_in_flight(-1)
            self.metrics.finished(out, stream.num_prompt_tokens)
            if out.finish_reason == "abort":
                self.metrics.errors.labels(reason="cancelled").inc()
            self._log(out, stream)
        return stream, out

    def _fail_all(self, e: Exception) -> None:
        """Abort every request, see whether the engine is whole again, then tell the clients:
        one that retries at once meets the engine as it is, not as it was mid-recovery."""
        self.step_error = e      # /health answers 503 until _recover passes
        failed = list(self._streams.items())
        for rid, _ in failed:
            self.engine.abort(rid)
        self._streams.clear()
        try:
            self.engine.step()   # drain the abort outputs; the pool is whole again
        except Exception:        # the thread must survive to serve the next requests
            log.exception("engine step failed again while aborting the failed requests")
        self._recover()
        for _, stream in failed:
            stream._push(EngineUnavailable("the engine failed a step; the request was lost"))
            self.metrics.errors.labels(reason="engine_error").inc()
            self._add_in_flight(-1)

    def _recover(self) -> bool:
        """After a failed step: healthy again once a scratch forward and the pool check pass."""
        try:
            self.engine.check_integrity()
            ok = self.engine.probe()
        except Exception:   # noqa: BLE001 - still broken; tried again when idle
            log.exception("the engine has not recovered")
            ok = False
        if ok:
            log.warning("the engine recovered from a failed step")
            self.step_error = None
        return ok

    def _fail_one(self, out: RequestOutput) -> RequestFailed:
        """The engine failed this request alone: its stream gets the error, the others nothing."""
        del self._streams[out.request_id]
        self._last_token_time.pop(out.request_id, None)
        self._add_in_flight(-1)
        reason = "invalid_request" if out.error.invalid else "request_error"
        self.metrics.errors.labels(reason=reason).inc()
        log.warning("%s failed alone: %s", out.request_id, out.error.message)
        return RequestFailed(out.error)

    @staticmethod
    def _log(out: RequestOutput, stream: RequestStream) -> None:
        tps = len(out.token_ids) / out.total_time if out.total_time else 0.0
        ttft = f"{out.ttft * 1e3:.0f}ms" if out.ttft is not None else "-"
        log.info("%s prompt=%d completion=%d ttft=%s tok/s=%.1f accepted_len=%.2f finish=%s",
                 out.request_id, stream.num_prompt_tokens, len(out.token_ids), ttft, tps,
                 out.stats.mean_accepted_length, out.finish_reason)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:                # the loop is closed: nobody is left to read it
        pass


def _offer_each(deliveries: list[tuple[RequestStream, object]]) -> None:   # event loop
    for stream, item in deliveries:
        stream._offer(item)


def _set_exception(future: asyncio.Future, e: Exception) -> None:
    if not future.done():
        future.set_exception(e)
