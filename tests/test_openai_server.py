"""The OpenAI-compatible server on the real SmolLM2-135M-Instruct, through the official `openai` client.

One module-scoped server (AR engine, 4 slots) on a free port; replies are short. References are not ours:
the prompt is transformers' `apply_chat_template`, the reply `ar.generate`'s greedy tokens for it.
"""

import glob
import json
import os
import threading
import urllib.error
import urllib.request

import jax.numpy as jnp
import pytest

from specpilot.data.prompt_sets import load_model_text
from specpilot.decoding.ar import generate
from specpilot.models import dense
from specpilot.models.checkpoint import load_hf
from specpilot.serving import Engine, Request
from specpilot.serving.driver import EngineDriver

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from server_helpers import wait_idle  # noqa: E402
from specpilot.serving.openai_server import ServedModel, create_app, serve_in_thread  # noqa: E402

FOLDERS = glob.glob("/tmp/smolcache/gguf/*/tokenizer_config.json") + glob.glob(
    os.path.expanduser("~/.cache/specpilot/gguf/*/tokenizer_config.json"))
pytestmark = pytest.mark.skipif(not FOLDERS, reason="no converted SmolLM2-135M-Instruct folder under "
                                "/tmp/smolcache/gguf (experiments/run.py's default deployment converts one)")
SLOTS, CONTEXT = 4, 256
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello in French.", "What is Python?",
             "Count to three.", "What is the capital of Italy?", "Give me a fruit.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def pair():
    transformers = pytest.importorskip("transformers")
    folder = FOLDERS[0].rsplit("/", 1)[0]
    params, cfg = load_hf(folder, dtype=jnp.float32)
    text = load_model_text(folder)
    return dict(folder=folder, params=params, cfg=cfg, target=dense.target(cfg, jnp.float32), text=text,
                hf=transformers.AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def refs(pair):
    """ar.generate's greedy tokens for each question's chat prompt (16 tokens, cut after the end-of-turn
    token): one batch, one compile. A shorter budget's reply is a prefix of these."""
    eos = pair["text"].tokenizer.eos_id
    out = generate(pair["target"], pair["params"], [_prompt(pair, q) for q in QUESTIONS], 16, stop_token=eos)
    rows = [[int(t) for t in row] for row in out.tokens]
    return {q: row[: row.index(eos) + 1] if eos in row else row for q, row in zip(QUESTIONS, rows)}


@pytest.fixture(scope="module")
def server(pair):
    engine = Engine(pair["target"], pair["params"], slots=SLOTS, context_len=CONTEXT, prefill_chunk=32)
    engine.submit(Request([1, 2, 3], 2))
    engine.run()  # compiles the greedy executables before the server takes requests
    driver = EngineDriver(engine).start()
    text = pair["text"]
    served = ServedModel("smollm2", text.tokenizer, text.chat_template, text.tokenizer.eos_id, CONTEXT,
                         special_tokens=text.special_tokens)
    srv, thread, port = serve_in_thread(create_app(driver, served))
    yield dict(driver=driver, engine=engine, port=port, eos=text.tokenizer.eos_id,
               client=openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0))
    srv.should_exit = True
    thread.join(10)
    driver.stop()


def _prompt(pair, question):
    return pair["hf"].apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)


def test_models_lists_the_served_model(server):
    assert [m.id for m in server["client"].models.list().data] == ["smollm2"]


def test_chat_completion_equals_ar_generate(server, pair, refs):
    q = QUESTIONS[0]
    r = server["client"].chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}],
                                                 max_tokens=12, temperature=0, extra_body={"return_token_ids": True})
    prompt, ref = _prompt(pair, q), refs[q][:12]
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == ref
    assert choice.message.content == pair["hf"].decode(ref, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if ref[-1] == server["eos"] else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ref))


def test_streamed_completion_equals_the_unstreamed_one(server):
    c = server["client"]
    kw = dict(model="smollm2", prompt="def fibonacci(n):", max_tokens=10, temperature=0)
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    assert whole.choices[0].finish_reason == "length"


def test_eight_concurrent_streams_each_equal_ar_generate(server, pair, refs):
    n = 8
    got, errors = [None] * len(QUESTIONS), []

    def one(i):
        try:
            stream = server["client"].chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=n,
                temperature=0, stream=True, extra_body={"return_token_ids": True})
            ids, text = [], ""
            for ch in stream:
                ids += ch.choices[0].model_extra.get("token_ids", [])
                text += ch.choices[0].delta.content or ""
            got[i] = (ids, text)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for (ids, text), q in zip(got, QUESTIONS):
        ref = refs[q][:n]
        assert ids == ref
        assert text == pair["hf"].decode(ref, skip_special_tokens=True)
    wait_idle(server["driver"])


def test_a_stream_closed_mid_way_frees_its_slot_and_others_finish(server, refs):
    c, driver = server["client"], server["driver"]
    long = c.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=200, temperature=0,
                                stream=True)
    it = iter(long)
    for _ in range(3):
        next(it)
    q = QUESTIONS[1]
    other = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=6,
                                      temperature=0, extra_body={"return_token_ids": True})
    assert driver.snapshot().result(5)["live"] == 1  # the long stream is still running
    long.close()
    snap = wait_idle(driver)
    assert snap["steps"] < 200 + 100  # it was cancelled, not run to its 200 tokens
    assert other.choices[0].model_extra["token_ids"] == refs[q][:6]


def _post(port, path, body: bytes):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BAD = [  # (body, the field named)
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": -3}, "seed"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ({"messages": [{"role": "user"}, {"role": 7, "content": "x"}]}, "messages.1.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
]


def test_malformed_requests_are_refused_alone_naming_the_field(server, refs):
    port, c = server["port"], server["client"]
    results = {}

    def stream():
        s = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[3]}],
                                      max_tokens=16, temperature=0, stream=True,
                                      extra_body={"return_token_ids": True})
        results["ids"] = [t for ch in s for t in ch.choices[0].model_extra.get("token_ids", [])]

    t = threading.Thread(target=stream)
    t.start()
    status, body = _post(port, "/v1/chat/completions", b'{"model": "smollm2", "messages": [')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    for fields, param in BAD:
        status, body = _post(port, "/v1/chat/completions", json.dumps({"model": "smollm2", **fields}).encode())
        assert (status, body["error"]["param"]) == (400, param), (fields, body)
        assert body["error"]["type"] == "invalid_request_error"
    status, body = _post(port, "/v1/completions", json.dumps({"model": "smollm2", "prompt": [1, 49152]}).encode())
    assert (status, body["error"]["param"]) == (400, "prompt")
    # fields asking for nothing pass, unknown ones are ignored; greedy, since a sampled request would compile
    # the sampling steps here (~30 s on a busy CPU, past _post's timeout)
    ok = {"model": "smollm2", "prompt": "x", "max_tokens": 1, "temperature": 0, "logprobs": None,
          "presence_penalty": 0, "echo": False, "user": "someone"}
    assert _post(port, "/v1/completions", json.dumps(ok).encode())[0] == 200
    status, body = _post(port, "/v1/completions", json.dumps({"model": "gpt-9", "prompt": "x"}).encode())
    assert (status, body["error"]["param"]) == (404, "model")
    with pytest.raises(openai.BadRequestError) as e:  # the official client sees the same error
        c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], top_p=2.0)
    assert e.value.param == "top_p"
    t.join(120)
    assert results["ids"] == refs[QUESTIONS[3]]
    wait_idle(server["driver"])


def test_stop_strings_and_stop_token_ids_cut_the_reply(server):
    c = server["client"]
    kw = dict(model="smollm2", prompt="def fibonacci(n):", max_tokens=10, temperature=0,
              extra_body={"return_token_ids": True})
    whole = c.completions.create(**kw).choices[0]
    text, ids = whole.text, whole.model_extra["token_ids"]
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isalnum())  # mid-reply
    assert text.find(stop) > 0
    cut = c.completions.create(stop=[stop, "never-in-it"], **kw).choices[0]
    assert (cut.text, cut.finish_reason) == (text[: text.find(stop)], "stop")
    streamed = list(c.completions.create(stop=stop, stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in streamed) == cut.text
    kw["extra_body"] = {"return_token_ids": True, "stop_token_ids": [ids[3]]}
    by_id = c.completions.create(**kw).choices[0]
    assert by_id.model_extra["token_ids"] == ids[: ids.index(ids[3]) + 1] and by_id.finish_reason == "stop"
    wait_idle(server["driver"])


@pytest.mark.slow
def test_a_sampled_reply_is_the_engines_for_its_seed(server, pair):
    """temperature, top_p and seed reach the engine: the reply equals the engine's own for that Request
    (slow: the sampling steps compile, ~27 s on 2 cores)."""
    q = QUESTIONS[2]
    kw = dict(model="smollm2", messages=[{"role": "user", "content": q}], max_tokens=8, temperature=0.9,
              top_p=0.8, seed=7, extra_body={"return_token_ids": True})
    a, b = (server["client"].chat.completions.create(**kw).choices[0].model_extra["token_ids"] for _ in range(2))
    got, done = [], threading.Event()

    def sink(tokens, reason):
        got.extend(tokens)
        if reason is not None:
            done.set()

    request = Request(_prompt(pair, q), 8, temperature=0.9, top_p=0.8, seed=7, stop_token=server["eos"])
    server["driver"].submit(request, sink).result(30)
    assert done.wait(60)
    assert a == b == got
    kw["seed"] = 8
    assert server["client"].chat.completions.create(**kw).choices[0].model_extra["token_ids"] != got
