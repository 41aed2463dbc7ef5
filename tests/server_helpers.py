"""A tiny text-serving stack for the server tests, built in-process with nothing downloaded: a byte-level BPE
tokenizer trained on a few sentences, a random dense target over its vocabulary, a greedy engine and its
driver; plus raw HTTP clients (requests the official client would refuse to send) and AR references."""

import http.client
import json
import socket
import time

import jax.numpy as jnp

from specpilot.data.chat import render_chat
from specpilot.data.tokenizer import train_tokenizer
from specpilot.decoding.ar import generate
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from specpilot.serving import Engine, Request
from specpilot.serving.driver import EngineDriver
from specpilot.serving.openai_server import ServedModel
from helpers import random_params

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Café naïve 日本語 テキスト 🙂 déjà vu.",
             "def add(a, b):\n    return a + b\n", "Speculative decoding verifies drafted tokens in one pass.",
             "Ünïcödé text: ½ ¾ € ₿ — “quotes” and ‘more’.", "print('hello, world')  # a comment"]
# A chat template in the usual style: it refuses unknown roles through raise_exception, as many do.
TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
QUESTIONS = ["Hi", "What is 2+2?", "Name a colour.", "Say hello in French.", "Count to three.", "Why?",
             "Give me a fruit.", "Python or Rust?", "¿Qué tal?", "日本語で", "🙂 ok",
             "Tell me a joke about foxes.", "The capital of Italy?", "def f(x):", "Last one.", "More, please."]


def tiny_stack(slots: int, context_len: int, prefill_chunk: int = 16):
    """-> dict(driver, served, target, params, tokenizer): a started greedy engine on a random target."""
    tok = train_tokenizer(SENTENCES * 30, vocab_size=300, max_bytes=None)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
    target = dense.target(cfg, jnp.float32)
    params = random_params(dense.param_shapes(cfg), 0.5, 0)
    engine = Engine(target, params, slots=slots, context_len=context_len, prefill_chunk=prefill_chunk,
                    sampling=False)
    engine.submit(Request([1, 2, 3], 2))
    engine.run()  # compiles the greedy executables before any request
    served = ServedModel("tiny", tok, TEMPLATE, tok.eos_id, context_len, sampling=False)
    return dict(driver=EngineDriver(engine, idle_wait_s=0.05).start(), served=served, target=target,
                params=params, tokenizer=tok)


def chat_text(question: str) -> str:
    """The text of a one-question chat under TEMPLATE (also a completions prompt with the same tokens)."""
    return render_chat(TEMPLATE, [{"role": "user", "content": question}])


def chat_prompt(stack, question: str) -> list[int]:
    return stack["tokenizer"].encode(chat_text(question))


def references(stack, questions, budget: int) -> dict:
    """ar.generate's greedy tokens for each question's chat prompt, cut after the end-of-turn token."""
    eos = stack["served"].stop_token
    out = generate(stack["target"], stack["params"], [chat_prompt(stack, q) for q in questions], budget,
                   stop_token=eos)
    rows = [[int(t) for t in row] for row in out.tokens]
    return {q: row[: row.index(eos) + 1] if eos in row else row for q, row in zip(questions, rows)}


def wait_idle(driver, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = driver.snapshot().result(5)
        if snap["live"] == 0 and snap["slots_in_use"] == 0 and snap["waiting"] == 0:
            return snap
        time.sleep(0.05)
    raise AssertionError(f"the engine still holds requests: {snap}")


def detokenize_stream(detok, ids) -> list[str]:
    """The pieces a stream sends for `ids` through `detok`: one per token until a stop string, then the rest."""
    pieces = []
    for t in ids:
        detok.add(t)
        pieces.append(detok.delta(final=False))
        if detok.stopped:
            break
    pieces.append(detok.delta(final=True))
    return pieces


def post(port: int, path: str, body, headers: dict | None = None, timeout: float = 30.0):
    """-> (status, parsed JSON body or None); `body` a dict (sent as JSON) or raw bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        return r.status, (json.loads(raw) if raw else None)
    finally:
        conn.close()


def get(port: int, path: str, headers: dict | None = None, timeout: float = 30.0):
    """-> (status, body text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def stream(port: int, body: dict, headers: dict | None = None, timeout: float = 60.0):
    """A streamed completion read as server-sent events -> (status, token ids, text, finish reason,
    seconds to the first token)."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", body.get("path", "/v1/chat/completions"),
                     body=json.dumps({k: v for k, v in body.items() if k != "path"}).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, None, json.loads(r.read()), None, None
        ids, text, finish, first = [], "", None, None
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("token_ids") and first is None:
                first = time.perf_counter() - start
            ids += choice.get("token_ids", [])
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
        return r.status, ids, text, finish, first
    finally:
        conn.close()


def send_raw(port: int, data: bytes, read: bool = True, timeout: float = 10.0) -> bytes:
    """Write `data` on a fresh connection; -> what the server answered (b"" when `read` is False or the
    connection closed first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and out.split(b"\r\n\r\n", 1)[1]:
                    break
        except (ConnectionResetError, socket.timeout):
            pass
        return out
