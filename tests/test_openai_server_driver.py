"""The engine's driver thread on a tiny random target: requests from many threads equal ar.generate's
tokens, a refused request fails only its own future, a cancel frees its slot."""

import threading

import pytest

from specpilot.decoding import ar
from specpilot.models import dense
from specpilot.serving import Engine, Request, RequestError
from specpilot.serving.driver import EngineDriver
from engine_helpers import CFG, PROMPTS, TARGET
from helpers import random_params

CONTEXT, BUDGET = 48, 10


@pytest.fixture(scope="module")
def params():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


class Collect:
    """A sink: every (tokens, reason) call, and an event set when the request ends."""

    def __init__(self):
        self.tokens, self.reasons, self.ended = [], [], threading.Event()

    def __call__(self, tokens, reason):
        self.tokens += tokens
        if reason is not None:
            self.reasons.append(reason)
            self.ended.set()


def test_requests_from_many_threads_equal_ar_generate_and_bad_ones_fail_alone(params):
    engine = Engine(TARGET, params, slots=3, context_len=CONTEXT, prefill_chunk=8, sampling=False)
    driver = EngineDriver(engine, idle_wait_s=0.05).start()
    want = ar.generate(TARGET, params, PROMPTS, BUDGET).tokens
    sinks = [Collect() for _ in PROMPTS]
    refused = []

    def client(i):
        driver.submit(Request(PROMPTS[i], BUDGET), sinks[i]).result(30)
        bad = driver.submit(Request(PROMPTS[i], BUDGET, top_p=0.0), Collect())
        with pytest.raises(RequestError) as e:
            bad.result(30)
        refused.append(e.value.field)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        for sink, row in zip(sinks, want):
            assert sink.ended.wait(60)
            assert sink.tokens == [int(t) for t in row] and sink.reasons == ["length"]
        assert refused == ["top_p"] * len(PROMPTS)
        snap = driver.snapshot().result(10)
        assert (snap["live"], snap["slots_in_use"], snap["waiting"]) == (0, 0, 0)
    finally:
        driver.stop()
    assert not driver.running
    with pytest.raises(RuntimeError, match="not running"):
        driver.submit(Request([1], 2), Collect()).result(1)


def test_a_cancelled_request_frees_its_slot_for_a_waiting_one(params):
    engine = Engine(TARGET, params, slots=1, context_len=CONTEXT, prefill_chunk=8, sampling=False)
    driver = EngineDriver(engine, idle_wait_s=0.05).start()
    try:
        first = threading.Event()
        long = Collect()

        def sink(tokens, reason):  # the long request's: note its first tokens
            long(tokens, reason)
            first.set()

        ticket = driver.submit(Request(PROMPTS[0], CONTEXT - len(PROMPTS[0])), sink).result(30)
        waiting = Collect()
        driver.submit(Request(PROMPTS[1], BUDGET), waiting).result(30)  # no free slot: it waits
        assert first.wait(30)
        driver.cancel(ticket)
        assert long.ended.wait(30) and long.reasons == ["cancelled"]
        assert len(long.tokens) < CONTEXT - len(PROMPTS[0])
        assert waiting.ended.wait(60) and waiting.reasons == ["length"]
        want = ar.generate(TARGET, params, [PROMPTS[1]], BUDGET).tokens[0]
        assert waiting.tokens == [int(t) for t in want]
    finally:
        driver.stop()
