"""The fast top-k / top-p thresholds against their sort-based definitions: the same kept set, bit for bit,
over many seeds, with ties, nuclei inside and beyond every candidate set, top_p 1 rows and top-k."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding import nucleus
from specpilot.decoding.sampling import SamplingConfig, filter_sum, filter_weights, sampling_filter

V = 32768  # the first candidates take the chunked path; nuclei reach past the last candidate set


def _logits(seed: int, rows: int, v: int = V) -> np.ndarray:
    """Rows from peaked to flat, rounded so that many values tie (at the cut-off too)."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.5, 2.0, 4.0, 8.0], size=(rows, 1))
    return np.round(rng.normal(size=(rows, v)) * scale, 1).astype(np.float32)


def _nucleus_sizes(x: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """How many tokens each row's sort-based top-p keeps."""
    cutoff = np.asarray(jax.jit(nucleus.top_p_cutoff_sorted)(jnp.asarray(x), jnp.asarray(top_p)))
    return (x >= cutoff).sum(-1)


def test_top_values_and_k_threshold_equal_top_k_with_ties():
    x = jnp.asarray(_logits(0, 6))
    for k in (1, 20, 32, 50, 256):
        want = jax.lax.top_k(x, k)[0]
        np.testing.assert_array_equal(np.asarray(nucleus.top_values(x, k)), np.asarray(want))
        kth, top = jax.jit(nucleus.top_k_threshold, static_argnums=1)(x, k)
        np.testing.assert_array_equal(np.asarray(top), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(kth), np.asarray(want[:, -1:]))


def test_fast_top_p_keeps_the_sorted_set_over_many_seeds():
    fast = jax.jit(nucleus.top_p_cutoff)
    sizes = []
    for seed in range(24):
        rng = np.random.default_rng(1000 + seed)
        x = _logits(seed, 4)
        top_p = rng.choice([0.3, 0.5, 0.9, 0.95, 0.99, 1.0], size=(4, 1)).astype(np.float32)
        got = np.asarray(fast(jnp.asarray(x), jnp.asarray(top_p)))
        want = np.asarray(jax.jit(nucleus.top_p_cutoff_sorted)(jnp.asarray(x), jnp.asarray(top_p)))
        np.testing.assert_array_equal(x >= got, x >= want, err_msg=f"seed {seed}")
        np.testing.assert_array_equal(got[top_p >= 1], -np.inf)
        sizes += _nucleus_sizes(x, top_p)[top_p[:, 0] < 1].tolist()
    sizes = np.asarray(sizes)
    small, large = min(nucleus.TOP_P_CANDIDATES), max(nucleus.TOP_P_CANDIDATES)
    # nuclei the first candidates decide, ones a later set decides, ones only a sort does
    assert (sizes <= small).any() and ((sizes > small) & (sizes <= large)).any() and (sizes > large).any()


_STAGES = (0,) + nucleus.TOP_P_CANDIDATES


@pytest.mark.parametrize("nucleus_size", [(a + b) // 2 for a, b in zip(_STAGES, _STAGES[1:])] + [2 * _STAGES[-1]])
def test_fast_top_p_at_each_candidate_size(nucleus_size):
    """A batch whose widest nucleus is nucleus_size: decided by each candidate set in turn, or by the
    sort, with a tie group at the cut-off."""
    x = np.full((2, V), -30.0, np.float32)
    x[:, :nucleus_size] = 0.0  # equal mass on nucleus_size tokens: any top_p < 1 keeps all of them
    x[1, 3] = 1.0
    top_p = np.asarray([[0.9], [0.5]], np.float32)
    got = np.asarray(jax.jit(nucleus.top_p_cutoff)(jnp.asarray(x), jnp.asarray(top_p)))
    want = np.asarray(jax.jit(nucleus.top_p_cutoff_sorted)(jnp.asarray(x), jnp.asarray(top_p)))
    np.testing.assert_array_equal(x >= got, x >= want)
    assert (x[0] >= got[0]).sum() == nucleus_size  # the tie group at the cut-off stays whole


def _reference_cutoff(logits: np.ndarray, temperature: float, top_k: int, top_p: np.ndarray) -> np.ndarray:
    """The filter's cut-off from a full top-k and a full sort: the definitions the fast path replaces."""
    x = jnp.asarray(logits) * (1.0 / np.float32(temperature))
    kth = jnp.full(x.shape[:-1] + (1,), -jnp.inf)
    if top_k:
        kth = jnp.min(jax.lax.top_k(x, top_k)[0], axis=-1, keepdims=True)
    top_p_cut = nucleus.top_p_cutoff_sorted(jnp.where(x < kth, -jnp.inf, x), jnp.asarray(top_p))
    return np.asarray(x), np.asarray(jnp.maximum(kth, top_p_cut))


@pytest.mark.parametrize("top_k", [0, 20, 50, 300])
def test_sampling_filter_keeps_the_reference_set_with_top_k(top_k):
    filt = jax.jit(sampling_filter)
    for seed in range(4):
        logits = _logits(50 + seed, 3)
        top_p = np.asarray([0.9, 1.0, 0.95], np.float32)
        s = SamplingConfig(0.7, top_k, 1.0).for_requests(3, top_p=top_p)
        f = filt(jnp.asarray(logits), s)
        x, want = _reference_cutoff(logits, 0.7, top_k, top_p[:, None])
        np.testing.assert_array_equal(x >= np.asarray(f.cutoff), x >= want, err_msg=f"seed {seed}")


def _adversarial_rows() -> tuple[np.ndarray, np.ndarray]:
    """One batch of (logits [R, V], top_p [R, 1]) rows meant to break the candidate search."""
    rng = np.random.default_rng(7)
    rows, top_p = [], []

    def add(row, p):
        rows.append(row.astype(np.float32))
        top_p.append(p)

    add(np.where(np.arange(V) == 5, 30.0, rng.normal(size=V)), 0.9)  # a nucleus of one token
    add(np.round(rng.normal(size=V) * 4.0, 1), 0.9)  # many ties, at the cut-off too
    add(rng.normal(size=V) * 0.3, 0.95)  # flat: wider than every candidate set (the sort decides)
    add(rng.normal(size=V) * 4.0, 1.0)  # top_p 1: no cut-off
    tie = np.full(V, -30.0)
    tie[:100] = 0.0  # a tie group of 100 across the first set's end, all kept
    add(tie, 0.9)
    straddle = np.full(V, -30.0)
    straddle[:10], straddle[10:310] = 2.0, 0.0  # decided by 128 values, kept ties reach past them
    add(straddle, 0.5)
    add(np.round(rng.normal(size=V) * 8.0, 0), 0.99)  # peaked, coarse ties
    return np.stack(rows), np.asarray(top_p, np.float32)[:, None]


def _check_nucleus(logits: np.ndarray, top_p: np.ndarray, scale: float, batched: bool = False) -> np.ndarray:
    """top_p_nucleus against the definition: the kept set bit for bit, the largest logit, and the kept
    sum (where given) against the definition's kept weights summed in float64. Returns where given."""
    s = jnp.full(top_p.shape, scale, jnp.float32)
    got = jax.jit(nucleus.top_p_nucleus, static_argnames="batched")(jnp.asarray(logits), s, jnp.asarray(top_p),
                                                                   batched=batched)
    x = np.asarray(jnp.asarray(logits) * s)
    want = np.asarray(jax.jit(nucleus.top_p_cutoff_sorted)(jnp.asarray(x), jnp.asarray(top_p)))
    np.testing.assert_array_equal(x >= np.asarray(got.cutoff), x >= want)
    np.testing.assert_array_equal(np.asarray(got.top), logits.max(-1, keepdims=True))
    weights = np.exp((logits.astype(np.float64) - logits.max(-1, keepdims=True)) * np.float64(np.float32(scale)))
    kept = np.asarray(got.kept_sum)[:, 0]
    given = np.isfinite(kept)
    want_sum = np.where(x >= want, weights, 0.0).sum(-1)
    np.testing.assert_allclose(kept[given], want_sum[given], rtol=1e-6)
    assert not given[top_p[:, 0] >= 1].any()  # no cut-off: the caller sums the whole row
    return given


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_nucleus_on_adversarial_rows(temperature, batched):
    """Row by row (the CPU's search) and with the undecided rows sorted together (accelerators')."""
    logits, top_p = _adversarial_rows()
    given = _check_nucleus(logits, top_p, 1.0 / temperature, batched)
    # the one-token nucleus and the tie group inside 128 values come from candidates; the kept ties
    # past the deciding set do not, unless the fallback sorted the whole row
    assert given[0] and given[4] and given[5] == batched


def test_nucleus_kept_sums_over_many_seeds():
    given = []
    for seed in range(12):
        rng = np.random.default_rng(2000 + seed)
        top_p = rng.choice([0.3, 0.9, 0.95, 0.99, 1.0], size=(4, 1)).astype(np.float32)
        given += _check_nucleus(_logits(100 + seed, 4), top_p, 1.25).tolist()
    assert any(given) and not all(given)


def test_extended_equals_top_k_with_ties():
    rng = np.random.default_rng(3)
    for scale in (0.5, 4.0):
        row = jnp.asarray(np.round(rng.normal(size=V) * scale, 1).astype(np.float32))  # ties
        for n, m in ((64, 128), (50, 64), (128, 192)):
            got = nucleus._extended(row, jax.lax.top_k(row, n)[0], m)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.lax.top_k(row, m)[0]))


def test_filter_sum_from_candidates_equals_the_full_sum():
    """A mixed batch (narrow and wide nuclei, top_p 1, top-k): the normalizers from the candidates and
    from the pass over the vocabulary agree."""
    logits, top_p = _adversarial_rows()
    for top_k in (0, 50):
        s = SamplingConfig(0.8, top_k, 1.0).for_requests(len(top_p), top_p=top_p[:, 0])
        f = jax.jit(sampling_filter)(jnp.asarray(logits), s)
        got = np.asarray(jax.jit(filter_sum)(jnp.asarray(logits), f))
        full = np.asarray(jnp.sum(filter_weights(jnp.asarray(logits), f), axis=-1))
        np.testing.assert_allclose(got, full, rtol=1e-6)
        assert np.isfinite(np.asarray(f.kept_sum)).any()
