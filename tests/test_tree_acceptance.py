"""The tree acceptance model calibrated to DDTree: it reproduces its fitted points, its held-out errors are
the ones recorded and documented, its sampler agrees with its expectation, the beam top-B tree equals the
best-first heap's and its expected acceptance equals exhaustive enumeration, and the calibrated trace replays
at a tiny shape through run.py with tau = the trace's mean + 1."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specpilot.models import tree_acceptance as ta

ROOT = Path(__file__).resolve().parents[1]
FIT = json.loads((ROOT / "docs" / "results" / "tree_acceptance_fit.json").read_text())
PUB = ta.load_published(ROOT / "docs" / "results" / "ddtree_published.json")
MODEL = ta.ForkModel(tuple(FIT["hazard"]), FIT["spread"], FIT["coherence"])


def test_the_chain_hazard_reproduces_the_published_chain():
    f3, f4 = PUB["figure3_tau_by_budget"], PUB["figure4_acceptance_length_percent"]
    hz = ta.chain_hazard(f4["chain"], f3["chain"])
    assert ta.chain_tau(hz) == pytest.approx(7.79, abs=1e-9)
    np.testing.assert_allclose(hz, FIT["hazard"], rtol=1e-12)
    assert ta.tau(MODEL, None) == pytest.approx(7.79, abs=1e-9)


def test_fitted_and_held_out_points_are_the_recorded_ones():
    """Recomputes every row of the recorded table (the doc's table) at its Monte-Carlo steps and seed."""
    f3 = PUB["figure3_tau_by_budget"]
    doc = (ROOT / "docs" / "performance-trees.md").read_text()
    for row in FIT["table"]:
        b = None if row["budget"] == "chain" else int(row["budget"])
        model_tau = ta.tau(MODEL, b, FIT["eval_steps"], FIT["eval_seed"]) if b else ta.tau(MODEL, None)
        published = f3["chain"] if b is None else f3["tree"][str(b)]
        err = 100 * (model_tau / published - 1)
        assert model_tau == pytest.approx(row["model"], rel=1e-9) and err == pytest.approx(row["error_percent"])
        assert f"| {row['budget']} | {published:.2f} | {model_tau:.2f} | {err:+.1f}% | {row['fit']} |" in doc
        if b == FIT["fit_budget"]:  # the fitted budget: reproduced within the fit's Monte-Carlo noise
            assert abs(err) < 1.0


def test_sampler_mean_matches_the_expected_tau():
    """Per-step accepted drafts sampled (seeded) against the Rao-Blackwellised expectation: within 4
    standard errors of the sample mean plus the expectation's own Monte-Carlo error."""
    for budget in (None, 15, 63):
        acc = ta.sample_accepted(MODEL, budget, 4096, seed=7)
        expected = ta.tau(MODEL, budget, 4096, seed=8)
        se = acc.std() / np.sqrt(acc.size)
        assert abs(acc.mean() + 1 - expected) < 4 * se + 0.05, (budget, acc.mean() + 1, expected)
        assert (acc == ta.sample_accepted(MODEL, budget, 4096, seed=7)).all()  # reproducible
        assert acc.min() >= 0 and acc.max() <= ta.DEPTH


def test_beam_top_tree_is_the_best_first_heap_tree_and_its_acceptance_is_exhaustive():
    """Depth 4, two ranks a position: the beam's top-B tree is the heap's, and its expected acceptance (the
    sum of the target's prefix probabilities, coherence after a rank 2) equals enumerating every target
    continuation (rank 1, rank 2, or a token outside every tree at each depth)."""
    rng = np.random.default_rng(3)
    depth, m = 4, ta.ForkModel((0.8,) * 4, 0.7, 0.6)
    p = ta.confidences(m, rng.random((5, depth)))
    for budget in (1, 3, 6, 11, 20):
        depths, codes = ta.top_tree(p, budget)
        for s in range(p.shape[0]):
            heap = ta.best_first_tree([[p[s, d], 1 - p[s, d]] for d in range(depth)], budget)
            beam = {tuple((int(c) >> i) & 1 for i in range(int(d))) for d, c in zip(depths[s], codes[s])}
            assert beam == heap and len(heap) == budget
            total = 0.0
            for path in itertools.product((0, 1, 2), repeat=depth):
                prob, off = 1.0, False
                for d, k in enumerate(path):
                    if k == 2:
                        prob *= (1 - m.coherence) if off else 0.0
                    else:
                        prob *= (p[s, d] if k == 0 else 1 - p[s, d]) * (m.coherence if off else 1.0)
                    off = off or k == 1
                total += prob * max((d for d in range(1, depth + 1) if path[:d] in heap), default=0)
            tree_sum = ta._truth_prefix(p[s:s + 1], m.coherence, depths[s:s + 1], codes[s:s + 1]).sum()
            assert tree_sum == pytest.approx(total, rel=1e-12)


def test_exhaustive_enumeration_over_a_three_token_vocabulary():
    """Best-first top-B over 3 ranks per depth (any sorted marginals), calibrated target: the tree's
    expected acceptance (the sum of its prefix probabilities) equals enumerating every continuation."""
    rng = np.random.default_rng(5)
    for budget in (2, 5, 9, 17):
        q = np.sort(rng.dirichlet(np.ones(3), size=3), axis=1)[:, ::-1]
        tree = ta.best_first_tree(q.tolist(), budget)
        assert len(tree) == budget and all(t[:-1] in tree for t in tree if len(t) > 1)
        by_nodes = sum(np.prod([q[d][k] for d, k in enumerate(t)]) for t in tree)
        assert ta.enumerate_acceptance(q.tolist(), tree) == pytest.approx(by_nodes, rel=1e-12)
        # no other prefix-closed tree of that size does better: every swap of a node for an outside one loses
        outside = [t for n in range(1, 4) for t in itertools.product(range(3), repeat=n) if t not in tree]
        worst_in = min(np.prod([q[d][k] for d, k in enumerate(t)]) for t in tree)
        assert all(np.prod([q[d][k] for d, k in enumerate(t)]) <= worst_in + 1e-15 for t in outside)


def test_the_calibrated_trace_is_labelled_and_fits_its_plans():
    trace = json.loads((ROOT / "docs" / "results" / "trace_ddtree_calibrated.json").read_text())
    assert trace["label"] == "calibrated to DDTree (published)" and trace["source"].startswith(trace["label"])
    for name, m in trace["methods"].items():
        assert m["label"] == trace["label"] and max(m["accepted"]) <= ta.DEPTH
        assert m["tau"] == pytest.approx(np.mean(m["accepted"]) + 1)


@pytest.mark.slow
def test_calibrated_trace_through_the_run_entry_point(tmp_path):
    """A tiny shape replays the calibrated trace's first steps (clipped to its depth 3, whole passes):
    tau = mean + 1, output equal to AR, the calibration label in the notes."""
    trace = json.loads((ROOT / "docs" / "results" / "trace_ddtree_calibrated.json").read_text())
    steps = {k: [min(a, 3) for a in trace["methods"][k]["accepted"][:4]] for k in ("chain", "tree_n16")}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"label": trace["label"], "source": trace["source"],
                                "methods": {k: {"accepted": v} for k, v in steps.items()}}))
    passes = [sum(v) + len(v) for v in steps.values()]  # tokens a pass over each trace emits
    new_tokens = 1 + np.lcm(*passes)  # the prefill's token, then whole passes for both plans
    out = tmp_path / "out"
    plans = ("+decoding.plans={oracle_chain: {verify: chain, block_size: 4}, oracle_tree_n16: {verify: tree, "
             "tree: {nodes: 8, depth: 3, branching: 2}}}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "target=tiny_random", "drafter=oracle_trace",
         "drafter.num_layers=1", "drafter.block_size=4", f"drafter.step_trace={path}", "decoding=ar", plans,
         "bench=default", "bench.num_prompts=2", f"bench.new_tokens={new_tokens}", f"output_dir={out}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    for name, accepted in steps.items():
        rec = records[f"oracle_{name}"]
        assert rec["tau"] == pytest.approx(np.mean(accepted) + 1)
        assert rec["mismatches"] == 0 and rec["forcing"]["outputs_differ"] == 0
        assert "oracle acceptance (calibrated to DDTree (published), step trace" in rec["notes"]
