"""The OpenAI server's defences, one at a time, on a tiny in-process stack (tests/server_helpers.py): the body
cap, prompt bounds before tokenising, the capped chat template, undecodable text, stop-string limits, a
non-streamed request cancelled when its client leaves, the bounded queue, the default max_tokens, the API
key, uvicorn's limits and deadlines, /health and /metrics."""

import random
import socket
import threading
import time
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
from server_helpers import QUESTIONS, detokenize_stream, get, post, references, send_raw, stream, tiny_stack, wait_idle  # noqa: E402

from specpilot.serving.detokenizer import MAX_STOP_CHARS, Detokenizer  # noqa: E402
from specpilot.serving.http_limits import LimitError, ServerLimits  # noqa: E402
from specpilot.serving.openai_server import ServedModel, create_app, serve_in_thread  # noqa: E402

SLOTS, CONTEXT = 2, 384
# Hostile templates: one loops over a message's characters three deep (CPU without bound), one asks for a
# range past Jinja's sandbox limit (OverflowError).
LOOP = "{% for i in range(m['content']|length) %}"
BURNING = "{% for m in messages %}" + LOOP * 3 + "{% endfor %}" * 3 + "{{ m['content'] }}{% endfor %}"
OVERFLOWING = "{% for m in messages %}{% for i in range((m['content']|length) * 1000) %}{% endfor %}{% endfor %}"


class CountingTokenizer:
    """The stack's tokenizer, counting the texts it tokenises."""

    def __init__(self, tok):
        self.tok, self.encoded = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode_batch(self, texts):
        self.encoded += len(texts)
        return self.tok.encode_batch(texts)


@pytest.fixture(scope="module")
def stack():
    s = tiny_stack(SLOTS, CONTEXT)
    yield s
    s["driver"].stop()


class Server:
    """One app over the shared driver, served on a free port."""

    def __init__(self, stack, limits=ServerLimits(), **served):
        self.served = ServedModel(**{**vars(stack["served"]), **served})
        self.app = create_app(stack["driver"], self.served, limits)
        self.srv, self.thread, self.port = serve_in_thread(self.app, limits=limits)

    def close(self):
        self.srv.should_exit = True
        self.thread.join(10)


@pytest.fixture
def serve(stack):
    servers = []

    def start(limits=ServerLimits(), **served):
        servers.append(Server(stack, limits, **served))
        return servers[-1]

    yield start
    for s in servers:
        s.close()
    wait_idle(stack["driver"])


def chat(content, **kw):
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **kw}


def test_a_body_over_the_cap_is_refused_before_it_is_read(serve):
    s = serve(ServerLimits(max_body_bytes=4096))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    declared = send_raw(s.port, head + b"Content-Length: 50000000\r\n\r\n{")  # the body never comes
    assert declared.startswith(b"HTTP/1.1 413") and b"at most 4096 bytes" in declared
    chunk = b"x" * 3000
    chunked = head + b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2 + b"0\r\n\r\n"
    assert send_raw(s.port, chunked).startswith(b"HTTP/1.1 413")  # no length given: counted as it arrives
    status, body = post(s.port, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert status == 200, body


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenising(serve, stack):
    counting = CountingTokenizer(stack["tokenizer"])
    s = serve(tokenizer=counting)
    limit = (CONTEXT - 1) * s.app.state.prompts.token_bytes
    for body in ({"model": "tiny", "prompt": "a" * (limit + 1)}, chat("é" * (limit // 2 + 1))):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        status, out = post(s.port, path, body)
        assert (status, out["error"]["code"]) == (400, "context_length_exceeded"), out
    assert counting.encoded == 0
    status, out = post(s.port, "/v1/completions", {"model": "tiny", "prompt": "word " * CONTEXT})
    assert (status, out["error"]["param"], out["error"]["code"]) == (400, "prompt", "context_length_exceeded")
    assert counting.encoded == 1  # under the byte bound: tokenised, then refused by its token count
    status, out = post(s.port, "/v1/completions", {"model": "tiny", "prompt": list(range(CONTEXT))})
    assert (status, out["error"]["param"]) == (400, "prompt")


def test_a_chat_template_is_capped_in_time_and_its_errors_are_400s(serve):
    s = serve(ServerLimits(template_timeout_s=0.3, max_body_bytes=1 << 20), chat_template=BURNING)
    result = {}

    def burn():
        result["answer"] = post(s.port, "/v1/chat/completions", chat("x" * 2000, max_tokens=2))

    t = threading.Thread(target=burn)
    t.start()
    time.sleep(0.1)
    waits = []
    while t.is_alive():  # the event loop keeps answering while the template burns on a text worker
        start = time.perf_counter()
        assert get(s.port, "/health")[0] == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.05)
    t.join()
    status, out = result["answer"]
    assert (status, out["error"]["param"], out["error"]["code"]) == (400, "messages", "template_timeout"), out
    assert waits and max(waits) < 0.5, waits
    s = serve(chat_template=OVERFLOWING)
    status, out = post(s.port, "/v1/chat/completions", chat("x" * 200))
    assert (status, out["error"]["param"], out["error"]["code"]) == (400, "messages", "template_error")
    assert "OverflowError" in out["error"]["message"]
    s = serve()
    status, out = post(s.port, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot",
                                                                                       "content": "hi"}]})
    assert (status, out["error"]["param"]) == (400, "messages") and "unknown role robot" in out["error"]["message"]


def test_undecodable_text_is_a_400_naming_its_field(serve):
    s = serve()
    cases = [(b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
             (b'{"model": "tiny", "messages": [{"role": "\\udfff", "content": "hi"}]}', "messages.0.role"),
             (b'{"model": "tiny", "prompt": "ok", "stop": ["\\ud83d"]}', "stop"),
             (b'{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
             (b'{"model": "tiny", "prompt": "caf\xe9 au lait"}', "prompt"),  # Latin-1, not UTF-8
             (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "messages.0.content")]
    for raw, param in cases:
        path = "/v1/completions" if b'"prompt"' in raw else "/v1/chat/completions"
        status, out = post(s.port, path, raw)
        assert (status, out["error"]["param"], out["error"]["type"]) == (400, param, "invalid_request_error"), raw


def test_stop_strings_are_few_and_short(serve):
    s = serve()
    for stop in (["a", "b", "c", "d", "e"], ["x" * (MAX_STOP_CHARS + 1)], [""]):
        status, out = post(s.port, "/v1/completions", {"model": "tiny", "prompt": "hi", "stop": stop})
        assert (status, out["error"]["param"]) == (400, "stop"), stop


def test_the_incremental_detokenizer_equals_a_whole_decode_cut_at_the_first_stop(stack):
    tok = stack["tokenizer"]
    rng = random.Random(0)
    for trial in range(60):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        whole = tok.decode(ids, skip_special_tokens=True)
        stops = tuple({whole[i:i + rng.randrange(1, 4)] for i in rng.sample(range(len(whole)), min(2, len(whole)))}
                      ) if trial % 2 and whole else ("never-there",)
        detok = Detokenizer(tok, stops)
        pieces = detokenize_stream(detok, ids)
        cut = min((whole.find(s) for s in stops if s in whole), default=len(whole))
        assert "".join(pieces) == whole[:cut], (ids, stops)


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(serve, stack):
    s = serve()
    driver = stack["driver"]
    before = driver.snapshot().result(5)["steps"]
    body = b'{"model": "tiny", "prompt": "Once", "max_tokens": 360}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    with socket.create_connection(("127.0.0.1", s.port)) as sock:
        sock.sendall(request)
        deadline = time.monotonic() + 30
        while driver.snapshot().result(5)["live"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    snap = wait_idle(driver)
    assert snap["steps"] - before < 300  # cancelled, not run to its 360 tokens
    metrics = get(s.port, "/metrics")[1]
    assert 'specpilot_requests_total{route="/v1/completions",status="499"} 1.0' in metrics
    assert "specpilot_requests_in_flight 0.0" in metrics


def test_streams_whose_clients_leave_at_once_give_their_places_back(serve, stack):
    s = serve(ServerLimits(max_queue=1))
    body = b'{"model": "tiny", "prompt": "Once", "max_tokens": 300, "stream": true}'
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    for pause in (0.0, 0.001, 0.005, 0.02, 0.0, 0.05):  # gone before, during and after the first event
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(request)
            time.sleep(pause)
    deadline = time.monotonic() + 30
    while s.app.state.admissions.count:
        assert time.monotonic() < deadline, s.app.state.admissions.count
        time.sleep(0.01)
    wait_idle(stack["driver"])
    assert post(s.port, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200


def test_the_queue_is_bounded_and_answers_429(serve, stack):
    s = serve(ServerLimits(max_queue=1))  # 2 slots + 1 waiting
    held, opened = [], threading.Barrier(4)

    def hold():
        conn = socket.create_connection(("127.0.0.1", s.port))
        body = b'{"model": "tiny", "prompt": "Once", "max_tokens": 360, "stream": true}'
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        held.append(conn)
        opened.wait(30)

    threads = [threading.Thread(target=hold) for _ in range(3)]
    for t in threads:
        t.start()
    opened.wait(30)
    deadline = time.monotonic() + 30
    while s.app.state.admissions.count < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    status, out = post(s.port, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert (status, out["error"]["code"], out["error"]["type"]) == (429, "queue_full", "rate_limit_error")
    for conn in held:
        conn.close()
    wait_idle(stack["driver"])
    deadline = time.monotonic() + 10
    while s.app.state.admissions.count:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert post(s.port, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200


def test_the_default_max_tokens_is_bounded(serve, stack):
    s = serve(ServerLimits(default_max_tokens=5))
    q = QUESTIONS[1]
    status, ids, text, finish, _ = stream(s.port, chat(q, stream=True, return_token_ids=True))
    ref = references(stack, [q], 5)[q]
    assert status == 200 and ids == ref and finish == ("stop" if ref[-1] == stack["served"].stop_token else "length")


def test_an_api_key_is_required_when_asked_for(serve, monkeypatch):
    with pytest.raises(LimitError, match="api_key_env: the variable 'SPECPILOT_TEST_KEY' is unset"):
        serve(ServerLimits(api_key_env="SPECPILOT_TEST_KEY"))
    monkeypatch.setenv("SPECPILOT_TEST_KEY", "s3cret-key")
    s = serve(ServerLimits(api_key_env="SPECPILOT_TEST_KEY"))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"}):
        status, out = post(s.port, "/v1/completions", body, headers)
        assert (status, out["error"]["code"]) == (401, "invalid_api_key") and "s3cret" not in str(out)
    assert get(s.port, "/v1/models")[0] == get(s.port, "/metrics")[0] == 401
    assert get(s.port, "/health")[0] == 200
    assert post(s.port, "/v1/completions", body, {"Authorization": "Bearer s3cret-key"})[0] == 200


def test_uvicorn_runs_with_connection_limits_and_deadlines(serve):
    limits = ServerLimits(max_connections=7, keep_alive_s=2, max_header_bytes=8192, header_timeout_s=0.4,
                          body_timeout_s=0.4)
    s = serve(limits)
    cfg = s.srv.config
    assert (cfg.limit_concurrency, cfg.timeout_keep_alive, cfg.h11_max_incomplete_event_size) == (7, 2, 8192)
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as sock:  # headers that never end
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        assert sock.recv(100) == b""  # closed by the header deadline
        assert time.monotonic() - start < 3
    slow_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"model\"")
    assert send_raw(s.port, slow_body).startswith(b"HTTP/1.1 408")
    with socket.create_connection(("127.0.0.1", s.port), timeout=5) as sock:  # a head past h11's buffer cap
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000)
        time.sleep(0.1)
        assert sock.recv(100).startswith(b"HTTP/1.1 400")


def test_health_and_metrics(serve, stack):
    a, b = serve(), serve()
    assert get(a.port, "/health") == (200, '{"status":"ok"}')
    assert post(a.port, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3})[0] == 200
    assert post(a.port, "/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 5})[0] == 400
    status, _, _, _, _ = stream(a.port, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True,
                                         "path": "/v1/completions"})
    assert status == 200
    status, text = get(a.port, "/metrics")
    assert status == 200
    for line in ('specpilot_requests_total{route="/v1/completions",status="200"} 2.0',
                 'specpilot_requests_total{route="/v1/completions",status="400"} 1.0',
                 "specpilot_queue_depth 0.0", "specpilot_requests_in_flight 0.0",
                 "specpilot_time_to_first_token_seconds_count 2.0", "specpilot_tau 1.0"):
        assert line in text, line
    tpot = next(x for x in text.splitlines() if x.startswith("specpilot_time_per_output_token_seconds_count"))
    assert float(tpot.split()[-1]) >= 1
    assert 'status="200"} 2.0' not in get(b.port, "/metrics")[1]  # each app counts its own


def test_health_says_when_the_engine_has_stopped(stack):
    stopped = types.SimpleNamespace(running=False, engine=stack["driver"].engine)
    app = create_app(stopped, stack["served"])
    srv, thread, port = serve_in_thread(app)
    try:
        assert get(port, "/health") == (503, '{"status":"engine stopped"}')
    finally:
        srv.should_exit = True
        thread.join(10)
