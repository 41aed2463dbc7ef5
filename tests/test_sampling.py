"""Sampling filters against brute-force numpy definitions, and distribution checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding.sampling import SamplingConfig, filtered_logprobs, probabilities, sample


def _reference_probs(logits, temperature, top_k, top_p):
    """Brute force: softmax at temperature, keep top-k, keep the smallest top-p prefix, renormalize."""
    x = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.ones_like(x, bool)
    if top_k:
        keep[order[top_k:]] = False
        # ties with the k-th value are kept, as a value threshold does
        keep |= x >= x[order[top_k - 1]]
    p = np.exp(x - x.max()) * keep
    p /= p.sum()
    if top_p < 1.0:
        kept = np.zeros_like(keep)
        mass = 0.0
        for i in order:
            if mass < top_p and keep[i]:
                kept[i] = True
            mass += p[i]
        cutoff = x[kept].min()
        keep &= x >= cutoff
        p = np.exp(x - x.max()) * keep
        p /= p.sum()
    return p


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 10, 0.5), (0.5, 3, 0.95), (2.0, 0, 0.3)])
def test_filtered_probs_match_bruteforce(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    for _ in range(5):
        logits = rng.normal(size=32).astype(np.float32) * 3
        got = np.asarray(probabilities(jnp.asarray(logits), SamplingConfig(temperature, top_k, top_p)))
        want = _reference_probs(logits, temperature, top_k, top_p)
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_greedy_is_argmax_and_one_hot():
    logits = jnp.array([[0.1, 3.0, -1.0], [5.0, 5.0, 1.0]])
    assert sample(None, logits, SamplingConfig()).tolist() == [1, 0]  # ties -> lowest id
    np.testing.assert_array_equal(probabilities(logits, SamplingConfig())[0], [0, 1, 0])
    with pytest.raises(ValueError, match="greedy"):
        filtered_logprobs(logits, SamplingConfig())


def test_sample_frequencies_match_distribution():
    # chi-square goodness of fit at significance 1e-3 over 20k draws (fixed seed: deterministic)
    from scipy import stats
    logits = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    cfg = SamplingConfig(temperature=0.9, top_k=5, top_p=0.97)
    n = 20000
    draws = sample(jax.random.key(1), jnp.broadcast_to(logits, (n, 6)), cfg)
    counts = np.bincount(np.asarray(draws), minlength=6)
    p = np.asarray(probabilities(logits, cfg), np.float64)
    assert counts[p == 0].sum() == 0
    support = p > 0
    _, pvalue = stats.chisquare(counts[support], p[support] / p[support].sum() * n)
    assert pvalue > 1e-3


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0),
                                dict(top_p=1.5)])
def test_bad_sampling_config(kw):
    with pytest.raises(ValueError):
        SamplingConfig(**kw)


def test_per_request_values_match_each_rows_scalar_config():
    """Row b of a batch with per-request temperature / top-p gets exactly what a scalar config of
    row b's values gives; temperature-0 rows are one-hot at the argmax; top_p = 1 filters nothing."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(4, 2, 32)) * 3, jnp.float32)  # [B, K, V]
    temps, top_ps = [0.7, 0.0, 1.3, 1.0], [1.0, 0.5, 0.8, 1.0]
    per_row = SamplingConfig(1.0, top_k=6).for_requests(4, temperature=temps, top_p=top_ps)
    assert not per_row.greedy and per_row.top_k == 6
    got = np.asarray(jax.jit(probabilities)(logits, per_row))
    for b, (t, p) in enumerate(zip(temps, top_ps)):
        want = probabilities(logits[b], SamplingConfig(t, 6, p))
        np.testing.assert_array_equal(got[b], np.asarray(want), err_msg=f"row {b}")
    np.testing.assert_array_equal(got[1], np.eye(32)[np.asarray(logits[1]).argmax(-1)])
    draws = np.asarray(sample(jax.random.key(0), logits, per_row))
    np.testing.assert_array_equal(draws[1], np.asarray(logits[1]).argmax(-1))
    # all rows at temperature 0: the static greedy path, no PRNG needed
    assert SamplingConfig(0.9).for_requests(2, temperature=[0.0, 0.0]).greedy


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=[1.0, -0.5]), "temperatures"), (dict(temperature=[1.0, np.nan]), "temperatures"),
    (dict(top_p=[0.0, 1.0]), "top_p"), (dict(top_p=[1.0, 1.2]), "top_p"),
    (dict(temperature=[1.0, 1.0, 1.0]), "shape")])
def test_bad_per_request_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(1.0).for_requests(2, **kw)
