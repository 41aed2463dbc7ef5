"""Tree plans through the engine: each request's tokens equal `ar.generate`'s and `tree.generate`'s for it
alone, under staggered arrivals, a cancellation, slot reuse, stop tokens and budgets; sampled requests
reproduce `tree.generate` of them alone with their seed; a hybrid target; a sharded one; no compile in steady
state; the chain-only batching mechanisms are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import sharding
from specpilot.decoding import ar, tree
from specpilot.decoding.sampling import SamplingConfig
from specpilot.models import dense, hybrid
from specpilot.models import drafter as dr
from specpilot.plan import Batching, Plan, PlanError, TreeShape, TwoLevel
from specpilot.serving import Engine, Request, check_plan
from engine_helpers import CAP, CFG, PROMPTS, TARGET, run_staggered
from test_engine import ARRIVALS, CANCELS, check_no_compiles, check_outputs, requests_with_stops
from test_engine import block_drafter, params, reference  # noqa: F401 (the same module fixtures)

SHAPES = {"n6d3b2": TreeShape(nodes=6, depth=3, branching=2),  # width 6 > the drafter's block 4
          "chain4": TreeShape(nodes=4, depth=3, branching=1)}  # the chain of block 4 as a tree
ENGINE = dict(slots=3, context_len=48, prefill_chunk=8)
CACHE_LEN = 64  # tree.generate's cache for single-request references: one compile for every prompt


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_block_drafter_equals_ar_and_tree_per_request(params, reference, block_drafter, shape):
    drafter, dparams = block_drafter
    t = SHAPES[shape]
    alone = tree.generate(TARGET, params, drafter, dparams, PROMPTS, CAP, nodes=t.nodes, depth=t.depth,
                          branching=t.branching)
    assert alone.as_lists() == [r[:CAP] for r in reference]  # tree.generate is AR's, greedy
    engine = Engine(TARGET, params, drafter, dparams, sampling=False, tree=t, **ENGINE)
    requests = requests_with_stops(reference)
    handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
    check_outputs(handles, requests, reference)
    check_outputs(handles, requests, alone.as_lists())
    assert engine.slots_in_use == 0 and engine.committed_tokens() == 0
    assert engine.stats.verify_tokens == engine.stats.decode_row_steps * t.nodes
    assert engine.stats.forward_tokens == engine.stats.decode_calls * ENGINE["slots"] * t.nodes


def test_tree_replay_drafter_accepts_paths_through_runner_ups(params, reference):
    """Every third draft wrong with the right token second: the chain-equivalent tree stops there, a
    branching tree accepts through the second sibling (paths that leave node order: gather_path)."""
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4, shift=1, wrong_every=3, runner_up=2.0)
    tau = {}
    for name, t in SHAPES.items():
        engine = Engine(TARGET, params, drafter, None, sampling=False, tree=t, **ENGINE)
        requests = requests_with_stops(reference, replay=True)
        handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
        check_outputs(handles, requests, reference)
        tau[name] = engine.stats.tokens_per_row_step
    assert tau["chain4"] > 1.5, tau
    assert tau["n6d3b2"] > tau["chain4"] + 0.5, tau


# Temperature 1.5 over std-0.5 weights: draws far from the argmax, so a wrong key shows up at once.
SETTINGS = [(1.5, 1.0, 11), (0.0, 1.0, 0), (1.2, 0.9, 5), (1.5, 1.0, 12), (0.8, 0.7, 99), (1.5, 1.0, 11)]
PROMPT_OF = [0, 1, 2, 0, 4, 0]  # requests 0, 3 and 5 share a prompt; 0 and 5 a seed too
S_ARRIVALS = [0, 0, 2, 2, 5, 9]


def sampled_requests():
    return [Request(PROMPTS[PROMPT_OF[i]], 10, temperature=t, top_p=p, seed=s)
            for i, (t, p, s) in enumerate(SETTINGS)]


@pytest.mark.slow
def test_tree_sampled_requests_equal_tree_generate_alone(params, block_drafter):
    """Keys as tree.generate's loop state (one split at prefill, one per step), each row a batch of one."""
    drafter, dparams = block_drafter
    t = SHAPES["n6d3b2"]
    engine = Engine(TARGET, params, drafter, dparams, tree=t, **ENGINE)
    reqs = sampled_requests()
    got = [h.tokens for h in run_staggered(engine, reqs, S_ARRIVALS)]
    want = [tree.generate(TARGET, params, drafter, dparams, [list(r.prompt_ids)], CAP, nodes=t.nodes,
                          depth=t.depth, branching=t.branching, budgets=[r.max_new_tokens],
                          sampling=SamplingConfig(temperature=r.temperature, top_p=r.top_p),
                          key=jax.random.key(r.seed), cache_len=CACHE_LEN).as_lists()[0] for r in reqs]
    assert got == want
    assert got[0] == got[5] and got[0] != got[3]  # the seed decides, not the slot or the batch
    assert len({tuple(g) for g in got}) >= 5


def test_tree_no_compiles_in_steady_state(params, reference, block_drafter):
    """After warm-up: arrivals, departures, a cancellation, stop tokens and greedy <-> sampled steps
    compile nothing."""
    drafter, dparams = block_drafter
    check_no_compiles(Engine(TARGET, params, drafter, dparams, tree=SHAPES["n6d3b2"], **ENGINE), reference)


@pytest.mark.slow
def test_hybrid_tree_engine_equals_ar():
    """Gated DeltaNet layers: each node's recurrent state from its parent's, the accepted path's last
    node's state committed, per-slot resets; chunks of 5 keep per-token prefill states."""
    from test_hybrid_spec import CFG as HCFG, hybrid_params

    target = hybrid.target(HCFG, jnp.float32, max_block_size=8)
    hparams = hybrid_params(HCFG, 0)
    budgets, arrivals = [9, 6, 12, 8, 10, 7], [0, 0, 1, 4, 6, 7]
    ref = [row.tolist() for row in ar.generate(target, hparams, PROMPTS[:6], 20).tokens]
    drafter = dr.ReplayDrafter(HCFG.vocab_size, 4, shift=1, wrong_every=3, runner_up=2.0)
    engine = Engine(target, hparams, drafter, None, slots=2, context_len=40, prefill_chunk=5, sampling=False,
                    tree=SHAPES["n6d3b2"])
    requests = [Request(p, b, draft_reference=list(p) + ref[i]) for i, (p, b) in enumerate(zip(PROMPTS, budgets))]
    handles = run_staggered(engine, requests, arrivals)
    assert [h.tokens for h in handles] == [ref[i][:b] for i, b in enumerate(budgets)]
    assert engine.stats.tokens_per_row_step > 2.0
    with pytest.raises(ValueError, match="max_block_size 8"):
        Engine(target, hparams, drafter, None, slots=2, context_len=40, tree=TreeShape(9, 3, 2))


def test_sharded_tree_engine_equals_one_device_ar(params, reference):
    """Slots over the mesh's data axis, heads over its tensor axis: the tree step needs nothing of its own."""
    from jax.sharding import PartitionSpec as P

    mesh = sharding.make_mesh(sharding.MeshShape(data=2, tensor=2))
    target = dense.target(CFG, jnp.float32, mesh)
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4, shift=1, wrong_every=3, runner_up=2.0).with_mesh(mesh)
    engine = Engine(target, sharding.shard_params(params, mesh), drafter, None, slots=4, context_len=48,
                    prefill_chunk=8, sampling=False, tree=SHAPES["n6d3b2"])
    requests = requests_with_stops(reference, replay=True)
    check_outputs(run_staggered(engine, requests, ARRIVALS, CANCELS), requests, reference)
    assert engine.state.target_state.lengths.sharding.spec == P("data")
    assert engine.state.target_state.layers[0].k.sharding.spec[0] == "data"
    assert engine.stats.tokens_per_row_step > 2.0


def tree_plan(**batching):
    t = SHAPES["n6d3b2"]
    return Plan(name="wide", verify="tree", block_size=t.width, tree=t, batching=Batching(**batching))


@pytest.mark.parametrize("field,value", [("draft_budget", "confidence"), ("verify", "packed"),
                                         ("overlap", "halves")])
def test_chain_only_batching_refused_for_tree_plans(params, block_drafter, field, value):
    with pytest.raises(PlanError, match=rf"decoding\.plans\.wide\.batching\.{field}: '{value}'"):
        tree_plan(**{field: value})  # a tree plan cannot hold them
    batching = Batching(**{field: value}, token_budget=12 if field != "overlap" else None)
    with pytest.raises(NotImplementedError, match=rf"decoding\.plans\.wide\.batching\.{field}: '{value}' is "
                                                  rf"not implemented for tree plans"):
        Engine.from_plan(None, tree_plan(), batching=batching)  # a bench's --batching over a tree plan
    drafter, dparams = block_drafter
    with pytest.raises(NotImplementedError, match=rf"batching\.{field}"):
        Engine(TARGET, params, drafter, dparams, tree=SHAPES["n6d3b2"], batching=batching, **ENGINE)


def test_tree_plans_accepted_and_bad_trees_refused(params, block_drafter):
    check_plan(tree_plan())
    check_plan(tree_plan(policy="static"))  # host-side admission only: a tree runs it unchanged
    two = Plan(name="cut", verify="two_level", block_size=6, tree=SHAPES["n6d3b2"],
               two_level=TwoLevel("drafter_confidence", 3))
    with pytest.raises(NotImplementedError, match=r"decoding\.plans\.cut\.verify: two_level"):
        check_plan(two)
    drafter, dparams = block_drafter
    with pytest.raises(ValueError, match="drafter block of 5"):
        Engine(TARGET, params, drafter, dparams, tree=TreeShape(6, 4, 2), **ENGINE)
    with pytest.raises(ValueError, match="block_size 4"):
        Engine(TARGET, params, drafter, dparams, block_size=4, tree=SHAPES["n6d3b2"], **ENGINE)
    engine = Engine(TARGET, params, drafter, dparams, block_size=6, tree=SHAPES["n6d3b2"], **ENGINE)
    assert engine.setup.block_size == 4 and engine.setup.max_len == 48 + 8  # context + max(chunk, width)
    wide = Engine(TARGET, params, drafter, dparams, slots=3, context_len=48, prefill_chunk=2,
                  tree=TreeShape(7, 3, 2))
    assert wide.setup.max_len == 48 + 7
    np.testing.assert_array_equal(wide.state.last, np.zeros(3))
