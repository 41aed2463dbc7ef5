"""One request's reply inside the OpenAI server: its admission under the bounded queue (429 past it), its
tokens from the engine driver made into text on a text worker (never the event loop), its timings for
the metrics, its end when the client leaves, and its server-sent events. Design notes:
docs/design/serving.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from specpilot.serving.api_errors import APIError
from specpilot.serving.detokenizer import Detokenizer
from specpilot.serving.driver import EngineDriver
from specpilot.serving.metrics import ServerMetrics
from specpilot.serving.request import Request, RequestError

ENGINE_FIELDS = {"prompt_ids": None, "max_new_tokens": "max_tokens", "temperature": "temperature",
                 "top_p": "top_p", "seed": "seed", "stop_token": "stop_token_ids"}


class Admissions:
    """The generation requests the server holds (decoding, queued or being prepared): at most `capacity`
    (the engine's slots plus the queue); one more is refused with 429. Used only on the event loop."""

    def __init__(self, capacity: int, metrics: ServerMetrics):
        self.capacity, self.metrics, self.count = int(capacity), metrics, 0

    def admit(self) -> "Admitted":
        if self.count >= self.capacity:
            raise APIError(429, f"the server is full ({self.capacity} requests decoding or queued); retry "
                                f"later", None, "queue_full", {"Retry-After": "1"})
        self.count += 1
        self.metrics.in_flight.inc()
        self.metrics.queue_depth.inc()
        return Admitted(self)


class Admitted:
    """One admitted request's place and timings; `release()` (idempotent) gives the place back."""

    def __init__(self, admissions: Admissions):
        self.admissions = admissions
        self.arrived = time.perf_counter()
        self.first: float | None = None  # when its first tokens reached the event loop
        self.last: float | None = None
        self.tokens = 0
        self.released = False

    def saw(self, n: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.admissions.metrics.queue_depth.dec()
        self.last, self.tokens = now, self.tokens + n

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        a, m = self.admissions, self.admissions.metrics
        a.count -= 1
        m.in_flight.dec()
        if self.first is None:
            m.queue_depth.dec()
        m.finished(None if self.first is None else self.first - self.arrived, self.tokens,
                   None if self.last is None else self.last - self.arrived)


class Generation:
    """One request's reply as the driver hands out its tokens (read in the event loop, decoded on a
    text worker)."""

    def __init__(self, driver: EngineDriver, detok: Detokenizer, stop_ids: frozenset[int],
                 pool: concurrent.futures.Executor, admitted: Admitted):
        self.driver, self.detok, self.stop_ids, self.pool, self.admitted = driver, detok, stop_ids, pool, admitted
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.ticket = None
        self.finish_reason: str | None = None

    def sink(self, tokens: list, reason: str | None) -> None:  # the driver thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (tokens, reason))

    async def start(self, request: Request, prompt_field: str) -> None:
        try:
            self.ticket = await asyncio.wrap_future(self.driver.submit(request, self.sink))
        except RequestError as e:
            field = ENGINE_FIELDS.get(e.field, e.field) or prompt_field
            raise APIError(400, str(e), field) from None

    def cancel(self) -> None:
        if self.ticket is not None and self.finish_reason is None:
            self.driver.cancel(self.ticket)

    def _absorb(self, tokens: list, ended: bool) -> str:  # a text worker
        for t in tokens:
            if self.detok.stopped:
                break
            self.detok.add(t)
            if t in self.stop_ids and not self.detok.stopped:
                self.detok.stopped = True
        return self.detok.delta(final=ended or self.detok.stopped)

    async def pieces(self):
        """Yield text pieces until the reply ends; then `finish_reason` is set."""
        while self.finish_reason is None:
            tokens, reason = await self.queue.get()
            if tokens:
                self.admitted.saw(len(tokens))
            piece = await self.loop.run_in_executor(self.pool, self._absorb, tokens, reason is not None)
            if self.detok.stopped and reason is None:
                self.driver.cancel(self.ticket)
                reason = "stop"
            if reason is not None:
                if reason == "error":
                    self.finish_reason = "error"
                    raise APIError(500, f"the engine failed: {self.driver.last_error!r}", None, "engine_error")
                self.finish_reason = "stop" if self.detok.stopped else {"cancelled": "stop"}.get(reason, reason)
            if piece:
                yield piece

    def usage(self, prompt_len: int) -> dict:
        n = len(self.detok.tokens)
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


async def _until_disconnect(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def collect_text(gen: Generation, http: HttpRequest) -> str | None:
    """The whole reply's text, or None when the client left first (the request is then cancelled, its
    slot freed)."""

    async def join() -> str:
        return "".join([piece async for piece in gen.pieces()])

    collect = asyncio.ensure_future(join())
    gone = asyncio.ensure_future(_until_disconnect(http))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
        gen.cancel()
        gen.admitted.release()
    return collect.result() if collect in done else None


class ReplyStream(StreamingResponse):
    """A streamed reply that ends its request however the response ends: the events' own `finally` never
    runs when the client leaves before the first event is asked for (the generator never started)."""

    def __init__(self, gen: Generation, head: dict, kind: str, prompt_len: int, usage: bool, token_ids: bool):
        super().__init__(events(gen, head, kind, prompt_len, usage, token_ids), media_type="text/event-stream")
        self.gen = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.cancel()
            self.gen.admitted.release()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(gen: Generation, head: dict, kind: str, prompt_len: int, usage: bool, token_ids: bool):
    """The server-sent events of one streamed reply; a disconnect cancels the request (finally)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
        if kind == "chat":
            delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return dict(head, object=obj, choices=[choice])

    try:
        if kind == "chat":
            yield _sse(chunk("", None, first=True))
        sent = 0
        try:
            async for piece in gen.pieces():
                out = chunk(piece, None)
                if token_ids:
                    out["choices"][0]["token_ids"] = gen.detok.tokens[sent:]
                    sent = len(gen.detok.tokens)
                yield _sse(out)
        except APIError as e:
            yield _sse({"error": {"message": e.message, "type": "server_error", "param": None, "code": e.code}})
            return
        last = chunk(None, gen.finish_reason)
        if token_ids:
            last["choices"][0]["token_ids"] = gen.detok.tokens[sent:]
        yield _sse(last)
        if usage:
            yield _sse(dict(head, object=obj, choices=[], usage=gen.usage(prompt_len)))
        yield "data: [DONE]\n\n"
    finally:
        gen.cancel()
        gen.admitted.release()
