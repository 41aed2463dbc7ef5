"""Oracle-acceptance drafter: tau follows the profile, output equals AR, the real forward is kept."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding import ar as ar_decoding
from specpilot.decoding import spec
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.oracle import (OracleDrafter, conditional_profile, constant_acceptance_for_tau,
                                     conditional_from_marginal, expected_tau, leading_right, load_trace)
from specpilot.models.oracle import reference_salt


def test_constant_acceptance_solves_tau():
    for bs, tau in ((16, 6.27), (16, 3.43), (8, 1.0), (4, 4.0)):
        c = constant_acceptance_for_tau(tau, bs)
        assert sum(c ** k for k in range(bs)) == pytest.approx(tau, abs=1e-9)
    with pytest.raises(ValueError, match="impossible"):
        constant_acceptance_for_tau(17.0, 16)
    np.testing.assert_allclose(conditional_profile(5, acceptance=[0.9, 0.5]), [0.9, 0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="probabilities"):
        conditional_profile(4, acceptance=[1.5])


def generate(params, cfg, *args, **kw):
    return ar_decoding.generate(dense.target(cfg, params["embed"].dtype), params, *args, **kw)


def spec_generate(params, cfg, *args, **kw):
    return spec.generate(dense.target(cfg, params["embed"].dtype), params, *args, **kw)


def _setup(tiny_cfg, tiny_params, block):
    dcfg = dr.DrafterConfig.for_target(tiny_cfg, num_layers=1, block_size=block)
    target_cfg = tiny_cfg.with_taps(dcfg.tap_layers)
    inner = dr.BlockDrafter(dcfg, target_cfg)
    return target_cfg, inner, dr.init(jax.random.key(3), dcfg, dtype=jnp.float32)


def test_tau_follows_profile_and_output_equals_ar(tiny_cfg, tiny_params):
    block, n = 8, 96
    target_cfg, inner, inner_params = _setup(tiny_cfg, tiny_params, block)
    prompts = [[1, 2, 3, 4], [7, 8, 9]]
    ar = generate(tiny_params, target_cfg, prompts, n).tokens
    profile = conditional_profile(block, tau=4.0)
    oracle = OracleDrafter(inner, tuple(profile))
    params = OracleDrafter.make_params(inner_params, dr.replay_reference(prompts, ar.tolist()))
    res = spec_generate(tiny_params, target_cfg, oracle, params, prompts, n)
    np.testing.assert_array_equal(res.tokens, ar)
    # ~2 x 24 steps: the mean of a [1, 8]-valued variable with sd ~2.5 lands within +-1.5 of 4 w.h.p.
    assert abs(res.stats.tau - expected_tau(profile)) < 1.5
    # always right / never right extremes are exact
    for c, tau in ((1.0, block), (0.0, 1.0)):
        o = OracleDrafter(inner, (c,) * (block - 1))
        r = spec_generate(tiny_params, target_cfg, o, params, prompts, 33)
        assert r.stats.tau == pytest.approx(tau)


def test_real_drafter_forward_is_not_removed(tiny_cfg, tiny_params):
    target_cfg, inner, inner_params = _setup(tiny_cfg, tiny_params, 4)
    oracle = OracleDrafter(inner, (0.5, 0.5, 0.5))
    params = OracleDrafter.make_params(inner_params, np.ones((1, 16), np.int32))
    state = oracle.init_state(params, 1, 32, jnp.float32)

    def propose(p, s):
        return oracle.propose(p, tiny_params, s, jnp.array([1]), 4)[0]

    hlo = jax.jit(propose).lower(params, state).compile().as_text()
    # the drafter's o-projection is [q_size, H]: its weights must still be read by some dot
    assert hlo.count(" dot(") + hlo.count("custom-call") >= 4, "drafter forward was optimized away"


def test_non_finite_drafter_logits_do_not_reach_the_drafts(tiny_cfg, tiny_params):
    target_cfg, inner, inner_params = _setup(tiny_cfg, tiny_params, 4)

    class NaNDrafter(type(inner)):
        def propose(self, params, target_params, state, last_tokens, block_size):
            logits, state = super().propose(params, target_params, state, last_tokens, block_size)
            return logits * jnp.nan, state

    oracle = OracleDrafter(NaNDrafter(inner.cfg, inner.target_cfg), (1.0, 1.0, 1.0))
    prompts = [[1, 2, 3]]
    ar = generate(tiny_params, target_cfg, prompts, 17).tokens
    params = OracleDrafter.make_params(inner_params, dr.replay_reference(prompts, ar.tolist()))
    res = spec_generate(tiny_params, target_cfg, oracle, params, prompts, 17)
    np.testing.assert_array_equal(res.tokens, ar)
    assert res.stats.tau == pytest.approx(4.0)


def test_draws_follow_the_profile_on_average():
    """Mean accepted drafts over 20,000 verification lengths vs the profile's expectation (z-test at
    4 sigma), and every position's marginal acceptance vs prod c_j. A single run's tau scatters (about
    +-0.8 over 32 steps at tau 6.27, block 16), so a run reports both."""
    c = conditional_profile(16, tau=6.27)
    key = OracleDrafter.make_params(None, np.zeros((1, 1), np.int32), seed=0)["key"]
    right = np.asarray(jax.jit(leading_right)(key, jnp.arange(20_000, dtype=jnp.int32), tuple(c)))
    n_right = right.sum(1)
    assert right.shape == (20_000, 15)
    assert (np.diff(right.astype(int), axis=1) <= 0).all()  # a leading run
    z = (n_right.mean() - (expected_tau(c) - 1)) / (n_right.std() / np.sqrt(n_right.size))
    assert abs(z) < 4, z
    marg = np.cumprod(c)
    se = np.sqrt(marg * (1 - marg) / n_right.size)
    assert (np.abs(right.mean(0) - marg) < 4 * se + 1e-9).all()


def test_trace_from_a_recorded_run(tmp_path):
    """A run records marginals a_k (fraction of steps accepting draft k); the oracle needs conditionals."""
    c = np.array([0.9, 0.8, 0.5, 0.0, 0.7])
    marg = np.cumprod(c)
    np.testing.assert_allclose(conditional_from_marginal(marg), [0.9, 0.8, 0.5, 0.0, 0.0])
    assert expected_tau(conditional_from_marginal(marg)) == pytest.approx(1 + marg.sum())
    for bad in ([0.5, 0.7], [1.2], []):
        with pytest.raises(ValueError, match="non-increasing"):
            conditional_from_marginal(bad)
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"method": "ar", "stats": {}},
            {"method": "stock", "stats": {"acceptance_per_position": [0.8, 0.4, 0.2]}},
            {"method": "stock", "stats": {"acceptance_per_position": [0.6, 0.4, 0.0]}}]
    (run / "results.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    np.testing.assert_allclose(load_trace(run), [0.7, 0.4 / 0.7, 0.1 / 0.4])  # the mean trace
    with pytest.raises(ValueError, match="no 'stock_w12' record"):
        load_trace(run / "results.jsonl", method="stock_w12")
    with pytest.raises(FileNotFoundError, match="no acceptance trace"):
        load_trace(tmp_path / "missing")


def test_rows_at_the_same_length_draw_apart_and_a_request_draws_alike_anywhere():
    """The row salt (a hash of each row's reference) separates rows of one batch that sit at the same
    committed length: two different references at equal lengths disagree on some of 200 steps' draws (with
    c = 0.5 per position, all 200 agreeing by chance has probability below 2^-200); the same reference
    draws the same in any row. Each salted row still follows the profile (z-test at 4 sigma)."""

    c = conditional_profile(8, tau=3.0)
    key = OracleDrafter.make_params(None, np.zeros((1, 1), np.int32), seed=0)["key"]
    refs = jnp.asarray([[5, 6, 7, 8, 9], [5, 6, 7, 8, 10], [5, 6, 7, 8, 9]], jnp.int32)
    salt = reference_salt(refs)
    assert salt[0] != salt[1] and salt[0] == salt[2]
    draw = jax.jit(leading_right)
    rows = np.stack([np.asarray(draw(key, jnp.full((3,), n, jnp.int32), tuple(c), salt)) for n in range(200)])
    assert (rows[:, 0] != rows[:, 1]).any() and (rows[:, 0] == rows[:, 2]).all()
    many = np.asarray(draw(key, jnp.arange(20_000, dtype=jnp.int32), tuple(c),
                           jnp.full((20_000,), salt[1], jnp.uint32))).sum(1)
    z = (many.mean() - (expected_tau(c) - 1)) / (many.std() / np.sqrt(many.size))
    assert abs(z) < 4, z
