"""Oracle acceptance from a step trace: at a tiny shape, with the real (random-weight) block drafter
filling the tree, a chain or tree run accepts exactly what the trace says (tau = mean + 1 over whole
passes), its output equals AR, and a trace a plan cannot hold is refused."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import plan as plan_mod
from specpilot.decoding import ar, spec, tree, two_level
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.oracle_trace import OracleTraceDrafter, load_traces
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


@pytest.mark.slow
def test_oracle_trace_plans_through_the_run_entry_point(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"source": "test", "methods": {"chain": {"accepted": [1, 3, 0, 2]},
                                                               "tree": {"accepted": [3, 3, 1, 2]}}}))
    out = tmp_path / "out"
    plans = ("+decoding.plans={oracle_chain: {verify: chain, block_size: 4}, oracle_tree: {verify: tree, "
             "tree: {nodes: 8, depth: 3, branching: 2}}}")
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
        assert "oracle acceptance (step trace" in rec["notes"]
