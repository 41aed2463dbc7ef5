"""What stands between the network and the OpenAI server's routes: the server's limits (`ServerLimits`), an
ASGI gate that checks the bearer key and reads the body under a size cap and a deadline before anything
parses it, and the uvicorn configuration (connection cap, keep-alive, header size and header deadline)
that both ways of starting the server share. Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from specpilot.serving.api_errors import APIError

OPEN_PATHS = frozenset({"/health"})  # answered without the API key (load balancers' probes)


class LimitError(ValueError):
    """A server limit that cannot be used; `field` names it (a ServerLimits field)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """The OpenAI server's limits; every one bounds what one client can make the server do."""

    max_body_bytes: int = 4 << 20  # a request body past this is refused (413) before it is parsed
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408)
    header_timeout_s: float = 10.0  # a connection must send a request's headers within this (closed)
    keep_alive_s: int = 5  # an idle keep-alive connection is closed after this
    max_header_bytes: int = 32 << 10  # h11's cap on a request's head (larger: 400 from uvicorn)
    max_connections: int = 256  # uvicorn's limit_concurrency: connections past it get 503
    max_queue: int = 64  # requests waiting beyond the engine's slots; past it: 429
    default_max_tokens: int = 256  # a request's budget when it names none (and the context has room)
    template_timeout_s: float = 1.0  # CPU time one chat template rendering may take (400 past it)
    text_workers: int = 4  # threads that tokenise, render templates and detokenise off the event loop
    api_key_env: str | None = None  # the environment variable holding the bearer key; None: no key

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), type(field.default)
            if field.name == "api_key_env":
                continue
            if isinstance(value, bool) or not isinstance(value, (int,) if kind is int else (int, float)) \
                    or value <= 0:
                raise LimitError(field.name, f"must be a positive {'integer' if kind is int else 'number'}, "
                                             f"got {value!r}")

    def api_key(self) -> str | None:
        """The bearer key clients must send, read from `api_key_env` (None when no key is asked for)."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key.strip():
            raise LimitError("api_key_env", f"the variable {self.api_key_env!r} is unset or empty; export it with "
                                            f"the key clients must send, or serve without an API key")
        return key.strip()


class _Disconnected(Exception):
    """The client left while its body was being read."""


class HttpGate:
    """ASGI middleware: bearer key (401), body size (413) and body deadline (408), checked before the app
    sees the request; `on_status(path, status)` is told every response's status."""

    def __init__(self, app, limits: ServerLimits, api_key: str | None, on_status: Callable[[str, int], None]):
        self.app, self.limits, self.on_status = app, limits, on_status
        self._key = None if api_key is None else api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")

        async def counted(message):
            if message["type"] == "http.response.start":
                self.on_status(path, int(message["status"]))
            await send(message)

        try:
            if self._key is not None and path not in OPEN_PATHS and not self._authorized(scope):
                raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                               None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
            body = await self._read_body(scope, receive)
            _check_utf8(body)
        except APIError as e:
            await e.response()(scope, receive, counted)
            return
        except _Disconnected:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, which the handlers listen for

        await self.app(scope, replay, counted)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def _read_body(self, scope, receive) -> bytes:
        cap = self.limits.max_body_bytes
        too_large = f"this server takes request bodies of at most {cap} bytes (ServerLimits.max_body_bytes)"
        close = {"Connection": "close"}  # the rest of the body is not read: end the connection
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise APIError(400, f"Content-Length is not a number: {value[:40]!r}", None,
                                   "invalid_content_length", close) from None
                if declared > cap:
                    raise APIError(413, f"the request body is {declared} bytes; {too_large}", None,
                                   "body_too_large", close)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.limits.body_timeout_s} s "
                                    f"(ServerLimits.body_timeout_s)", None, "body_timeout", close) from None
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                raise APIError(413, f"the request body is over {cap} bytes; {too_large}", None, "body_too_large",
                               close)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _escaped_field(doc, path=()) -> str | None:
    """The dotted path of the first string in `doc` holding an undecodable byte (a surrogate escape)."""
    if isinstance(doc, str):
        return ".".join(map(str, path)) or "body" if any("\udc80" <= c <= "\udcff" for c in doc) else None
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    return next((f for k, v in items if (f := _escaped_field(v, (*path, k))) is not None), None)


def _check_utf8(body: bytes) -> None:
    """APIError 400 for a body that is not UTF-8, naming the JSON field that holds the bad bytes."""
    try:
        body.decode("utf-8")
        return
    except UnicodeDecodeError as e:
        at = e.start
    try:
        param = _escaped_field(json.loads(body.decode("utf-8", "surrogateescape")))
    except ValueError:
        param = None
    where = f" in {param}" if param else ""
    raise APIError(400, f"the request body is not valid UTF-8 (byte {at}{where}); send UTF-8 text", param,
                   "invalid_text")


class _HeaderDeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for a request's headers: a connection that opens (or ends a
    response) and has not sent complete headers `header_timeout_s` later is closed (slow-header clients)."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._headers_due, self.cycle)

    def _headers_due(self, cycle) -> None:
        no_new_request = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if no_new_request and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app, host: str, port: int, limits: ServerLimits, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's Config for `app` under `limits` (serve_in_thread and experiments/serve.py both use it)."""
    protocol = type("H11HeaderDeadline", (_HeaderDeadlineH11,), {"header_timeout_s": limits.header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", http=protocol,
                          limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s,
                          h11_max_incomplete_event_size=limits.max_header_bytes, timeout_graceful_shutdown=5)
