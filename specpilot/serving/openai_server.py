"""An OpenAI-compatible HTTP server over the serving engine: chat and text completions, streamed or not.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from specpilot.data.chat import ChatTemplateError, render_chat
from specpilot.serving.driver import EngineDriver
from specpilot.serving.request import MAX_SEED, Request, RequestError

MAX_STOP_STRINGS = 4  # OpenAI's limit
UNION_ARMS = {"str", "int", "float", "bool", "none"}  # pydantic's names of a union's members in an error's loc


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the server needs besides the engine: the model's name, text and limits."""

    name: str
    tokenizer: Any  # specpilot.data.tokenizer.TextTokenizer
    chat_template: str | None
    stop_token: int | None  # the end-of-turn token every request stops at
    context_len: int  # positions a slot holds: prompt + reply
    sampling: bool = True  # False: a greedy-only engine (temperature must be 0, the default)
    special_tokens: dict = dataclasses.field(default_factory=dict)  # {"bos_token": ...} for the template


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message and the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# --------------------------------------------------------------------------------------------------
# Request bodies (only the fields this server reads; others are accepted and ignored)

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = None
    top_p: StrictFloat | StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False


class ChatBody(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None


class CompletionBody(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]


# --------------------------------------------------------------------------------------------------
# Text out

class Detokenizer:
    """A reply's text as its tokens arrive: UTF-8 safe, cut at stop strings, special tokens left out."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""  # the reply so far (cut at a stop string once one is found)
        self.sent = 0  # characters of `text` handed out
        self.stopped = False

    def add(self, token: int) -> None:
        self.tokens.append(int(token))
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        for s in self.stops:
            at = text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text

    def delta(self, final: bool) -> str:
        """Text not handed out yet that can no longer change (all of it when `final`)."""
        end = len(self.text)
        if not final and not self.stopped:
            if self.text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
                end = len(self.text.rstrip("\ufffd"))
            for s in self.stops:  # the text could be the start of a stop string: wait
                for k in range(min(len(s) - 1, end), 0, -1):
                    if self.text[:end].endswith(s[:k]):
                        end -= k
                        break
        end = max(end, self.sent)
        out, self.sent = self.text[self.sent:end], end
        return out


# --------------------------------------------------------------------------------------------------
# One generation

def _parse_stops(body: _Sampling, vocab_size: int) -> tuple[tuple[str, ...], frozenset[int]]:
    stops = body.stop
    stops = () if stops is None else (stops,) if isinstance(stops, str) else tuple(stops)
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise APIError(400, "stop strings must not be empty", "stop")
    ids = frozenset(body.stop_token_ids or ())
    bad = sorted(t for t in ids if not 0 <= t < vocab_size)
    if bad:
        raise APIError(400, f"token ids {bad} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    return stops, ids


# Fields of OpenAI's API this server does not implement: accepted only at a value that asks for nothing.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "response_format": (None, {"type": "text"})}


def _refuse_unsupported(body: _Sampling) -> None:
    for field, value in (body.model_extra or {}).items():
        if field in UNSUPPORTED and not any(value == ok and type(value) is type(ok) for ok in UNSUPPORTED[field]):
            raise APIError(400, f"{field}={json.dumps(value)[:80]} is not supported by this server", field)


def _engine_request(body: _Sampling, served: ServedModel, prompt: list[int], prompt_field: str) -> Request:
    _refuse_unsupported(body)
    if body.n is not None and body.n != 1:
        raise APIError(400, f"only n=1 is supported, got {body.n}", "n")
    if not prompt:
        raise APIError(400, "the prompt has no tokens", prompt_field)
    room = served.context_len - len(prompt)
    if room < 1:
        raise APIError(400, f"the prompt is {len(prompt)} tokens; the model's context here is "
                            f"{served.context_len} tokens (prompt + reply)", prompt_field, "context_length_exceeded")
    budget_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None \
        else "max_tokens"
    budget = getattr(body, budget_field)
    if budget is None:
        budget = room
    elif budget < 1:
        raise APIError(400, f"must be at least 1, got {budget}", budget_field)
    elif budget > room:
        raise APIError(400, f"the prompt ({len(prompt)} tokens) plus {budget} new tokens is past the "
                            f"context of {served.context_len} tokens", budget_field, "context_length_exceeded")
    temp = (1.0 if served.sampling else 0.0) if body.temperature is None else float(body.temperature)
    if not 0.0 <= temp <= 2.0:
        raise APIError(400, f"must be in [0, 2], got {body.temperature}", "temperature")
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"must be in (0, 1], got {body.top_p}", "top_p")
    seed = body.seed
    if seed is None:
        seed = random.randint(0, MAX_SEED) if temp > 0 else 0
    elif not 0 <= seed <= MAX_SEED:
        raise APIError(400, f"must be in [0, {MAX_SEED}], got {seed}", "seed")
    return Request(prompt_ids=prompt, max_new_tokens=int(budget), temperature=temp, top_p=top_p, seed=int(seed),
                   stop_token=served.stop_token)


ENGINE_FIELDS = {"prompt_ids": None, "max_new_tokens": "max_tokens", "temperature": "temperature",
                 "top_p": "top_p", "seed": "seed", "stop_token": "stop_token_ids"}


class Generation:
    """One request's reply as the driver hands out its tokens (read in the event loop)."""

    def __init__(self, driver: EngineDriver, detok: Detokenizer, stop_ids: frozenset[int]):
        self.driver, self.detok, self.stop_ids = driver, detok, stop_ids
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

    async def pieces(self):
        """Yield text pieces until the reply ends; then `finish_reason` is set."""
        while self.finish_reason is None:
            tokens, reason = await self.queue.get()
            for t in tokens:
                if self.detok.stopped:
                    break
                self.detok.add(t)
                if t in self.stop_ids and not self.detok.stopped:
                    self.detok.stopped = True
            if self.detok.stopped and reason is None:
                self.driver.cancel(self.ticket)
                reason = "stop"
            if reason is not None:
                if reason == "error":
                    self.finish_reason = "error"
                    raise APIError(500, f"the engine failed: {self.driver.last_error!r}", None, "engine_error")
                self.finish_reason = "stop" if self.detok.stopped else {"cancelled": "stop"}.get(reason, reason)
            piece = self.detok.delta(final=self.finish_reason is not None)
            if piece:
                yield piece

    def usage(self, prompt_len: int) -> dict:
        n = len(self.detok.tokens)
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


# --------------------------------------------------------------------------------------------------
# The app

def _message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    return "".join(p.text or "" for p in m.content if p.type == "text")


def create_app(driver: EngineDriver, served: ServedModel) -> FastAPI:
    """The ASGI app serving `served` through `driver` (already started, or started by the caller)."""
    app = FastAPI(title="specpilot", docs_url=None, redoc_url=None)
    vocab = served.tokenizer.vocab_size

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        err = e.errors()[0]
        if err.get("type") == "json_invalid":
            return APIError(400, f"malformed JSON body: {err.get('msg')}", None, "invalid_json").response()
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        loc = [x for x in loc if x not in UNION_ARMS and not x.startswith(("list[", "function-"))]
        param = ".".join(loc) or None
        return APIError(400, f"{param or 'body'}: {err.get('msg')} (got {err.get('input')!r:.80})", param).response()

    def check_model(body: _Sampling) -> None:
        if body.model != served.name:
            raise APIError(404, f"the model {body.model!r} is not served here; this server serves "
                                f"{served.name!r}", "model", "model_not_found")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "specpilot"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        check_model(body)
        if not body.messages:
            raise APIError(400, "messages is empty; a chat needs at least one message", "messages")
        if served.chat_template is None:
            raise APIError(400, f"the model {served.name!r} has no chat template; use /v1/completions", "messages")
        for i, m in enumerate(body.messages):
            if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
                kinds = sorted({p.type for p in m.content} - {"text"})
                raise APIError(400, f"content parts of type {kinds} are not supported (text only)",
                               f"messages.{i}.content")
        messages = [{"role": m.role, "content": _message_text(m)} for m in body.messages]
        try:
            text = render_chat(served.chat_template, messages, add_generation_prompt=True,
                               **served.special_tokens)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        prompt = served.tokenizer.encode(text)
        return await respond(body, prompt, "messages", "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        check_model(body)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, f"one prompt per request, got {len(p)}", "prompt")
            p = p[0]
        prompt = served.tokenizer.encode(p) if isinstance(p, str) else list(p)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        return await respond(body, prompt, "prompt", "text")

    async def respond(body: _Sampling, prompt: list[int], prompt_field: str, kind: Literal["chat", "text"]):
        stops, stop_ids = _parse_stops(body, vocab)
        request = _engine_request(body, served, prompt, prompt_field)
        gen = Generation(driver, Detokenizer(served.tokenizer, stops), stop_ids)
        await gen.start(request, prompt_field)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "created": int(time.time()), "model": served.name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_events(gen, head, kind, len(prompt), usage, body.return_token_ids),
                                     media_type="text/event-stream")
        try:
            text = "".join([piece async for piece in gen.pieces()])
        finally:
            gen.cancel()
        choice = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
        if kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if body.return_token_ids:
            choice["token_ids"] = gen.detok.tokens
        obj = "chat.completion" if kind == "chat" else "text_completion"
        return dict(head, object=obj, choices=[choice], usage=gen.usage(len(prompt)))

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(gen: Generation, head: dict, kind: str, prompt_len: int, usage: bool, token_ids: bool):
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


# --------------------------------------------------------------------------------------------------
# Running it

def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0):
    """Start uvicorn on `app` in a daemon thread -> (server, thread, port); `server.should_exit = True`
    stops it. Port 0: a free port."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, port
