"""Request validation: each bad field is refused alone, naming the field, while the others finish."""

import numpy as np
import pytest

from specpilot.decoding import ar
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.serving import Engine, Request, RequestError, check_request
from engine_helpers import CFG, TARGET
from helpers import random_params

V, CONTEXT = CFG.vocab_size, 32

BAD = [  # (request, the field its error names)
    (Request([], 4), "prompt_ids"),
    (Request("hello", 4), "prompt_ids"),
    (Request([1, 2.0, 3], 4), "prompt_ids"),
    (Request([1, True], 4), "prompt_ids"),
    (Request([1, V], 4), "prompt_ids"),
    (Request([-1, 2], 4), "prompt_ids"),
    (Request([1, 2], 0), "max_new_tokens"),
    (Request([1, 2], 2.5), "max_new_tokens"),
    (Request([1] * 20, CONTEXT - 19), "max_new_tokens"),  # prompt + budget past the context
    (Request([1, 2], 4, temperature=-0.1), "temperature"),
    (Request([1, 2], 4, temperature=float("nan")), "temperature"),
    (Request([1, 2], 4, top_p=0.0), "top_p"),
    (Request([1, 2], 4, top_p=1.5), "top_p"),
    (Request([1, 2], 4, seed=-3), "seed"),
    (Request([1, 2], 4, seed=1.5), "seed"),
    (Request([1, 2], 4, stop_token=V), "stop_token"),
]


@pytest.mark.parametrize("request_, field", BAD)
def test_bad_field_named(request_, field):
    with pytest.raises(RequestError, match=rf"request\.{field}") as err:
        check_request(request_, vocab_size=V, context_len=CONTEXT)
    assert err.value.field == field


def test_limits_are_inclusive():
    ok = check_request(Request(np.array([0, V - 1]), CONTEXT - 2, temperature=0, top_p=1.0, seed=2**31 - 1),
                       vocab_size=V, context_len=CONTEXT)
    assert ok.prompt_ids == (0, V - 1) and all(type(t) is int for t in ok.prompt_ids)
    with pytest.raises(RequestError, match=r"request\.temperature.*without sampling"):
        check_request(Request([1], 2, temperature=0.5), vocab_size=V, context_len=CONTEXT, sampling=False)


def test_bad_requests_refused_alone_while_others_finish():
    params = random_params(dense.param_shapes(CFG), 0.5, 0)
    engine = Engine(TARGET, params, slots=2, context_len=CONTEXT, prefill_chunk=8, sampling=False)
    good = [Request([3, 4, 5], 6), Request([9] * 11, 5), Request([7, 1], 8)]
    want = ar.generate(TARGET, params, [r.prompt_ids for r in good], 8, budgets=[r.max_new_tokens for r in good])
    handles = [engine.submit(good[0])]
    engine.step()
    for request_, field in BAD + [(Request([1, 2], 4, draft_reference=[1, 2, 3]), "draft_reference")]:
        with pytest.raises(RequestError, match=rf"request\.{field}"):
            engine.submit(request_)
        engine.step()  # the engine goes on between refusals
    handles += [engine.submit(r) for r in good[1:]]
    engine.run()
    assert [h.tokens for h in handles] == want.as_lists()
    assert all(h.finish_reason == "length" for h in handles)


def test_replaying_drafter_needs_its_reference():
    params = random_params(dense.param_shapes(CFG), 0.5, 0)
    engine = Engine(TARGET, params, dr.ReplayDrafter(V, 4), None, slots=2, context_len=CONTEXT, prefill_chunk=8)
    with pytest.raises(RequestError, match=r"request\.draft_reference.*replays"):
        engine.submit(Request([1, 2], 4))
    with pytest.raises(RequestError, match=r"request\.draft_reference.*start with the prompt"):
        engine.submit(Request([1, 2], 4, draft_reference=[2, 1, 5]))
