"""Oracle acceptance from a step trace: at a tiny shape, with the real (random-weight) block drafter
filling the tree, a chain or tree run accepts exactly what the trace says (tau = mean + 1 over whole
passes), its output equals AR, and a trace a plan cannot hold is refused."""

import json

import numpy as np
import pytest

from specpilot import plan as plan_mod
from specpilot.decoding import ar, spec, tree, two_level
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models import tree_acceptance as ta
from specpilot.models.oracle_trace import (MODEL_SEED, MODEL_STEPS, OracleTraceDrafter, load_model, load_traces,
                                           sample_for_plan)
from helpers import random_params
from test_tree import CFG, PROMPTS, TARGET

TRACE = (3, 1, 5, 0)  # one pass: 4 steps, 9 drafts + 4 bonus tokens = 13 tokens
N = 1 + 2 * 13  # prefill's token, then two whole passes per row


@pytest.fixture(scope="module")
def target():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    return ar.generate(TARGET, target, PROMPTS, N + 8).tokens


@pytest.fixture(scope="module")
def oracle(ar_tokens):
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=8)
    inner = dr.BlockDrafter(dcfg, CFG)
    drafter = OracleTraceDrafter.from_traces(inner, {"t": {"accepted": list(TRACE)}}).with_trace(TRACE)
    params = drafter.make_params(random_params(dr.param_shapes(dcfg), 0.5, 1),
                                 dr.replay_reference(PROMPTS, ar_tokens.tolist()), seed=3)
    return drafter, params


def test_tree_run_replays_the_trace(target, ar_tokens, oracle):
    drafter, params = oracle
    res = tree.generate(TARGET, target, drafter, params, PROMPTS, N, nodes=12, depth=6, branching=3)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    assert res.stats.tau == pytest.approx(np.mean(TRACE) + 1) and (res.stats.steps == 8).all()
    # every row's accepted lengths: each trace entry twice
    np.testing.assert_array_equal(res.stats.accept_hist[:6], 2 * len(PROMPTS) * np.array([1, 1, 0, 1, 0, 1]))


def test_chain_and_two_level_runs_replay_the_trace(target, ar_tokens, oracle):
    drafter, params = oracle
    chain = spec.generate(TARGET, target, drafter, params, PROMPTS, N, block_size=7)
    # drafter confidence keeps the placed path (its drafter score is ~0, the best)
    cut = two_level.generate(TARGET, target, drafter, params, PROMPTS, N, nodes=12, depth=6, branching=3,
                             first="drafter_confidence", keep=7, record_steps=True)
    for res in (chain, cut):
        np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
        assert res.stats.tau == pytest.approx(np.mean(TRACE) + 1)
    steps = cut.stats.accepted_per_step  # the recorded trace of the run: the replayed one, per row
    assert sorted(steps[:, 0].tolist()) == sorted(2 * list(TRACE))
    # an early exit of a random-weight target may cut the placed path: never more than the trace
    exit_cut = two_level.generate(TARGET, target, drafter, params, PROMPTS, N, nodes=12, depth=6, branching=3,
                                  first="early_exit", keep=7, exit_layer=1)
    np.testing.assert_array_equal(exit_cut.tokens, ar_tokens[:, :N])
    assert exit_cut.stats.tau <= np.mean(TRACE) + 1


def test_a_plan_replays_its_own_trace_and_refuses_one_too_deep(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"source": "test", "methods": {"deep": {"accepted": [7, 2]},
                                                              "ok": {"accepted": [1, 2]}}}))
    drafter = OracleTraceDrafter.from_traces(None, load_traces(path), str(path))
    kw = dict(drafter_block_size=8, default_matmul={"bf16": ["xla"]})
    ok = plan_mod.build("ok", {"verify": "tree", "tree": {"nodes": 8, "depth": 5, "branching": 2}}, **kw)
    assert drafter.for_plan(ok).trace == (1, 2) and drafter.for_plan(ok).trace_tau == 2.5
    deep = plan_mod.build("deep", {"verify": "tree", "tree": {"nodes": 8, "depth": 5, "branching": 2}}, **kw)
    with pytest.raises(ValueError, match="accepts 7 drafts in a step; the plan's shape holds paths of at most 5"):
        drafter.for_plan(deep)
    labelled = plan_mod.build("oracle_ok", {"verify": "chain"}, **kw)  # the label prefix is dropped
    assert drafter.for_plan(labelled).trace == (1, 2)
    other = plan_mod.build("other", {"verify": "chain"}, **kw)
    with pytest.raises(ValueError, match="has no method 'other'"):
        drafter.for_plan(other)
    path.write_text(json.dumps({"methods": {"bad": {"accepted": [1, -1]}}}))
    with pytest.raises(ValueError, match="integers >= 0"):
        load_traces(path)


CALIBRATED = "docs/results/trace_ddtree_calibrated.json"


def _plan(name, fields, block=16):
    return plan_mod.build(name, fields, drafter_block_size=block, default_matmul={"bf16": ["xla"]})


def test_plans_without_a_recorded_trace_get_one_sampled_for_their_shape():
    """The calibrated file's model covers any chain or tree shape (what the loop proposes): a shorter chain
    accepts the block-16 chain's draws cut at its block, the recorded 32-node tree's shape under another
    name accepts what the recorded trace does (within sampling error), and each plan's trace fits its shape."""
    model = load_model(CALIBRATED)
    drafter = OracleTraceDrafter.from_traces(None, load_traces(CALIBRATED), CALIBRATED, model)
    chain16 = ta.sample_accepted(model, None, MODEL_STEPS, MODEL_SEED)
    for block in (2, 4, 8, 16):
        d = drafter.for_plan(_plan("candidate_chain", {"verify": "chain", "block_size": block}))
        assert d.sampled and len(d.trace) == MODEL_STEPS
        np.testing.assert_array_equal(d.trace, np.minimum(chain16, block - 1))
    recorded = np.array(dict(drafter.traces)["tree_n32"])
    d = drafter.for_plan(_plan("candidate_tree", {"verify": "tree", "tree": {"nodes": 32, "depth": 15,
                                                                             "branching": 4}}))
    se = np.hypot(recorded.std() / np.sqrt(recorded.size), np.std(d.trace) / np.sqrt(len(d.trace)))
    assert abs(np.mean(d.trace) - recorded.mean()) < 4 * se
    assert not drafter.for_plan(_plan("oracle_tree_n32", {"verify": "tree", "tree": {
        "nodes": 32, "depth": 15, "branching": 4}})).sampled  # a recorded method is replayed as before
    shallow = drafter.for_plan(_plan("c", {"verify": "tree", "tree": {"nodes": 24, "depth": 5, "branching": 2}}))
    assert max(shallow.trace) <= 5
    # drafter confidence keeps the best `keep` paths of the tree: the tree of `keep` nodes
    kept = drafter.for_plan(_plan("c", {"verify": "two_level", "tree": {"nodes": 32, "depth": 7, "branching": 2},
                                        "two_level": {"first": "drafter_confidence", "keep": 8}}))
    small = drafter.for_plan(_plan("c", {"verify": "tree", "tree": {"nodes": 8, "depth": 7, "branching": 2}}))
    assert kept.trace == small.trace
    line = drafter.for_plan(_plan("c", {"verify": "tree", "tree": {"nodes": 6, "depth": 9, "branching": 1}}))
    np.testing.assert_array_equal(line.trace, np.minimum(chain16, 5))  # branching 1: a chain of 5 drafts
    with pytest.raises(ValueError, match="'early_exit' first level has no trace here"):
        drafter.for_plan(_plan("c", {"verify": "two_level", "tree": {"nodes": 16, "depth": 7, "branching": 2},
                                     "two_level": {"first": "early_exit", "keep": 8, "exit_layer": 2}}))
    with pytest.raises(ValueError, match="drafts 19 positions; the acceptance model has 15"):
        sample_for_plan(model, _plan("c", {"verify": "chain", "block_size": 20}, block=20))


def test_the_truncated_sampler_agrees_with_the_truncated_models_expectation():
    """A tree drafting the first d positions: the sampler (cut after its draws) against the expectation of
    the model whose hazard stops at d, computed by the independent Rao-Blackwellised path."""
    model = load_model(CALIBRATED)
    for budget, depth in ((7, 3), (31, 6), (63, 10)):
        acc = ta.sample_accepted(model, budget, 4096, seed=3, max_depth=depth)
        cut = ta.ForkModel(model.hazard[:depth], model.spread, model.coherence)
        expected = ta.tau(cut, budget, 4096, seed=4)
        assert acc.max() <= depth
        assert abs(acc.mean() + 1 - expected) < 4 * acc.std() / np.sqrt(acc.size) + 0.03, (budget, depth)
    with pytest.raises(ValueError, match="max_depth must be in 1..15"):
        ta.sample_accepted(model, 7, 16, seed=0, max_depth=16)


def test_a_trace_file_model_is_checked(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"methods": {"a": {"accepted": [1]}}}))
    assert load_model(path) is None
    drafter = OracleTraceDrafter.from_traces(None, load_traces(path), str(path))
    with pytest.raises(ValueError, match="no acceptance model to sample one from"):
        drafter.for_plan(_plan("other", {"verify": "chain"}))
    for bad, msg in (({"kind": "Other"}, "kind 'ForkModel'"),
                     ({"kind": "ForkModel", "hazard": [0.5, 1.5], "spread": 1, "coherence": 0.5}, "hazard"),
                     ({"kind": "ForkModel", "hazard": [0.5], "spread": 0, "coherence": 0.5}, "spread"),
                     ({"kind": "ForkModel", "hazard": [0.5], "spread": 1, "coherence": 2}, "coherence")):
        path.write_text(json.dumps({"methods": {"a": {"accepted": [1]}}, "model": bad}))
        with pytest.raises(ValueError, match=msg):
            load_model(path)
    model = load_model(CALIBRATED)
    assert ta.from_record(ta.to_record(model)) == model


@pytest.mark.slow
def test_oracle_trace_plans_through_the_run_entry_point(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    trace = tmp_path / "trace.json"
    model = load_model(root / CALIBRATED)  # plans without a recorded method sample from it
    trace.write_text(json.dumps({"source": "test", "methods": {"chain": {"accepted": [1, 3, 0, 2]},
                                                               "tree": {"accepted": [3, 3, 1, 2]}},
                                 "model": ta.to_record(model)}))
    out = tmp_path / "out"
    plans = ("+decoding.plans={oracle_chain: {verify: chain, block_size: 4}, oracle_tree: {verify: tree, "
             "tree: {nodes: 8, depth: 3, branching: 2}}, candidate: {verify: chain, block_size: 3}}")
    proc = subprocess.run(
        [sys.executable, str(root / "experiments" / "run.py"), "target=tiny_random", "drafter=oracle_trace",
         "drafter.num_layers=1", "drafter.block_size=4", f"drafter.step_trace={trace}", "decoding=ar", plans,
         "bench=default", "bench.num_prompts=2", "bench.new_tokens=131", f"output_dir={out}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    for name, tau in (("oracle_chain", 2.5), ("oracle_tree", 3.25)):  # 130 tokens: whole passes either way
        rec = records[name]
        assert rec["tau"] == pytest.approx(tau) and rec["stats"]["trace_tau"] == pytest.approx(tau)
        assert rec["mismatches"] == 0 and rec["forcing"]["outputs_differ"] == 0
        assert "oracle acceptance (step trace" in rec["notes"] and not rec["stats"]["trace_sampled"]
    sampled = records["candidate"]
    expected = np.minimum(ta.sample_accepted(model, None, MODEL_STEPS, MODEL_SEED), 2).mean() + 1
    assert sampled["stats"]["trace_sampled"] and sampled["stats"]["trace_tau"] == pytest.approx(expected)
    assert sampled["mismatches"] == 0 and sampled["forcing"]["outputs_differ"] == 0


def test_the_loop_space_admits_any_shape_at_the_calibrated_deployment():
    """At a deployment replaying the calibrated file, the loop's candidates (block sizes, tree shapes) are
    plans the space admits, each with a trace sampled for its shape; an early exit is refused by name."""
    from agent_helpers import toy_cfg
    from specpilot.agent import space as sp

    cfg = toy_cfg("drafter=oracle_trace", f"drafter.step_trace={CALIBRATED}", "drafter.block_size=16")
    space = sp.build_space(cfg)
    model = load_model(CALIBRATED)
    for fields in ({"verify": "chain", "block_size": 4},
                   {"verify": "tree", "tree": {"nodes": 12, "depth": 5, "branching": 2}}):
        plan = space.check("candidate", fields)
        assert not isinstance(plan, str), plan
        assert len(sample_for_plan(model, plan)) == MODEL_STEPS
    refused = space.check("candidate", {"verify": "two_level", "tree": {"nodes": 16, "depth": 5, "branching": 2},
                                        "two_level": {"first": "early_exit", "keep": 8, "exit_layer": 1}})
    assert isinstance(refused, str) and "early_exit' first level has no trace here" in refused


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_the_serving_engine_replays_a_step_trace(kv):
    """Staggered requests through the engine with a trace drafter: every request's tokens are AR's, and
    rows accept drafts (what the trace's depths place), contiguous and paged K/V alike."""
    from engine_helpers import BUDGETS, CAP, CFG, PROMPTS, TARGET, run_staggered
    from helpers import random_params
    from specpilot.plan import Batching
    from specpilot.serving.engine import Engine
    from specpilot.serving.request import Request

    params = random_params(dense.param_shapes(CFG), 0.5, 0)
    reference = [row.tolist() for row in ar.generate(TARGET, params, PROMPTS, CAP + 8).tokens]
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=8)
    drafter = OracleTraceDrafter.from_traces(dr.BlockDrafter(dcfg, CFG), {"t": {"accepted": list(TRACE)}}
                                             ).with_trace(TRACE)
    slots = 3
    dparams = drafter.make_params(random_params(dr.param_shapes(dcfg), 0.5, 1), np.zeros((slots, 1), np.int32))
    engine = Engine(TARGET, params, drafter, dparams, block_size=7, slots=slots, context_len=48, prefill_chunk=8,
                    sampling=False, batching=Batching(kv=kv))
    requests = [Request(p, b, draft_reference=list(p) + reference[i]) for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    handles = run_staggered(engine, requests, [0, 0, 1, 3, 3, 4, 9, 10])
    assert [h.tokens for h in handles] == [reference[i][:b] for i, b in enumerate(BUDGETS)]
    assert engine.stats.tokens_per_row_step > 1.5  # the trace's mean depth is 2.25 drafts a step
