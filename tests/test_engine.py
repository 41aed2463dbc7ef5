"""Continuous batching: each request's output through the engine equals `ar.generate`'s for it alone,
under staggered arrivals, cancellations, slot reuse and chunked prefill; AR and chain plans (tree plans:
test_engine_tree.py); no compile in steady state."""

import jax
import numpy as np
import pytest

from specpilot.decoding import ar
from specpilot.harness import deploy
from specpilot.harness.config_schema import build_plans
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.plan import Batching, Plan, TreeShape, TwoLevel
from specpilot.serving import Engine, Request, check_plan
from engine_helpers import BUDGETS, CAP, CFG, PROMPTS, TARGET, count_compiles, cut_at_stop, run_staggered
from helpers import random_params

ARRIVALS = [0, 0, 1, 3, 3, 4, 9, 10]  # more requests than slots: later ones wait for freed slots
CANCELS = {4: 5}  # request 4 (budget 16) is cancelled after step 5
# paged K/V in a pool too small for three whole contexts (3 x 15 pages of 4 slots): requests also wait for pages
PAGED = {"kv": "paged", "page_size": 4, "pages": 20}
LAYOUTS = [("pipelined", {}), ("sync", {}), ("pipelined", PAGED), ("sync", PAGED)]


@pytest.fixture(scope="module")
def params():
    return random_params(dense_shapes(), 0.5, 0)


def dense_shapes():
    return dense.param_shapes(CFG)


@pytest.fixture(scope="module")
def reference(params):
    """Each prompt's greedy AR continuation, CAP + 8 tokens (a replaying drafter reads past the budget)."""
    res = ar.generate(TARGET, params, PROMPTS, CAP + 8)
    return [row.tolist() for row in res.tokens]


def requests_with_stops(reference, replay=False):
    """Budgets as BUDGETS; request 1 and 6 stop at a token their own continuation emits; replay: each
    carries its prompt and continuation for a replaying drafter."""
    out = []
    for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS)):
        stop = reference[i][3] if i in (1, 6) else None
        out.append(Request(p, b, stop_token=stop, draft_reference=list(p) + reference[i] if replay else None))
    return out


def check_outputs(handles, requests, reference, cancelled=CANCELS):
    for i, (h, r) in enumerate(zip(handles, requests)):
        want = cut_at_stop(reference[i][: r.max_new_tokens], r.stop_token)
        if i in cancelled:
            assert h.finish_reason == "cancelled"
            assert h.tokens == want[: len(h.tokens)] and len(h.tokens) < len(want), i
        else:
            assert h.tokens == want, i
            assert h.finish_reason == ("stop" if r.stop_token in want else "length"), i


@pytest.mark.parametrize("dispatch, kv", LAYOUTS)
def test_ar_engine_equals_ar_per_request(params, reference, dispatch, kv):
    engine = Engine(TARGET, params, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=Batching(dispatch=dispatch, **kv))
    requests = requests_with_stops(reference)
    handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
    check_outputs(handles, requests, reference)
    assert engine.stats.tokens_per_row_step == 1.0
    assert engine.slots_in_use == 0 and engine.committed_tokens() == 0
    if kv:  # every page back in the pool
        assert engine.paged.alloc.in_use() == 0 and len(engine.paged.alloc.free) == PAGED["pages"]


@pytest.fixture(scope="module")
def block_drafter():
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=4)
    return dr.BlockDrafter(dcfg, CFG), random_params(dr.param_shapes(dcfg), 0.5, 1)


@pytest.mark.parametrize("dispatch, kv", LAYOUTS)
def test_chain_block_drafter_equals_ar_per_request(params, reference, block_drafter, dispatch, kv):
    drafter, dparams = block_drafter
    engine = Engine(TARGET, params, drafter, dparams, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=Batching(dispatch=dispatch, **kv))
    requests = requests_with_stops(reference)
    handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
    check_outputs(handles, requests, reference)
    if kv:
        assert engine.paged.alloc.in_use() == 0 and len(engine.paged.alloc.free) == PAGED["pages"]


def test_pipelined_dispatch_reads_each_step_one_call_later(params, reference):
    """sync: a step() returns the tokens of the step it ran; pipelined: those of the step the call before
    enqueued (its own runs meanwhile), and a call with nothing to enqueue reads the last one."""
    got = {}
    for dispatch in ("sync", "pipelined"):
        engine = Engine(TARGET, params, slots=2, context_len=48, prefill_chunk=8, sampling=False,
                        batching=Batching(dispatch=dispatch))
        handle = engine.submit(Request(PROMPTS[0], 3))  # a 3-token prompt: one prefill chunk
        got[dispatch] = [len(h.tokens) for _ in range(5) for h in engine.step() or [None] if h is not None]
        assert handle.tokens == reference[0][:3] and not engine.busy
    assert got["sync"] == [1, 2, 3]  # prefill's first token, then one decode token per step
    assert got["pipelined"] == [1, 2, 3]  # the same tokens, each read one call later
    engine = Engine(TARGET, params, slots=2, context_len=48, prefill_chunk=8, sampling=False)
    handle = engine.submit(Request(PROMPTS[0], 3))
    assert engine.step() == [] and handle.tokens == []  # prefill enqueued, nothing read yet
    assert engine.step() == [handle] and handle.tokens == reference[0][:1]


@pytest.mark.parametrize("wrong_every, kv", [(0, {}), (3, {}), (0, PAGED)])
def test_chain_replay_drafter_accepts_blocks(params, reference, wrong_every, kv):
    # wrong_every 0: the exact continuation (every draft right); 3: every third position wrong
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4, shift=1 if wrong_every else 0, wrong_every=wrong_every)
    engine = Engine(TARGET, params, drafter, None, slots=3, context_len=48, prefill_chunk=8, sampling=False,
                    batching=Batching(**kv))
    base = requests_with_stops(reference)
    requests = [Request(r.prompt_ids, r.max_new_tokens, stop_token=r.stop_token,
                        draft_reference=list(r.prompt_ids) + reference[i]) for i, r in enumerate(base)]
    handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
    check_outputs(handles, requests, reference)
    tau = engine.stats.tokens_per_row_step
    assert tau > (3.0 if wrong_every == 0 else 1.5), tau


def test_no_compiles_in_steady_state(params, reference):
    """After warm-up: arrivals, departures, cancellations and changes of budget, stop token and sampling
    settings (greedy <-> sampled steps) compile nothing."""
    with count_compiles() as probe:  # the counter sees a compile when one happens
        jax.jit(lambda x: x * 3 + 1)(np.float32(2))
    assert probe
    check_no_compiles(Engine(TARGET, params, slots=3, context_len=48, prefill_chunk=8), reference)
    check_no_compiles(Engine(TARGET, params, slots=3, context_len=48, prefill_chunk=8,
                             batching=Batching(**PAGED)), reference)  # a new page table compiles nothing


def check_no_compiles(engine, reference):
    """Warm `engine` up, then run two waves of requests with mixed budgets, stop tokens and sampling
    settings (one cancelled): nothing compiles, and the greedy requests emit AR's tokens."""
    engine.warm_up()
    requests = [Request(p, b, temperature=0.7 * (i % 2), top_p=0.9 if i % 3 else 1.0, seed=i,
                        stop_token=reference[i][2] if i == 4 else None)
                for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    with count_compiles() as compiles:
        handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
        handles += run_staggered(engine, requests[::-1], ARRIVALS)  # slots reused by a second wave
    assert compiles == [], compiles
    greedy = [i for i, r in enumerate(requests) if r.temperature == 0 and i not in CANCELS]
    for i in greedy:
        assert handles[i].tokens == cut_at_stop(reference[i][: BUDGETS[i]], requests[i].stop_token)


def test_stream_and_cancel(params, reference):
    engine = Engine(TARGET, params, slots=2, context_len=48, prefill_chunk=8, sampling=False)
    a = engine.submit(Request(PROMPTS[5], 12))
    b = engine.submit(Request(PROMPTS[2], 12))
    streamed = []
    for tok in engine.stream(a):
        streamed.append(tok)
        if len(streamed) == 4:
            engine.cancel(b)  # between steps: b's slot is free now
    assert streamed == reference[5][:12] == a.tokens
    assert b.finish_reason == "cancelled" and b.tokens == reference[2][: len(b.tokens)]
    assert engine.slots_in_use == 0 and not engine.busy


def test_two_level_plans_refused():
    cut = Plan(name="cut", verify="two_level", block_size=4, tree=TreeShape(nodes=4, depth=3, branching=2),
               two_level=TwoLevel("drafter_confidence", 3))
    with pytest.raises(NotImplementedError, match=r"decoding\.plans\.cut\.verify"):
        check_plan(cut)
    check_plan(Plan(name="stock", verify="chain", block_size=4))
    check_plan(Plan(name="wide", verify="tree", block_size=4, tree=TreeShape(nodes=4, depth=3, branching=2)))


def test_engine_arguments_checked(params):
    with pytest.raises(ValueError, match="slots"):
        Engine(TARGET, params, slots=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Engine(TARGET, params, context_len=CFG.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(TARGET, params, prefill_chunk=0)


@pytest.mark.slow  # ~35 s on 2 CPU cores: a deployment's every plan compiles
def test_from_plan_runs_a_deployments_plans():
    """Engine.from_plan on the toy deployment (tiny random target, random drafter at block 8): each plan's
    outputs equal `ar.generate`'s on the deployment's own target."""
    from agent_helpers import toy_cfg

    cfg = toy_cfg()
    plans = build_plans(cfg)
    dep = deploy.build(cfg, plans)
    prompts = [p[:10] for p in dep.prompts[:3]]
    for plan in plans:
        engine = Engine.from_plan(dep, plan, slots=2, context_len=32, prefill_chunk=8, sampling=False)
        handles = [engine.submit(Request(p, 6)) for p in prompts]
        engine.run()
        want = ar.generate(dep.target_for(plan), dep.params_for(plan), prompts, 6).as_lists()
        assert [h.tokens for h in handles] == want, plan.name
