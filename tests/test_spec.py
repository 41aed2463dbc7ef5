"""Speculative decoding: greedy output equals AR token for token; tau extremes; capacity; loops agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding import ar, spec
from specpilot.decoding.sampling import SamplingConfig
from specpilot.decoding.stats import SpecStats
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from specpilot.state import CacheOverflowError
from helpers import random_params

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
TARGET = dense.target(CFG, jnp.float32)
PROMPTS = [[1, 2, 3], [5, 9, 11, 40, 7, 3, 2, 8, 8, 1, 60], [17, 4, 99, 23, 5, 6]]
N = 24  # new tokens per prompt
EXTRA = 17  # AR reference runs past N so a replayed block never runs off its end


@pytest.fixture(scope="module")
def target():
    # A large init std makes logits peaked, so greedy choices are not near-ties between tokens.
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    return ar.generate(TARGET, target, PROMPTS, N + EXTRA).tokens  # [B, N + EXTRA]


@pytest.fixture(scope="module")
def reference(ar_tokens):
    return jnp.asarray(dr.replay_reference(PROMPTS, ar_tokens.tolist()))


@pytest.fixture(scope="module")
def block_drafter(target):
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=8)
    return dr.BlockDrafter(dcfg, CFG), random_params(dr.param_shapes(dcfg), 0.5, 1)


@pytest.mark.parametrize("block_size", range(1, 17))
def test_greedy_equals_ar_every_block_size(target, ar_tokens, reference, block_size):
    # Every third position drafted wrong: acceptance lengths vary inside a run and across the batch.
    drafter = dr.ReplayDrafter(CFG.vocab_size, 16, shift=1, wrong_every=3)  # one drafter: one prefill
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, N, block_size=block_size)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    assert (res.num_generated == N).all()
    assert res.stats.emitted.sum() == len(PROMPTS) * (N - 1)
    if block_size > 2:
        assert 1.0 < res.stats.tau < block_size


@pytest.mark.parametrize("block_size", [2, 7, 16])
def test_block_drafter_greedy_equals_ar(target, ar_tokens, block_drafter, block_size):
    drafter, dparams = block_drafter
    res = spec.generate(TARGET, target, drafter, dparams, PROMPTS, N, block_size=block_size)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    assert res.stats.tau >= 1.0


@pytest.mark.parametrize("block_size", [4, 16])
def test_oracle_drafter_gives_tau_block_size(target, ar_tokens, reference, block_size):
    n = 1 + 2 * block_size  # prefill's token + two full blocks
    drafter = dr.ReplayDrafter(CFG.vocab_size, block_size)
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, n)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :n])
    assert res.stats.tau == block_size
    assert res.stats.num_steps == 2
    np.testing.assert_array_equal(res.stats.acceptance_rate, np.ones(block_size - 1))


def test_always_wrong_drafter_gives_tau_one(target, ar_tokens, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 6, shift=1)
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, N)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    assert res.stats.tau == 1.0
    np.testing.assert_array_equal(res.stats.acceptance_rate, np.zeros(5))
    assert (res.stats.steps == N - 1).all()


def test_loops_agree_and_profile_splits_time(target, block_drafter):
    drafter, dparams = block_drafter
    runs = [spec.generate(TARGET, target, drafter, dparams, PROMPTS, N, block_size=7, loop=loop)
            for loop in spec.LOOPS]
    profiled = spec.generate(TARGET, target, drafter, dparams, PROMPTS, N, block_size=7, profile=True)
    for r in runs[1:] + [profiled]:
        np.testing.assert_array_equal(r.tokens, runs[0].tokens)
        np.testing.assert_array_equal(r.stats.accept_hist, runs[0].stats.accept_hist)
        np.testing.assert_array_equal(r.stats.steps, runs[0].stats.steps)
    s = profiled.stats
    assert s.draft_s > 0 and s.verify_s > 0 and s.bookkeeping_s > 0
    assert runs[0].stats.draft_s is None


def test_capacity_error_up_front(target, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8)
    longest = max(len(p) for p in PROMPTS)
    fits = longest + N + 8 - 2
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, N, cache_len=fits)
    assert (res.num_generated == N).all()
    with pytest.raises(CacheOverflowError, match="block size 8"):
        spec.generate(TARGET, target, drafter, reference, PROMPTS, N, cache_len=fits - 1)


def test_capacity_clean_stop(target, ar_tokens, reference):
    bs, cache_len = 8, 24  # room for a few blocks only
    # The fourth prompt (22 tokens) leaves no room for one verification: prefill's token only.
    prompts = PROMPTS + [PROMPTS[1] * 2]
    ref = jnp.concatenate([reference, reference[1:2]], axis=0)
    drafter = dr.ReplayDrafter(CFG.vocab_size, bs, shift=1, wrong_every=4)
    res = spec.generate(TARGET, target, drafter, ref, prompts, N, cache_len=cache_len,
                        stop_at_capacity=True)
    lengths = np.array([len(p) for p in prompts])
    n = res.num_generated
    assert (n < N).all() and n[3] == 1 and (n[:3] > 1).all()
    # Each sequence stopped exactly because its next verification (Bs writes at P + n - 1) won't fit.
    assert (lengths + n - 1 + bs > cache_len).all()
    for b in range(3):
        np.testing.assert_array_equal(res.tokens[b, : n[b]], ar_tokens[b, : n[b]])
    for b in range(4):
        assert (res.tokens[b, n[b]:] == -1).all() and res.tokens[b, 0] >= 0


def test_bad_arguments(target, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4)
    with pytest.raises(ValueError, match="PRNG key"):
        spec.generate(TARGET, target, drafter, reference, PROMPTS, 4, sampling=SamplingConfig(1.0))
    with pytest.raises(ValueError, match="loop"):
        spec.generate(TARGET, target, drafter, reference, PROMPTS, 4, loop="scan")
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.generate(TARGET, target, drafter, reference, PROMPTS, 0)


def test_per_request_values_do_not_recompile_and_budgets_hold(target, ar_tokens, reference):
    """Budgets and temperatures are arrays: a second run with other values compiles nothing, row b
    emits exactly budget[b] tokens, and temperature-0 rows of a sampled batch equal greedy AR."""
    drafter = dr.ReplayDrafter(CFG.vocab_size, 6, shift=1, wrong_every=3)
    sampled = SamplingConfig(temperature=1.0)
    for loop in spec.LOOPS:
        runs = [(np.array([N, 5, 12]), np.array([0.0, 0.8, 1.2]), np.array([1.0, 0.9, 1.0])),
                (np.array([3, N, 1]), np.array([0.5, 0.0, 0.0]), np.array([0.7, 1.0, 1.0]))]
        sizes = []
        for budgets, temperature, top_p in runs:
            res = spec.generate(TARGET, target, drafter, reference, PROMPTS, N, sampling=sampled,
                                key=jax.random.key(2), loop=loop, budgets=budgets,
                                temperature=temperature, top_p=top_p)
            sizes.append(len(spec._CACHE))
            np.testing.assert_array_equal(res.num_generated, budgets)
            assert res.stats.emitted.sum() == (budgets - 1).sum()
            for b, n in enumerate(budgets):
                assert (res.tokens[b, :n] >= 0).all() and (res.tokens[b, n:] == -1).all()
                if temperature[b] == 0:
                    np.testing.assert_array_equal(res.tokens[b, :n], ar_tokens[b, :n])
        assert sizes[1] == sizes[0], f"loop={loop}: a run with other per-request values compiled"
    budgets = np.array([7, N, 2])
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, N, budgets=budgets)
    for b, n in enumerate(budgets):
        np.testing.assert_array_equal(res.tokens[b, :n], ar_tokens[b, :n])


def test_tau_and_upstream_acceptance_length_differ_where_the_budget_truncates(target, ar_tokens,
                                                                              reference):
    # Always-right drafts, block 4, 7 new tokens: prefill gives 1, step 1 emits 4, step 2 accepts 4 but
    # only 2 fit. tau counts emitted tokens (6 / 2 steps); upstream DFlash counts accepted + 1 (8 / 2).
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4)
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, 7)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :7])
    assert res.stats.tau == 3.0
    assert res.stats.acceptance_length_upstream == 4.0
    assert res.stats.summary()["acceptance_length_upstream"] == 4.0
    # By hand: two sequences, three steps in all; the second sequence's last step accepted 3 drafts
    # (4 tokens) of which 1 fit its budget.
    stats = SpecStats(block_size=4, steps=np.array([1, 2]), emitted=np.array([2, 5]),
                      accept_hist=np.array([0, 1, 0, 2]), accepted=np.array([2, 8]))
    assert stats.tau == 7 / 3 and stats.acceptance_length_upstream == 10 / 3
    # Where nothing is truncated they agree.
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, 9)
    assert res.stats.tau == res.stats.acceptance_length_upstream == 4.0


def test_position_limit_is_refused_before_anything_runs(reference):
    cfg = dataclasses.replace(CFG, max_position_embeddings=30)
    params = random_params(dense.param_shapes(cfg), 0.5, 0)
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4)
    with pytest.raises(ar.PositionLimitError, match=r"11 tokens\) plus 24 new tokens .* 35 positions.*"
                                                    r"max_position_embeddings \(30\)"):
        spec.generate(dense.target(cfg, jnp.float32), params, drafter, reference, PROMPTS, N)
    res = spec.generate(dense.target(cfg, jnp.float32), params, drafter, reference, PROMPTS, N,
                        budgets=[N, 19, N])  # each request within the limit runs
    np.testing.assert_array_equal(res.num_generated, [N, 19, N])
