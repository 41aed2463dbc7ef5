"""Oracle confidence calibration: the recorder's tables, inverse-CDF draws, the calibrated oracle's drafts
(top-1 probability as drawn, tokens as the uncalibrated oracle's), a greedy engine run under the confidence
budget equal to AR per request, and config errors naming their key."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from scipy import stats

from experiments.bench import record_trace
from specpilot.decoding import ar
from specpilot.harness import config_schema, deploy
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.confidence_trace import (GRID, OUTCOMES, Calibration, confidence_table, load_calibration,
                                               outcomes, sample)
from specpilot.models.oracle import OracleDrafter, conditional_profile, leading_right, reference_salt
from specpilot.serving.budget import confidence_of
from specpilot.plan import Batching
from specpilot.serving import Engine, Request
from specpilot.serving.budget import StepCost
from specpilot.harness import config_schema
from specpilot.harness.config_schema import ConfigValueError, validate

ROOT = Path(__file__).resolve().parents[1]
RECORDED = "docs/results/confidence_smollm2_chat.json"
ALPHA = 0.01  # significance of the Kolmogorov-Smirnov tests (draws come from fixed keys: no flakes)


def _draw(quantiles, n, seed=0):
    return np.asarray(sample(jnp.asarray(quantiles), jax.random.uniform(jax.random.key(seed), (n,))))


def test_inverse_cdf_draws_reproduce_a_beta_distribution():
    """A table of scipy's Beta(2, 5) quantiles: 5,000 draws pass a KS test against Beta(2, 5)'s own CDF at
    ALPHA (101 quantiles approximate the CDF within ~0.002, below the test's resolution at this n, about
    0.023), while the same draws fail against Beta(5, 2)."""
    table = stats.beta(2, 5).ppf(GRID)
    x = _draw(table, 5000)
    assert stats.kstest(x, stats.beta(2, 5).cdf).pvalue > ALPHA
    assert stats.kstest(x, stats.beta(5, 2).cdf).pvalue < 1e-10
    # exact at the grid points: u = i / 100 returns the i-th quantile
    np.testing.assert_allclose(np.asarray(sample(jnp.asarray(table), jnp.asarray(GRID, jnp.float32))), table,
                               rtol=1e-5, atol=1e-6)


def test_recorded_tables_round_trip():
    """Probabilities drawn from scipy's Beta(2, 5) (accepted) and Beta(2, 2) (the rest) go through the
    recorder's tables and back out as draws that pass KS tests against the generating distributions."""
    rng = np.random.default_rng(0)
    steps, rows, depth = 4000, 2, 7
    accepted = rng.integers(-1, depth + 1, size=(steps, rows))
    code = outcomes(accepted, depth)
    top1 = np.where(code == 0, stats.beta(2, 5).rvs(code.shape, random_state=1),
                    stats.beta(2, 2).rvs(code.shape, random_state=2))
    table = confidence_table(top1, accepted)
    assert sum(table["counts"].values()) == int((accepted >= 0).sum()) * depth
    cal = Calibration.from_table(table)
    assert stats.kstest(_draw(cal.accepted, 5000, 1), stats.beta(2, 5).cdf).pvalue > ALPHA
    for name in ("first_rejected", "after"):
        assert stats.kstest(_draw(getattr(cal, name), 5000, 2), stats.beta(2, 2).cdf).pvalue > ALPHA


def test_recorder_tables_count_every_draft_position(tiny_cfg, tiny_params):
    """A tiny random pair's chain run through experiments/bench/record_trace.py's `record`: the three tables'
    counts sum to the steps taken x (Bs - 1), and the step trace is the run's."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = config_schema.typed(compose(config_name="config", overrides=[
            "target=tiny_random", "drafter=random", "drafter.block_size=4", "decoding=stock", "bench=default",
            "bench.num_prompts=2", "bench.new_tokens=12", "bench.prompt_len=8"]))
    config_schema.validate(cfg)
    plans = config_schema.build_plans(cfg)
    dep = deploy.build(cfg, plans)
    plan = next(p for p in plans if p.verify == "chain")
    accepted, table = record_trace.record(dep, plan)
    assert sum(table["counts"].values()) == len(accepted) * (plan.block_size - 1)
    assert set(OUTCOMES) <= set(table) and table["grid"] == GRID.size
    for name in OUTCOMES:
        q = table[name]
        assert (not q and table["counts"][name] == 0) or (len(q) == GRID.size and np.all(np.diff(q) >= 0))
    json.dumps(table)  # what the trace file stores


def _oracle(tiny_cfg, block, calibration=None, tau=3.0):
    dcfg = dr.DrafterConfig.for_target(tiny_cfg, num_layers=1, block_size=block)
    target_cfg = tiny_cfg.with_taps(dcfg.tap_layers)
    inner = dr.BlockDrafter(dcfg, target_cfg)
    oracle = OracleDrafter(inner, tuple(conditional_profile(block, tau=tau)), calibration=calibration)
    return oracle, target_cfg, dr.init(jax.random.key(3), dcfg, dtype=jnp.float32)


@pytest.fixture(scope="module")
def recorded():
    return load_calibration(RECORDED)


def test_calibrated_drafts_keep_the_oracle_tokens_and_carry_the_drawn_confidence(tiny_cfg, tiny_params, recorded):
    """Same key, same references: the calibrated oracle's argmax tokens are exactly the uncalibrated one's,
    and each draft's softmax top-1 probability is its drawn value (float32, rtol 1e-5: a softmax over 128
    logits), drawn from its own outcome's table."""
    block, rows = 8, 64
    plain, target_cfg, inner_params = _oracle(tiny_cfg, block)
    calibrated = dataclasses.replace(plain, calibration=recorded)
    rng = np.random.default_rng(0)
    params = OracleDrafter.make_params(inner_params, rng.integers(0, tiny_cfg.vocab_size, (rows, 64)))
    state = plain.init_state(params, rows, 64, jnp.float32)
    state = dataclasses.replace(state, lengths=jnp.asarray(rng.integers(0, 40, rows), jnp.int32))
    last = jnp.zeros((rows,), jnp.int32)
    a, _ = jax.jit(lambda p, s: plain.propose(p, tiny_params, s, last, block))(params, state)
    b, _ = jax.jit(lambda p, s: calibrated.propose(p, tiny_params, s, last, block))(params, state)
    np.testing.assert_array_equal(np.argmax(a, -1), np.argmax(b, -1))

    ref = params["reference"]
    pos = state.lengths[:, None] + 1 + jnp.arange(block - 1)[None, :]
    salt = reference_salt(jnp.take_along_axis(ref, pos, axis=1))
    right = leading_right(params["key"], state.lengths, plain.conditional, salt)
    drawn = np.asarray(calibrated.draft_confidence(params["key"], state.lengths, salt, right))
    p = np.clip(drawn, (1 + 1e-3) / tiny_cfg.vocab_size, 1 - 1e-6)
    np.testing.assert_allclose(np.asarray(confidence_of(b)), p, rtol=1e-5)
    # every draw lies inside its own outcome's table range
    tables = np.asarray(recorded.tables())
    code = np.asarray(right).sum(1, keepdims=True)
    k = np.arange(block - 1)[None, :]
    which = np.where(k < code, 0, np.where(k == code, 1, 2))
    assert (drawn >= tables[which, 0] - 1e-6).all() and (drawn <= tables[which, -1] + 1e-6).all()
    assert len(set(which.ravel().tolist())) == 3  # all three outcomes occur in this batch


def test_confidence_by_outcome_follows_the_recorded_table(tiny_cfg, recorded):
    """Over 4,000 verification lengths at tau 6.27, block 16: each outcome's drawn confidences pass a KS
    test at ALPHA against the table's own piecewise-linear CDF, and accepted drafts are more confident on
    average than first-rejected ones (as recorded: 0.81 vs 0.47), independent of the acceptance draw."""
    block, n = 16, 4000
    oracle, _, _ = _oracle(tiny_cfg, block, recorded, tau=6.27)
    key = OracleDrafter.make_params(None, np.zeros((1, 1), np.int32))["key"]
    lengths = jnp.arange(n, dtype=jnp.int32)
    salt = jnp.full((n,), 12345, jnp.uint32)
    right = jax.jit(leading_right, static_argnums=2)(key, lengths, oracle.conditional, salt)
    drawn = np.asarray(jax.jit(oracle.draft_confidence)(key, lengths, salt, right))
    code = np.asarray(right).sum(1, keepdims=True)
    k = np.arange(block - 1)[None, :]
    which = np.where(k < code, 0, np.where(k == code, 1, 2))
    for i, name in enumerate(OUTCOMES):
        q = np.asarray(getattr(recorded, name))
        x = drawn[which == i]

        def cdf(v, q=q):
            return np.interp(v, q, GRID)

        assert x.size > 500 and stats.kstest(x, cdf).pvalue > ALPHA, name
    assert drawn[which == 0].mean() > drawn[which == 1].mean() + 0.2
    # the confidence draw is independent of the acceptance draw: the first draft's confidence, given it
    # was accepted, does not depend on how many later drafts were
    first = drawn[:, 0][code[:, 0] >= 1]
    longer = code[:, 0][code[:, 0] >= 1] > np.median(code[:, 0][code[:, 0] >= 1])
    assert stats.ks_2samp(first[longer], first[~longer]).pvalue > ALPHA


def test_engine_confidence_budget_with_the_calibrated_oracle_equals_ar(recorded):
    """Greedy engine, draft_budget=confidence under a per-token step cost, staggered arrivals: every
    request's tokens equal AR's with and without the calibration; the uncalibrated oracle (top-1 ~1
    everywhere) verifies every draft, the calibrated one fewer, and its drafts are still accepted."""
    from engine_helpers import BUDGETS, CAP, CFG, PROMPTS, TARGET, run_staggered
    from helpers import random_params

    params = random_params(dense.param_shapes(CFG), 0.5, 0)
    reference = [row.tolist() for row in ar.generate(TARGET, params, PROMPTS, CAP + 8).tokens]
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=4)
    inner = dr.BlockDrafter(dcfg, CFG)
    slots = 3
    dparams = OracleDrafter.make_params(random_params(dr.param_shapes(dcfg), 0.5, 1), np.zeros((slots, 1), np.int32))
    requests = [Request(p, b, draft_reference=list(p) + reference[i]) for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    per_row = {}
    for calibration in (None, recorded):
        oracle = OracleDrafter(inner, tuple(conditional_profile(4, tau=3.0)), calibration=calibration)
        engine = Engine(TARGET, params, oracle, dparams, slots=slots, context_len=48, prefill_chunk=8,
                        sampling=False, batching=Batching(draft_budget="confidence"), step_cost=StepCost(1.0, 0.08))
        handles = run_staggered(engine, requests, [0, 0, 1, 3, 3, 4, 9, 10])
        assert [h.tokens for h in handles] == [reference[i][:b] for i, b in enumerate(BUDGETS)]
        assert engine.stats.tokens_per_row_step > 1.2
        per_row[calibration is None] = engine.stats.verify_tokens / engine.stats.decode_row_steps
    assert per_row[True] == 4.0 and per_row[False] < 4.0, per_row  # measured: 3.58


CONFIG_BASE = ["target=tiny_random", "drafter=oracle_calibrated", "drafter.block_size=4", "drafter.num_layers=1",
               "drafter.tau=3", "decoding=stock", "bench=default"]


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    config_schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return config_schema.typed(compose(config_name="config", overrides=overrides))


def test_config_builds_the_calibrated_oracle_and_notes_it():

    cfg = _compose(CONFIG_BASE)
    config_schema.validate(cfg)
    dep = deploy.build(cfg, config_schema.build_plans(cfg))
    oracle = dep.drafter[0]
    assert isinstance(oracle, OracleDrafter) and oracle.calibration == load_calibration(RECORDED)
    assert any("oracle acceptance" in n and RECORDED in n and "calibration" in n for n in dep.notes)
    exp = _compose(["experiment=stock_qwen3_8b_h200", "drafter=oracle_calibrated"])
    assert exp.drafter.confidence_trace == RECORDED and exp.drafter.tau == 6.27 and exp.target.name == "qwen3_8b"
    assert exp.drafter.block_size == 16
    config_schema.validate(exp)
    exp = _compose(["experiment=stock_qwen3_8b_h200", f"drafter.confidence_trace={RECORDED}"])
    assert exp.drafter.confidence_trace == RECORDED and exp.drafter.name == "oracle_gsm8k"
    config_schema.validate(exp)


@pytest.mark.parametrize("overrides,match", [
    (["drafter.confidence_trace=/nonexistent/trace.json"], r"^drafter\.confidence_trace: no trace file"),
    (["drafter.confidence_trace=docs/results/trace_smollm2_chat.json"],
     r"^drafter\.confidence_trace: .*no confidence table for method 'stock'"),
    (["drafter.confidence_method=tree_n16"], r"^drafter\.confidence_trace: .*no confidence table for method 'tree_n16'"),
    (["drafter.source=random"], r"^drafter\.confidence_trace: a recorded confidence calibrates an oracle"),
])
def test_config_errors_name_their_key(overrides, match):

    with pytest.raises(ConfigValueError, match=match) as err:
        validate(_compose(CONFIG_BASE + overrides))
    assert "\n" not in str(err.value)
