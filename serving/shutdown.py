"""Stopping `tercel serve`: a deadline for the requests still running, and exit status 0."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import uvicorn

from serving.bridge import EngineBridge

log = logging.getLogger("tercel.serve")
BACKSTOP_S = 5   # uvicorn cancels handlers this long after the grace: for one that never ends after the abort
HURRY_S = 1.0    # after a second signal, time for the handlers to send their aborted replies


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with a deadline for the requests still running when it is told to stop.

    On SIGTERM or SIGINT uvicorn stops accepting and waits for the open requests. Once grace_s
    has passed, the bridge aborts every request still running: the engine frees their KV blocks
    and each handler ends its reply as usual, with finish_reason "abort" (a 200, or a stream that
    ends with [DONE]). Left to itself, uvicorn would cancel the handler tasks instead, and the
    clients would see a 500 or a cut stream. A second signal aborts them at once, and uvicorn
    stops waiting for the handlers HURRY_S later."""

    def __init__(self, config: uvicorn.Config, bridge: EngineBridge, grace_s: float):
        super().__init__(config)
        self.bridge, self.grace_s = bridge, grace_s
        self.hurry = False           # a second signal came

    def handle_exit(self, sig, frame) -> None:
        # A signal handler, run between two bytecodes of the event loop: set flags, nothing more.
        # uvicorn would force_exit on a second SIGINT (not SIGTERM), cutting every open reply.
        if self.should_exit:
            self.hurry = True
        else:
            super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        log.info("stopping: %d request(s) running, %gs to finish them", self.bridge.in_flight, self.grace_s)
        # main_loop sees should_exit within 0.1 s, so the grace counts from (about) the signal.
        grace = asyncio.get_running_loop().call_later(self.grace_s, self._abort_running, "the grace is over")
        hurry = asyncio.create_task(self._on_second_signal())
        try:
            await super().shutdown(sockets)
        finally:
            grace.cancel()
            hurry.cancel()
        if self.force_exit:    # uvicorn skips the app's shutdown: stop the engine while the loop is open
            self.bridge.shutdown(0)

    async def _on_second_signal(self) -> None:
        while not self.hurry:
            await asyncio.sleep(0.1)
        self._abort_running("a second signal came")
        await asyncio.sleep(HURRY_S)
        self.force_exit = True       # uvicorn stops waiting for the handlers; the rest are cancelled

    def _abort_running(self, why: str) -> None:
        if self.bridge.in_flight:
            log.warning("%s: aborting %d running request(s)", why, self.bridge.in_flight)
        self.bridge.abort_all()


@contextlib.contextmanager
def signals_resent_as_no_ops():
    """uvicorn re-raises the signals it handled once it has stopped, under the handlers it found
    when it started. No-ops there make a graceful stop on SIGTERM or SIGINT exit with status 0
    (not -15, or a KeyboardInterrupt); the handlers from before come back afterwards."""
    before = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
