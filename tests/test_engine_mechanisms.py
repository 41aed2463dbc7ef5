"""The engine under plan.batching: per-request draft budgets (mechanism 1) and packed verification
(mechanism 2) keep every request's greedy output equal to `ar.generate`'s under staggered arrivals, the
chosen draft counts stay within the token budget, static waves, and refused batchings."""

import dataclasses

import jax.numpy as jnp
import pytest

from specpilot.models import drafter as dr
from specpilot.models import hybrid
from specpilot.plan import Batching
from specpilot.serving import Engine, Request
from specpilot.serving.budget import StepCost
from specpilot.serving.packed import check_packable
from specpilot.serving.step_timing import measure_step_cost, spread
from engine_helpers import BUDGETS, CFG, PROMPTS, TARGET
from test_engine import block_drafter, params, reference  # noqa: F401 (the same module fixtures)

ARRIVALS = [0, 0, 1, 3, 3, 4, 9, 10]


def run_recording(engine, requests, arrivals, max_steps=500):
    """run_staggered, recording the tokens each decode sent to verification."""
    handles, per_step = [None] * len(requests), []
    for step in range(max_steps):
        for i, at in enumerate(arrivals):
            if at == step:
                handles[i] = engine.submit(requests[i])
        before = engine.stats.verify_tokens
        engine.step()
        per_step.append(engine.stats.verify_tokens - before)
        if step >= max(arrivals) and not engine.busy:
            return handles, per_step
    raise AssertionError("the engine did not finish")


CASES = [  # (batching, step cost)
    (Batching(draft_budget="confidence", token_budget=7), StepCost()),
    (Batching(draft_budget="confidence", token_budget=9), StepCost(1.0, 0.08)),
    (Batching(draft_budget="confidence", verify="packed", token_budget=8), StepCost()),
    (Batching(verify="packed"), StepCost()),
]


@pytest.mark.parametrize("batching,cost", CASES, ids=["conf7", "conf9-linear", "conf8-packed", "packed"])
def test_block_drafter_equals_ar_per_request(params, reference, block_drafter, batching, cost):
    drafter, dparams = block_drafter
    engine = Engine(TARGET, params, drafter, dparams, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=batching, step_cost=cost)
    requests = [Request(p, b) for p, b in zip(PROMPTS, BUDGETS)]
    handles, per_step = run_recording(engine, requests, ARRIVALS)
    assert [h.tokens for h in handles] == [reference[i][:b] for i, b in enumerate(BUDGETS)]
    budget = batching.token_budget or 3 * 4
    assert max(per_step) <= budget and sum(per_step) == engine.stats.verify_tokens
    if batching.draft_budget == "fixed":
        assert engine.stats.verify_tokens == 4 * engine.stats.decode_row_steps
    else:  # every decoding row verified its last token and at least one draft
        assert 2 * engine.stats.decode_row_steps <= engine.stats.verify_tokens < 4 * engine.stats.decode_row_steps
    packed = batching.verify == "packed"
    assert engine.stats.forward_tokens == engine.stats.decode_calls * (budget if packed else 12)


def test_packed_streams_run_the_smallest_size_that_holds_the_step(params, reference, block_drafter):
    """Three compiled stream sizes (4, 8, 12) under a steep per-token cost: outputs equal AR's, and the
    verify forwards compute fewer tokens than the budget each step."""
    drafter, dparams = block_drafter
    batching = Batching(draft_budget="confidence", verify="packed", token_budget=12, streams=3)
    engine = Engine(TARGET, params, drafter, dparams, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=batching, step_cost=StepCost(1.0, 0.3))
    assert engine.setup.stream_sizes == (4, 8, 12)
    requests = [Request(p, b) for p, b in zip(PROMPTS, BUDGETS)]
    handles, per_step = run_recording(engine, requests, ARRIVALS)
    assert [h.tokens for h in handles] == [reference[i][:b] for i, b in enumerate(BUDGETS)]
    assert max(per_step) <= 12
    assert engine.stats.verify_tokens <= engine.stats.forward_tokens < 12 * engine.stats.decode_calls


def test_measured_step_cost_prices_every_stream_size(params, reference, block_drafter):
    """The measured cost has a point at each stream size, and the engine it prices decodes AR's tokens."""
    drafter, dparams = block_drafter
    batching = Batching(draft_budget="confidence", verify="packed", token_budget=12, streams=3)
    engine = Engine(TARGET, params, drafter, dparams, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=batching)
    cost = measure_step_cost(engine.setup, params, dparams, 3, context=20, repeats=2)
    assert [n for n, _ in cost.points] == [4, 8, 12] and all(s > 0 for _, s in cost.points)
    priced = Engine(TARGET, params, drafter, dparams, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=dataclasses.replace(batching, pricing="measured"))  # the engine times its own
    assert [n for n, _ in priced.setup.cost.points] == [4, 8, 12]
    handle = priced.submit(Request(PROMPTS[0], 6))
    priced.run()
    assert handle.tokens == reference[0][:6]
    with pytest.raises(ValueError, match="packed"):
        measure_step_cost(Engine(TARGET, params, drafter, dparams, slots=3, context_len=48, prefill_chunk=8,
                                 sampling=False).setup, params, dparams, 3, context=20)
    assert spread(8, 3, 4).tolist() == [3, 3, 2]
    with pytest.raises(ValueError, match="do not fit"):
        spread(13, 3, 4)


def test_replay_drafter_packed_budget_accepts_blocks(params, reference):
    """A replaying drafter (right every time) under a tight budget: outputs equal AR's and each row still
    accepts more than one token per step."""
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4)
    engine = Engine(TARGET, params, drafter, None, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=Batching(draft_budget="confidence", verify="packed", token_budget=8))
    requests = [Request(p, b, draft_reference=list(p) + reference[i]) for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    handles, per_step = run_recording(engine, requests, ARRIVALS)
    assert [h.tokens for h in handles] == [reference[i][:b] for i, b in enumerate(BUDGETS)]
    assert max(per_step) <= 8 and engine.stats.tokens_per_row_step > 2.0


def test_static_policy_admits_waves(params, reference):
    engine = Engine(TARGET, params, slots=2, context_len=48, prefill_chunk=8, sampling=False,
                    batching=Batching(policy="static"))
    handles = [engine.submit(Request(PROMPTS[i], BUDGETS[i])) for i in range(3)]
    engine.run()
    assert [h.tokens for h in handles] == [reference[i][: BUDGETS[i]] for i in range(3)]
    assert handles[2].admitted_s >= max(handles[0].finished_s, handles[1].finished_s)


def test_batchings_the_engine_cannot_run_are_refused(params, block_drafter):
    drafter, dparams = block_drafter
    with pytest.raises(ValueError, match=r"batching\.draft_budget"):
        Engine(TARGET, params, slots=2, batching=Batching(draft_budget="confidence"))
    with pytest.raises(ValueError, match=r"batching\.token_budget: 8 is less than"):
        Engine(TARGET, params, drafter, dparams, slots=3, batching=Batching(token_budget=8))
    with pytest.raises(ValueError, match=r"batching\.token_budget: 5 leaves"):
        Engine(TARGET, params, drafter, dparams, slots=3, batching=Batching(draft_budget="confidence", token_budget=5))


def test_packed_refused_for_hybrid_targets():
    from test_hybrid_spec import CFG as HCFG

    with pytest.raises(NotImplementedError, match=r"batching\.verify"):
        check_packable(hybrid.target(HCFG, jnp.float32, max_block_size=8))
    check_packable(TARGET)
