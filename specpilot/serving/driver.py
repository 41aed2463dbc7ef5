"""The engine's driver thread: the one thread that touches the Engine, fed through a thread-safe inbox.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from typing import Callable

from specpilot.serving.engine import Engine
from specpilot.serving.handles import Handle
from specpilot.serving.request import Request

log = logging.getLogger(__name__)
Sink = Callable[[list, "str | None"], None]


@dataclasses.dataclass(eq=False)
class Ticket:
    """A request the driver accepted: its engine handle (read it only in the driver thread) and sink."""

    handle: Handle
    sink: Sink


class EngineDriver:
    """Owns an Engine in a background thread; `submit`, `cancel` and `snapshot` are thread-safe."""

    def __init__(self, engine: Engine, idle_wait_s: float = 0.5):
        self.engine = engine
        self.idle_wait_s = float(idle_wait_s)
        self.last_error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: list[Ticket] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-driver", daemon=True)

    # ----------------------------------------------------------------------------------------------
    # Any thread

    def start(self) -> "EngineDriver":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """End the loop (live requests end with "cancelled") and join the thread."""
        self._inbox.put(("stop", None, None))
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request, sink: Sink) -> concurrent.futures.Future:
        """-> a Future of the request's Ticket, or of the engine's RequestError naming the bad field."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("submit", (request, sink), future))
        return future

    def cancel(self, ticket: Ticket) -> None:
        """End the request at the next step boundary (its sink then gets "cancelled")."""
        self._inbox.put(("cancel", ticket, None))

    def snapshot(self) -> concurrent.futures.Future:
        """-> a Future of {"live", "slots_in_use", "waiting", "steps"} read in the driver thread."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("snapshot", None, future))
        return future

    def _put(self, op) -> None:
        if not self.running:
            op[2].set_exception(RuntimeError("the engine driver is not running"))
            return
        self._inbox.put(op)

    # ----------------------------------------------------------------------------------------------
    # The driver thread

    def _loop(self) -> None:
        while not self._stopping:
            idle = not self.engine.busy
            try:
                op = self._inbox.get(timeout=self.idle_wait_s) if idle else self._inbox.get_nowait()
            except queue.Empty:
                op = None
            while op is not None:
                self._handle(op)
                try:
                    op = self._inbox.get_nowait()
                except queue.Empty:
                    op = None
            if self._stopping:
                break
            if self.engine.busy:
                try:
                    self.engine.step()
                except Exception as e:  # noqa: BLE001 -- one failed step must not end the server
                    log.exception("engine step failed")
                    self.last_error = e
                    self._fail_all()
            self._deliver()
        for ticket in self._live:
            self.engine.cancel(ticket.handle)
        self._deliver()

    def _handle(self, op) -> None:
        kind, arg, future = op
        if kind == "submit":
            request, sink = arg
            if not future.set_running_or_notify_cancel():
                return
            try:
                ticket = Ticket(self.engine.submit(request), sink)
            except Exception as e:  # noqa: BLE001 -- RequestError (or any refusal) goes to that caller only
                future.set_exception(e)
                return
            self._live.append(ticket)
            future.set_result(ticket)
        elif kind == "cancel":
            self.engine.cancel(arg.handle)
        elif kind == "snapshot":
            future.set_result({"live": len(self._live), "slots_in_use": self.engine.slots_in_use,
                               "waiting": len(self.engine.waiting), "steps": self.engine.stats.steps})
        elif kind == "stop":
            self._stopping = True

    def _fail_all(self) -> None:
        for ticket in self._live:
            self.engine.cancel(ticket.handle)
            ticket.handle.unread.clear()
            ticket.handle.finish_reason = "error"

    def _deliver(self) -> None:
        still = []
        for ticket in self._live:
            h = ticket.handle
            if h.unread:
                tokens = list(h.unread)
                h.unread.clear()
                self._call(ticket, tokens, None)
            if h.done:
                self._call(ticket, [], h.finish_reason)
            else:
                still.append(ticket)
        self._live = still

    @staticmethod
    def _call(ticket: Ticket, tokens: list, reason: str | None) -> None:
        try:
            ticket.sink(tokens, reason)
        except Exception:  # noqa: BLE001 -- a broken listener must not stop the others
            log.exception("a request's sink failed")
