"""An OpenAI-compatible HTTP server over the serving engine: chat and text completions, streamed or not,
behind the HTTP gate of `http_limits` and with `/health` and Prometheus `/metrics`.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import random
import threading
import time
import uuid
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from specpilot.serving.api_errors import APIError
from specpilot.serving.detokenizer import Detokenizer, parse_stops
from specpilot.serving.driver import EngineDriver
from specpilot.serving.generation import Admissions, Generation, ReplyStream, collect_text
from specpilot.serving.http_limits import HttpGate, ServerLimits, uvicorn_config
from specpilot.serving.metrics import ServerMetrics
from specpilot.serving.prompt_text import PromptBuilder
from specpilot.serving.request import MAX_SEED, Request

UNION_ARMS = {"str", "int", "float", "bool", "none"}  # pydantic's names of a union's members in an error's loc
CLIENT_GONE = 499  # nginx's status for a request whose client left before the reply (counted, never read)


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
# Request bodies to engine requests

# Fields of OpenAI's API this server does not implement: accepted only at a value that asks for nothing.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "logit_bias": (None, {}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "response_format": (None, {"type": "text"})}


def _refuse_unsupported(body: _Sampling) -> None:
    for field, value in (body.model_extra or {}).items():
        if field in UNSUPPORTED and not any(value == ok and type(value) is type(ok) for ok in UNSUPPORTED[field]):
            raise APIError(400, f"{field}={json.dumps(value)[:80]} is not supported by this server", field)


def _engine_request(body: _Sampling, served: ServedModel, prompt: list[int], prompt_field: str,
                    default_max_tokens: int) -> Request:
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
        budget = min(default_max_tokens, room)
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



# --------------------------------------------------------------------------------------------------
# The app

def _message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    return "".join(p.text or "" for p in m.content if p.type == "text")


def create_app(driver: EngineDriver, served: ServedModel, limits: ServerLimits = ServerLimits()) -> FastAPI:
    """The ASGI app serving `served` through `driver` (already started, or started by the caller), under
    `limits`; a key variable named by `limits.api_key_env` that is unset is refused here (LimitError)."""
    app = FastAPI(title="specpilot", docs_url=None, redoc_url=None)
    vocab = served.tokenizer.vocab_size
    metrics = ServerMetrics(tau=lambda: driver.engine.stats.tokens_per_row_step)
    admissions = Admissions(driver.engine.slots + limits.max_queue, metrics)
    pool = concurrent.futures.ThreadPoolExecutor(limits.text_workers, thread_name_prefix="specpilot-text")
    prompts = PromptBuilder(served.tokenizer, served.chat_template, served.special_tokens, served.context_len,
                            limits.template_timeout_s)
    app.add_middleware(HttpGate, limits=limits, api_key=limits.api_key(), on_status=metrics.count)
    app.state.limits, app.state.metrics, app.state.admissions, app.state.prompts = limits, metrics, admissions, prompts
    app.state.text_workers = pool

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):  # Starlette's own (404, 405, unparsable bodies): OpenAI's shape
        return APIError(e.status_code, str(e.detail), None, None, e.headers).response()

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

    @app.get("/health")
    async def health():
        if not driver.running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "specpilot"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HttpRequest):
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
        return await respond(body, http, lambda: prompts.chat_prompt(messages), "messages", "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HttpRequest):
        check_model(body)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise APIError(400, f"one prompt per request, got {len(p)}", "prompt")
            p = p[0]
        if isinstance(p, str):
            return await respond(body, http, lambda: prompts.text_prompt(p), "prompt", "text")
        if len(p) >= served.context_len:
            raise APIError(400, f"the prompt is {len(p)} tokens; the model's context here is {served.context_len} "
                                f"tokens (prompt + reply)", "prompt", "context_length_exceeded")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        return await respond(body, http, lambda: list(p), "prompt", "text")

    async def respond(body: _Sampling, http: HttpRequest, make_prompt, prompt_field: str,
                      kind: Literal["chat", "text"]):
        stops, stop_ids = parse_stops(body.stop, body.stop_token_ids, vocab)
        admitted = admissions.admit()
        try:
            prompt = await off_loop(make_prompt)
            request = _engine_request(body, served, prompt, prompt_field, limits.default_max_tokens)
            gen = Generation(driver, Detokenizer(served.tokenizer, stops), stop_ids, pool, admitted)
            await gen.start(request, prompt_field)
        except BaseException:
            admitted.release()
            raise
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        head = {"id": rid, "created": int(time.time()), "model": served.name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return ReplyStream(gen, head, kind, len(prompt), usage, body.return_token_ids)
        text = await collect_text(gen, http)
        if text is None:
            return Response(status_code=CLIENT_GONE)
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


# --------------------------------------------------------------------------------------------------
# Running it

def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0,
                    limits: ServerLimits = ServerLimits()):
    """Start uvicorn on `app` under `limits` in a daemon thread -> (server, thread, port);
    `server.should_exit = True` stops it. Port 0: a free port."""
    server = uvicorn.Server(uvicorn_config(app, host, port, limits, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {host}:{port}")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, port
