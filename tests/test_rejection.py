"""Verification: greedy prefix matching, and rejection sampling preserving the target distribution.

Statistical tests use a chi-square goodness-of-fit test at significance level ALPHA = 1e-3 with fixed
seeds (so they are deterministic); cells with expected count < 5 are pooled, and cells of probability 0
must stay empty.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from specpilot.decoding import ar, spec
from specpilot.decoding.rejection import accept_greedy, rejection_sample, verify_chain
from specpilot.decoding.sampling import GREEDY, RequestSampling, SamplingConfig, probabilities, sample
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from helpers import random_params

ALPHA = 1e-3


def assert_distributed_as(samples, probs, what):
    """Chi-square goodness of fit of integer samples against probabilities (ALPHA level)."""
    samples, probs = np.asarray(samples), np.asarray(probs, np.float64)
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    assert counts[probs == 0].sum() == 0, f"{what}: samples of a probability-0 token"
    expected = probs * len(samples)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()  # float rounding only
    p_value = stats.chisquare(obs, exp).pvalue
    assert p_value > ALPHA, f"{what}: chi-square p = {p_value:.2e} over {len(samples)} samples"


_greedy = jax.jit(accept_greedy)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 4))
def test_accept_greedy_is_longest_matching_prefix(seed, planted):
    rng = np.random.default_rng(seed)
    b, k, v = 3, 4, 5
    logits = rng.normal(size=(b, k + 1, v)).astype(np.float32)
    choice = logits.argmax(-1)
    drafts = choice[:, :k].copy()
    drafts[:, planted:] = rng.integers(0, v, size=(b, k - planted))  # a true prefix, then noise
    n_acc, nxt = _greedy(jnp.asarray(drafts), jnp.asarray(logits))
    for i in range(b):
        want = next((j for j in range(k) if drafts[i, j] != choice[i, j]), k)
        assert int(n_acc[i]) == want
        assert int(nxt[i]) == choice[i, want]


def test_verify_chain_greedy_is_accept_greedy():
    logits = jax.random.normal(jax.random.key(0), (2, 4, 7))
    drafts = jnp.argmax(logits[:, :3], -1).at[1, 1].add(1) % 7
    a = verify_chain(jax.random.key(1), drafts, None, logits, GREEDY)
    b = accept_greedy(drafts, logits)
    assert [x.tolist() for x in a] == [x.tolist() for x in b] and a[0].tolist() == [3, 1]


# Hand-made distributions over V = 5 for K = 3 draft positions plus the bonus position. Zeros on both
# sides, as top-p/top-k produce them; q puts mass where p has none and vice versa.
P = np.array([[0.5, 0.2, 0.2, 0.1, 0.0],
              [0.1, 0.1, 0.1, 0.1, 0.6],
              [0.0, 0.0, 0.3, 0.3, 0.4],
              [0.25, 0.25, 0.0, 0.25, 0.25]])
Q = np.array([[0.1, 0.1, 0.2, 0.3, 0.3],
              [0.0, 0.0, 0.5, 0.5, 0.0],
              [0.2, 0.2, 0.2, 0.2, 0.2]])


@functools.partial(jax.jit, static_argnums=0)
def _sampled_chain(n, key):
    key_draft, key_verify = jax.random.split(key)
    q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (n,) + Q.shape)
    p = jnp.broadcast_to(jnp.asarray(P, jnp.float32), (n,) + P.shape)
    drafts = jax.random.categorical(key_draft, jnp.log(q), axis=-1).astype(jnp.int32)  # [n, K]
    n_acc, nxt = rejection_sample(key_verify, drafts, q, p)
    # Emitted chain: accepted drafts, then the correction / bonus token.
    k = Q.shape[0]
    idx = jnp.arange(k + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((n, 1), jnp.int32)], 1)
    emitted = jnp.where(idx < n_acc[:, None], padded, nxt[:, None])
    return n_acc, emitted


def test_rejection_sampling_preserves_target_distribution():
    n = 200_000
    n_acc, emitted = map(np.asarray, _sampled_chain(n, jax.random.key(0)))
    k = Q.shape[0]
    # The i-th emitted token exists when i-1 drafts were accepted; it must be distributed as p_i.
    for i in range(k + 1):
        reached = n_acc >= i
        assert_distributed_as(emitted[reached, i], P[i], f"emitted token {i}")
    # Acceptance of draft 1 happens with probability sum(min(p, q)) (total variation complement).
    rate = np.minimum(P[0], Q[0]).sum()
    assert abs((n_acc >= 1).mean() - rate) < 5 * np.sqrt(rate * (1 - rate) / n)


def test_identical_distributions_accept_everything():
    sampling = SamplingConfig(temperature=0.7, top_p=0.8)

    @jax.jit
    def run(logits):
        drafts = jax.random.categorical(jax.random.key(1), jnp.log(probabilities(logits[:, :4], sampling)))
        return verify_chain(jax.random.key(2), drafts.astype(jnp.int32), logits[:, :4], logits, sampling)

    n_acc, _ = run(jax.random.normal(jax.random.key(0), (64, 5, 11)))
    assert (np.asarray(n_acc) == 4).all()


# ------------------------------------------------------------------------------------------------
# End to end: speculative sampling from a tiny target with a random (disagreeing) block drafter


SMALL = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=16, qk_norm=True, tap_layers=(0, 1))


def _exact_joint(params, prompt, sampling):
    """p(t1, t2, t3 | prompt) under the sampling transform, by scoring every 2-token prefix."""
    v = SMALL.vocab_size
    t1, t2 = np.divmod(np.arange(v * v), v)
    seqs = np.concatenate([np.tile(prompt, (v * v, 1)), t1[:, None], t2[:, None]], 1)
    state = dense.init_state(SMALL, v * v, seqs.shape[1], jnp.float32)
    logits, _, _ = dense.chain_forward(params, SMALL, jnp.asarray(seqs, jnp.int32), state)
    p = np.asarray(probabilities(logits[:, len(prompt) - 1:], sampling), np.float64)  # [V*V, 3, V]
    joint = (p[0, 0][:, None, None]  # p(t1)
             * p[np.arange(v) * v, 1][:, :, None]  # p(t2 | t1)
             * p.reshape(v, v, 3, v)[:, :, 2])  # p(t3 | t1, t2)
    return joint.reshape(-1)


def test_spec_sampling_matches_target_distribution_end_to_end():
    params = random_params(dense.param_shapes(SMALL), 0.3, 3)
    dcfg = dr.DrafterConfig.for_target(SMALL, num_layers=1, block_size=3)
    drafter = dr.BlockDrafter(dcfg, SMALL)
    dparams = random_params(dr.param_shapes(dcfg), 0.3, 4)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt, n = [1, 2, 3], 4000
    want = _exact_joint(params, prompt, sampling)
    # A cache just large enough (3 + 3 + 3 - 2 positions) keeps the 4000-row batch cheap.
    target = dense.target(SMALL, jnp.float32)
    res = spec.generate(target, params, drafter, dparams, [prompt] * n, 3, sampling=sampling,
                        key=jax.random.key(5), cache_len=7)
    codes = res.tokens @ np.array([64, 8, 1])
    assert_distributed_as(codes, want, "speculative (t1, t2, t3)")
    # Drafts were both accepted and rejected, so both branches of the rejection step ran.
    assert res.stats.accept_hist[0] > 0 and res.stats.accept_hist[1:].sum() > 0
    # The AR sampler, judged by the same test, agrees with the same exact distribution.
    ar_res = ar.generate(target, params, [prompt] * n, 3, sampling, key=jax.random.key(6), cache_len=6)
    assert_distributed_as(ar_res.tokens @ np.array([64, 8, 1]), want, "AR (t1, t2, t3)")


# ------------------------------------------------------------------------------------------------
# Per-request temperature / top-p: each row is verified under its own transform, losslessly


ROW_SETTINGS = [(0.6, 1.0), (1.4, 0.8), (1.0, 0.6)]  # (temperature, top_p) of the row groups


@functools.partial(jax.jit, static_argnums=0)
def _per_row_chain(n, key, target_logits, draft_logits):
    """n rows per setting, each verifying K = 2 drafts sampled from its own q."""
    g = len(ROW_SETTINGS)
    temps = jnp.repeat(jnp.asarray([t for t, _ in ROW_SETTINGS], jnp.float32), n)
    top_ps = jnp.repeat(jnp.asarray([p for _, p in ROW_SETTINGS], jnp.float32), n)
    sampling = RequestSampling(temps, top_ps, greedy=False)
    tl = jnp.broadcast_to(target_logits, (g * n,) + target_logits.shape)
    dl = jnp.broadcast_to(draft_logits, (g * n,) + draft_logits.shape)
    key_draft, key_verify = jax.random.split(key)
    drafts = sample(key_draft, dl, sampling)  # [g*n, K]
    n_acc, nxt = verify_chain(key_verify, drafts, dl, tl, sampling)
    first = jnp.where(n_acc >= 1, drafts[:, 0], nxt)
    return n_acc, first


def test_per_row_sampling_preserves_each_rows_distribution():
    rng = np.random.default_rng(7)
    target_logits = jnp.asarray(rng.normal(size=(3, 6)) * 2, jnp.float32)  # K + 1 = 3 positions
    # a drafter that roughly agrees with the target, so both accepts and rejects happen
    draft_logits = target_logits[:2] + jnp.asarray(rng.normal(size=(2, 6)), jnp.float32)
    n = 60_000
    n_acc, first = map(np.asarray, _per_row_chain(n, jax.random.key(3), target_logits, draft_logits))
    for g, (temperature, top_p) in enumerate(ROW_SETTINGS):
        want = probabilities(target_logits[0], SamplingConfig(temperature, 0, top_p))
        rows = slice(g * n, (g + 1) * n)
        assert_distributed_as(first[rows], want, f"first token at temperature {temperature}, top_p {top_p}")
        assert 0 < (n_acc[rows] >= 1).mean() < 1  # both accept and reject ran in every group


def test_temperature_zero_rows_of_a_sampled_batch_are_greedy_exactly():
    rng = np.random.default_rng(8)
    b, k, v = 64, 4, 9
    target_logits = jnp.asarray(rng.normal(size=(b, k + 1, v)), jnp.float32)
    choice = np.asarray(target_logits).argmax(-1)
    drafts = choice[:, :k].copy()
    drafts[::2, 2] = (drafts[::2, 2] + 1) % v  # half the rows have a wrong third draft
    temps = np.where(np.arange(b) % 4 < 2, 0.0, 0.9).astype(np.float32)
    sampling = SamplingConfig(1.0).for_requests(b, temperature=temps)
    assert not sampling.greedy
    draft_logits = jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32)
    n_acc, nxt = jax.jit(verify_chain)(jax.random.key(0), jnp.asarray(drafts, jnp.int32), draft_logits,
                                       target_logits, sampling)
    want_acc, want_next = accept_greedy(jnp.asarray(drafts, jnp.int32), target_logits)
    greedy_rows = temps == 0
    # A greedy row's q is the one-hot at its draft logits' argmax; these drafts are the target's
    # argmax instead, so a greedy row sees p(x) = 1 >= q(x) wherever its draft is right.
    np.testing.assert_array_equal(np.asarray(n_acc)[greedy_rows], np.asarray(want_acc)[greedy_rows])
    np.testing.assert_array_equal(np.asarray(nxt)[greedy_rows], np.asarray(want_next)[greedy_rows])
    tokens = np.asarray(sample(jax.random.key(1), target_logits, sampling))
    np.testing.assert_array_equal(tokens[greedy_rows], choice[greedy_rows])
