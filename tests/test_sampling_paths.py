"""The fast sampling paths against their plain definitions: the inverse-CDF draw, top-p from candidates
(and its full-sort fallback), the logits-based accept against rejection sampling on explicit
distributions, and the engine's batched rows against batches of one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding import nucleus
from specpilot.decoding.rejection import accept_sampled, rejection_sample, verify_chain
from specpilot.decoding.sampling import SamplingConfig, draw, probabilities, sample
from specpilot.serving.slots import sample_rows, verify_rows
from test_rejection import assert_distributed_as
from test_sampling import _reference_probs


@pytest.mark.parametrize("v", [6, 11, 512])  # chunk widths 2, 1 (prime) and 32
def test_draw_frequencies_match_weights(v):
    rng = np.random.default_rng(v)
    weights = rng.exponential(size=v) * (rng.random(v) < 0.7)  # some zero weights, never drawn
    weights[v // 2] = 3.0 * weights.max() + 1.0
    n = 100_000
    u = jax.random.uniform(jax.random.key(v), (n,))
    drawn = jax.jit(draw)(u, jnp.broadcast_to(jnp.asarray(weights, jnp.float32), (n, v)))
    assert_distributed_as(drawn, weights / weights.sum(), f"draw over {v} tokens")


def test_draw_edges_pick_positive_tokens():
    weights = jnp.asarray([[0.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0]] * 3, jnp.float32)
    u = jnp.asarray([0.0, 0.999999, np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
    assert np.asarray(draw(u, weights)).tolist() == [2, 4, 4]


@pytest.mark.parametrize("scale", [6.0, 0.3])  # peaked: candidates decide; flat: the full sort does
@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_top_p_on_a_large_vocabulary_matches_bruteforce(scale, top_p):
    rng = np.random.default_rng(int(scale * 10))
    v = 16384
    logits = (rng.normal(size=(3, v)) * scale).astype(np.float32)
    x = jnp.asarray(logits) * 1.25
    top = np.asarray(jax.lax.top_k(x, max(nucleus.TOP_P_CANDIDATES))[0])
    mass = np.exp(top - np.asarray(jax.nn.logsumexp(x, axis=-1, keepdims=True))).sum(-1)
    assert (mass >= top_p).all() if scale > 1 else (mass < top_p).all()  # the path this case means
    cfg = SamplingConfig(0.8, 0, top_p)
    got = np.asarray(jax.jit(probabilities)(jnp.asarray(logits), cfg.for_requests(3)))
    for b in range(3):
        np.testing.assert_allclose(got[b], _reference_probs(logits[b], 0.8, 0, top_p), atol=1e-6)


def test_top_values_are_the_top_k_values_with_ties():
    rng = np.random.default_rng(1)
    x = np.round(rng.normal(size=(2, 3, 8192)) * 2, 1).astype(np.float32)  # many ties
    got = jax.jit(nucleus.top_values, static_argnums=1)(jnp.asarray(x), 256)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.lax.top_k(jnp.asarray(x), 256)[0]))


def _chain_case(b=5, k=3, v=40, seed=0):
    rng = np.random.default_rng(seed)
    target = jnp.asarray(rng.normal(size=(b, k + 1, v)) * 2, jnp.float32)
    draft = target[:, :k] + jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32)
    return target, draft


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_accept_from_logits_equals_rejection_on_explicit_distributions(top_p):
    """Same key, same uniforms: the logits path takes exactly the decisions `rejection_sample` takes on
    the materialized p and q, token for token (up to float rounding in p/q, which these cases avoid)."""
    target, draft = _chain_case()
    s = SamplingConfig(0.9, 0, top_p).for_requests(5)
    drafts = sample(jax.random.key(1), draft, s)
    kept = jnp.asarray([3, 3, 1, 0, 2], jnp.int32)
    q, p = jax.jit(probabilities)(draft, s), jax.jit(probabilities)(target, s)
    keys = jax.random.split(jax.random.key(3), 20)
    got = jax.jit(jax.vmap(accept_sampled, (0, None, None, None, None, None)))(keys, drafts, draft, target, s, kept)
    want = jax.jit(jax.vmap(rejection_sample, (0, None, None, None, None)))(keys, drafts, q, p, kept)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert 0 < np.asarray(got[0]).mean() < 2  # accepts and rejections both ran


def test_engine_rows_equal_batches_of_one():
    target, draft = _chain_case(b=4, seed=2)
    s = SamplingConfig().for_requests(4, temperature=[0.7, 0.0, 1.3, 0.9], top_p=[1.0, 1.0, 0.8, 0.6])
    keys = jax.random.split(jax.random.key(7), 4)
    kept = jnp.asarray([3, 2, 3, 1], jnp.int32)
    drafts = jax.jit(sample_rows)(keys, draft, s)
    n_acc, nxt = jax.jit(verify_rows)(keys, drafts, draft, target, s, kept)
    one_sample, one_verify = jax.jit(sample), jax.jit(verify_chain)
    for b in range(4):
        row = SamplingConfig().for_requests(1, temperature=[float(s.temperature[b])], top_p=[float(s.top_p[b])])
        assert np.asarray(one_sample(keys[b], draft[b:b + 1], row)).tolist() == np.asarray(drafts[b:b + 1]).tolist()
        n1, x1 = one_verify(keys[b], drafts[b:b + 1], draft[b:b + 1], target[b:b + 1], row, kept[b:b + 1])
        assert (int(n1[0]), int(x1[0])) == (int(n_acc[b]), int(nxt[b])), f"row {b}"
