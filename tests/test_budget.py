"""Mechanisms 1 and 2 without the engine: the draft-count chooser against brute force, verification of
a row's first kept drafts, and the packed verify forward against the padded one."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.costmodel.prediction import predict
from specpilot.decoding.rejection import accept_greedy, rejection_sample
from specpilot.models import dense
from specpilot.plan import Batching
from specpilot.serving.budget import StepCost, choose_draft_lengths, expected_accepted, marginal_gains, round_up
from specpilot.serving.engine_checks import stream_sizes
from specpilot.serving.packed import packed_forward, packed_layout
from specpilot.serving.slots import EngineSetup, packed_verify
from specpilot.state import causal_mask, chain_positions
from engine_helpers import CFG, TARGET
from helpers import random_params


def _rate(conf, active, k, cost, sizes=()):
    """(rows + expected accepted) / step time, computed directly from the definition; with stream sizes
    the step runs (and costs) the smallest size holding its tokens."""
    gain, tokens = 0.0, 0
    for b in range(conf.shape[0]):
        if active[b]:
            gain += 1.0 + sum(float(np.prod(conf[b, : j + 1])) for j in range(k[b]))
            tokens += k[b] + 1
    priced = min((n for n in sizes if n >= tokens), default=tokens)
    return gain / (cost.fixed_s + cost.per_token_s * priced), tokens


@pytest.mark.parametrize("seed", range(6))
def test_chooser_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    s, kmax = 3, 4
    conf = rng.uniform(0.05, 1.0, (s, kmax)).astype(np.float32)
    active = rng.uniform(size=s) < 0.8
    active[0] = True
    rows = int(active.sum())
    for cost in (StepCost(), StepCost(1.0, 0.15), StepCost(1.0, 0.6)):
        for budget in range(2 * rows, rows * (kmax + 1) + 2):
            k = np.asarray(choose_draft_lengths(jnp.asarray(conf), jnp.asarray(active), budget, cost))
            assert np.all(k[~active] == 0) and np.all((k[active] >= 1) & (k[active] <= kmax)), k
            got, tokens = _rate(conf, active, k, cost)
            assert tokens <= budget, (k, budget)
            best = -1.0
            for ks in itertools.product(range(1, kmax + 1), repeat=rows):
                full = np.zeros(s, int)
                full[active] = ks
                r, t = _rate(conf, active, full, cost)
                if t <= budget:
                    best = max(best, r)
            assert got == pytest.approx(best, rel=1e-5), (budget, cost, k)


@pytest.mark.parametrize("seed", range(4))
def test_chooser_with_stream_sizes_equals_brute_force(seed):
    """Priced at the stream size the step runs, the chosen counts are the best of every combination."""
    rng = np.random.default_rng(100 + seed)
    s, kmax = 3, 4
    conf = rng.uniform(0.05, 1.0, (s, kmax)).astype(np.float32)
    active = np.ones(s, bool)
    budget = s * (kmax + 1)
    for streams in (2, 3, 5):
        sizes = stream_sizes(Batching(verify="packed", draft_budget="confidence", streams=streams), budget)
        for cost in (StepCost(1.0, 0.05), StepCost(1.0, 0.2), StepCost(1.0, 0.6)):
            k = np.asarray(choose_draft_lengths(jnp.asarray(conf), jnp.asarray(active), budget, cost, sizes))
            got, _ = _rate(conf, active, k, cost, sizes)
            best = max(_rate(conf, active, np.asarray(ks), cost, sizes)[0]
                       for ks in itertools.product(range(1, kmax + 1), repeat=s))
            assert got == pytest.approx(best, rel=1e-5), (sizes, cost, k)


def test_stream_sizes_and_rounding():
    packed = lambda n: Batching(verify="packed", draft_budget="confidence", streams=n)  # noqa: E731
    assert stream_sizes(packed(1), 24) == (24,)
    assert stream_sizes(packed(3), 24) == (8, 16, 24)
    assert stream_sizes(packed(4), 10) == (3, 5, 8, 10)
    assert stream_sizes(packed(8), 4) == (2, 3, 4)  # never below a row's two tokens, no repeats
    assert stream_sizes(Batching(), 24) == ()
    assert round_up(jnp.asarray([1, 8, 9, 24, 30]), (8, 16, 24)).tolist() == [8, 8, 16, 24, 24]


def test_measured_step_cost_interpolates_its_points():
    cost = StepCost(points=((8, 2.0), (16, 3.0), (32, 7.0)))
    np.testing.assert_allclose(cost.step_s(jnp.asarray([4, 8, 12, 16, 24, 40])), [2.0, 2.0, 2.5, 3.0, 5.0, 7.0])
    for bad in (((8, 2.0), (8, 3.0)), ((16, 2.0), (8, 3.0)), ((8, 0.0),)):
        with pytest.raises(ValueError, match="points"):
            StepCost(points=bad)


def test_expected_accepted_is_the_prefix_product_sum():
    conf = jnp.asarray([[0.5, 0.5, 1.0], [0.9, 0.1, 0.9]])
    np.testing.assert_allclose(marginal_gains(conf), [[0.5, 0.25, 0.25], [0.9, 0.09, 0.081]], rtol=1e-6)
    np.testing.assert_allclose(expected_accepted(conf, jnp.asarray([2, 3])), [0.75, 1.071], rtol=1e-6)


def test_flat_cost_fills_the_budget_and_a_steep_one_takes_one_draft():
    conf = jnp.full((4, 7), 0.9)
    active = jnp.ones(4, bool)
    assert int(jnp.sum(choose_draft_lengths(conf, active, 20) + 1)) == 20
    assert choose_draft_lengths(conf, active, 32, StepCost(1e-3, 1.0)).tolist() == [1, 1, 1, 1]


def test_greedy_verification_of_kept_drafts_equals_the_truncated_chain():
    rng = np.random.default_rng(0)
    b, k, v = 5, 4, 6
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)), jnp.float32)
    choice = np.asarray(jnp.argmax(logits, -1))
    drafts = np.where(rng.uniform(size=(b, k)) < 0.7, choice[:, :k], (choice[:, :k] + 1) % v).astype(np.int32)
    kept = np.asarray([0, 1, 2, 3, 4], np.int32)
    n, nxt = accept_greedy(jnp.asarray(drafts), logits, jnp.asarray(kept))
    for row in range(b):
        c = int(kept[row])
        n1, nxt1 = accept_greedy(jnp.asarray(drafts[row: row + 1, :c]), logits[row: row + 1, : c + 1])
        assert (int(n[row]), int(nxt[row])) == (int(n1[0]), int(nxt1[0])), row


def test_sampled_verification_of_kept_drafts_keeps_the_target_distribution():
    """Row 0 keeps no draft: its token is drawn from p_0 whatever q says; row 1 keeps one draft drawn
    from q: its first emitted token is distributed as p_0 (Leviathan et al.), counted over 20000 keys."""
    p = jnp.asarray([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]] * 2, jnp.float32)  # [2, 3, V]
    q = jnp.asarray([[[0.1, 0.1, 0.8], [0.6, 0.2, 0.2]]] * 2, jnp.float32)  # [2, 2, V]
    n = 20000
    keys = jax.random.split(jax.random.key(0), n)

    def one(key):
        kd, kv = jax.random.split(key)
        drafts = jax.random.categorical(kd, jnp.log(q), axis=-1).astype(jnp.int32)  # [2, 2]
        acc, nxt = rejection_sample(kv, drafts, q, p, jnp.asarray([0, 1]))
        return acc, jnp.where(acc > 0, drafts[:, 0], nxt)

    acc, first = jax.jit(jax.vmap(one))(keys)
    assert int(jnp.max(acc[:, 0])) == 0 and int(jnp.max(acc[:, 1])) <= 1
    for row in (0, 1):
        freq = np.bincount(np.asarray(first[:, row]), minlength=3) / n
        np.testing.assert_allclose(freq, [0.5, 0.3, 0.2], atol=0.015)


def test_packed_layout():
    rows, offsets, valid, starts = packed_layout(jnp.asarray([2, 0, 3, 1]), 8)
    assert rows.tolist()[:6] == [0, 0, 2, 2, 2, 3] and offsets.tolist()[:6] == [0, 1, 0, 1, 2, 0]
    assert valid.tolist() == [True] * 6 + [False] * 2 and starts.tolist() == [0, 2, 2, 5]


def close(got, want):
    want = np.asarray(want)
    if want.size == 0:
        return
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(float(np.abs(want).max()), 1.0))


def test_packed_verify_equals_padded():
    """Rows at different committed lengths verify 1..4 candidates: packed logits and written K/V equal
    the padded forward's at every kept position (float32: within 1e-5 of each tensor's largest magnitude;
    the packed attention sums over every row's slots, so rounding differs at float32 epsilon)."""
    params = random_params(dense.param_shapes(CFG), 0.5, 0)
    s, t, max_len = 4, 5, 40
    rng = np.random.default_rng(1)
    state = TARGET.init_state(s, max_len, TARGET.dtype)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, (s, 16)), jnp.int32)
    lengths = jnp.asarray([16, 3, 9, 12], jnp.int32)
    positions = chain_positions(state, 16)
    mask = causal_mask(state, positions) & (jnp.arange(max_len)[None, None, :] < lengths[:, None, None])
    forward = jax.jit(TARGET.forward)  # one compile per shape, not one per op
    _, _, state = forward(params, prompt, positions, state, mask)
    state = state.commit(lengths)
    block = jnp.asarray(rng.integers(0, CFG.vocab_size, (s, t)), jnp.int32)
    counts = jnp.asarray([5, 1, 0, 3], jnp.int32)
    pos = chain_positions(state, t)
    want_logits, want_taps, want_state = forward(params, block, pos, state, causal_mask(state, pos))
    got_logits, got_taps, got_state = jax.jit(packed_forward, static_argnums=(0, 5))(
        TARGET, params, block, counts, state, 12)
    for b in range(s):
        c, ln = int(counts[b]), int(lengths[b])
        close(got_logits[b, :c], want_logits[b, :c])
        close(got_taps[b, :c], want_taps[b, :c])
        for got, want, before in zip(got_state.layers, want_state.layers, state.layers):
            close(got.k[b, :, : ln + c], want.k[b, :, : ln + c])  # [B, KVH, S, D]
            close(got.v[b, :, : ln + c], want.v[b, :, : ln + c])
            np.testing.assert_array_equal(got.k[b, :, ln + c:], before.k[b, :, ln + c:])  # nothing past its candidates


def test_switched_stream_sizes_equal_one_stream_and_never_copy_the_cache():
    """packed_verify over stream sizes (4, 8, 12) gives one 12-token stream's logits and K/V at every total,
    and its compiled program holds no copy of a layer's cache (the branches only read it)."""
    params = random_params(dense.param_shapes(CFG), 0.5, 0)
    s, t, max_len = 3, 4, 32
    rng = np.random.default_rng(3)
    state = TARGET.init_state(s, max_len, TARGET.dtype)
    prompt = jnp.asarray(rng.integers(0, CFG.vocab_size, (s, 8)), jnp.int32)
    positions = chain_positions(state, 8)
    _, _, state = jax.jit(TARGET.forward)(params, prompt, positions, state, causal_mask(state, positions))
    state = state.commit(jnp.asarray([8, 5, 2], jnp.int32))
    block = jnp.asarray(rng.integers(0, CFG.vocab_size, (s, t)), jnp.int32)
    setup = EngineSetup(TARGET, None, t, 24, 4, verify="packed", token_budget=12, stream_sizes=(4, 8, 12))
    switched = jax.jit(lambda c, st: packed_verify(setup, params, block, c, st))
    one = jax.jit(lambda c, st: packed_forward(TARGET, params, block, c, st, 12))
    for counts in ([1, 1, 1], [2, 1, 1], [3, 2, 2], [4, 4, 4], [0, 4, 1]):
        c = jnp.asarray(counts, jnp.int32)
        got, want = switched(c, state), one(c, state)
        for b, n in enumerate(counts):
            close(got[0][b, :n], want[0][b, :n])
            close(got[1][b, :n], want[1][b, :n])
        for g, w in zip(got[2].layers, want[2].layers):
            close(g.k, w.k)
            close(g.v, w.v)
    hlo = jax.jit(lambda c, st: packed_verify(setup, params, block, c, st), donate_argnums=1).lower(
        jnp.asarray([1, 1, 1], jnp.int32), state).compile().as_text()
    cache = "f32[%s]" % ",".join(map(str, state.layers[0].k.shape))
    assert not [line for line in hlo.splitlines() if " copy(" in line and cache in line]


def test_step_cost_from_the_cost_model():
    """The line passes through predict's step time at the plan's block, and its slope is predict's
    verify-stage growth per token from block 2 to the plan's block."""
    import dataclasses

    from test_costmodel_predict import SETTING, STOCK

    cost = StepCost.from_predict(STOCK, SETTING, slots=3)
    at = dataclasses.replace(SETTING, shape=dataclasses.replace(SETTING.shape, batch=3))
    full, small = predict(STOCK, at, 1.0), predict(dataclasses.replace(STOCK, block_size=2), at, 1.0)
    assert cost.step_s(3 * 4) == pytest.approx(full.step_s)
    grow = (full.step_s - full.stages["draft"]) - (small.step_s - small.stages["draft"])
    assert grow > 0 and cost.per_token_s == pytest.approx(grow / (3 * 2))
    with pytest.raises(ValueError, match="chain plan of block >= 3"):
        StepCost.from_predict(dataclasses.replace(STOCK, block_size=2), SETTING, slots=3)
