"""Lossless tree acceptance (recursive rejection sampling over siblings): a tree step's emitted tokens are
distributed exactly as the target's sequence distribution, alone and end to end; temperature-0 rows are
greedy. Chi-square at ALPHA with fixed seeds, as tests/test_rejection.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.decoding import tree
from specpilot.decoding import token_tree as tt
from specpilot.decoding.sampling import SamplingConfig
from specpilot.models import dense
from specpilot.models import drafter as dr
from helpers import random_params
from test_rejection import SMALL, _exact_joint, assert_distributed_as

V, NODES, DEPTH, K = 4, 7, 3, 2


def _tree():
    rng = np.random.default_rng(1)
    logprobs = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(1, DEPTH, V)) * 1.5, jnp.float32), axis=-1)
    return tt.build_tree(logprobs, jnp.zeros((1,), jnp.int32), NODES, DEPTH, K)


def _exact_outcomes(t: tt.Tree, p: np.ndarray) -> dict:
    """Every emitted sequence of one tree step (accepted path tokens, then the next token) with its
    probability under the target: walk down while the sampled token is a child's, stop at the first
    that is not."""
    toks, par = np.asarray(t.tokens[0]), np.asarray(t.parents[0])
    out = {}

    def walk(node, prefix, prob):
        children = {int(toks[c]): c for c in range(len(toks)) if par[c] == node}
        for x in range(V):
            px = prob * p[node, x]
            if x in children:
                walk(children[x], prefix + (x,), px)
            else:
                out[prefix + (x,)] = out.get(prefix + (x,), 0.0) + px
    walk(0, (), 1.0)
    return out


@functools.partial(jax.jit, static_argnums=0)
def _tree_steps(n, key, t, p):
    tb = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:]), t)
    pb = jnp.broadcast_to(p, (n,) + p.shape)
    last, n_acc, nxt = tt.recursive_rejection(key, tb, pb, DEPTH, K)
    path = tt.root_path(tb, last, DEPTH + 1)
    tokens = jnp.take_along_axis(tb.tokens, path, axis=1)[:, 1:]  # accepted tokens, root excluded
    idx = jnp.arange(DEPTH + 1)[None, :]
    emitted = jnp.where(idx < n_acc[:, None], jnp.concatenate([tokens, tokens[:, :1]], 1), nxt[:, None])
    emitted = jnp.where(idx <= n_acc[:, None], emitted, -1)  # past the next token: nothing
    return n_acc, emitted


def test_recursive_rejection_preserves_the_target_distribution():
    t = _tree()
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.full(V, 0.7), size=NODES)  # [N, V]: the target after each node
    exact = _exact_outcomes(t, p)
    outcomes = sorted(exact)
    code = {o: i for i, o in enumerate(outcomes)}
    n = 200_000
    n_acc, emitted = map(np.asarray, _tree_steps(n, jax.random.key(0), t, jnp.asarray(p, jnp.float32)))
    samples = np.array([code[tuple(int(x) for x in row if x >= 0)] for row in emitted])
    assert_distributed_as(samples, np.array([exact[o] for o in outcomes]), "tree step output")
    hist = np.bincount(n_acc, minlength=DEPTH + 1)
    assert (hist > 0).all(), hist  # every accepted depth occurred: siblings accepted and rejected
    # a second sibling was accepted at least sometimes (branching mattered)
    second = [int(np.asarray(t.tokens[0])[c]) for c in range(NODES)
              if np.asarray(t.parents[0])[c] == 0][1:]
    assert np.isin(emitted[:, 0], second).mean() > 0.01


def test_tree_sampling_matches_target_distribution_end_to_end():
    params = random_params(dense.param_shapes(SMALL), 0.3, 3)
    dcfg = dr.DrafterConfig.for_target(SMALL, num_layers=1, block_size=3)
    drafter = dr.BlockDrafter(dcfg, SMALL)
    dparams = random_params(dr.param_shapes(dcfg), 0.3, 4)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt, n = [1, 2, 3], 4000
    want = _exact_joint(params, prompt, sampling)
    target = dense.target(SMALL, jnp.float32)
    res = tree.generate(target, params, drafter, dparams, [prompt] * n, 3, nodes=5, depth=2, branching=2,
                        sampling=sampling, key=jax.random.key(5), cache_len=9)
    assert_distributed_as(res.tokens @ np.array([64, 8, 1]), want, "tree speculative (t1, t2, t3)")
    assert res.stats.accept_hist[0] > 0 and res.stats.accept_hist[1:].sum() > 0


def test_temperature_zero_rows_of_a_sampled_batch_are_greedy_exactly():
    rng = np.random.default_rng(8)
    b, v = 64, 9
    logprobs = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, 4, v)), jnp.float32), axis=-1)
    t = tt.build_tree(logprobs, jnp.zeros((b,), jnp.int32), 10, 4, 3)
    target_logits = jnp.asarray(rng.normal(size=(b, 10, v)) * 2, jnp.float32)
    temps = np.where(np.arange(b) % 4 < 2, 0.0, 0.9).astype(np.float32)
    sampling = SamplingConfig(1.0).for_requests(b, temperature=temps)
    last, n_acc, nxt = jax.jit(tt.verify_tree, static_argnums=(4, 5))(jax.random.key(0), t, target_logits,
                                                                       sampling, 4, 3)
    want = tt.accept_tree_greedy(t, target_logits, 4)
    greedy = temps == 0
    for got, exp in zip((last, n_acc, nxt), want):
        np.testing.assert_array_equal(np.asarray(got)[greedy], np.asarray(exp)[greedy])
    assert (np.asarray(n_acc)[greedy] > 0).any() and (np.asarray(n_acc)[greedy] == 0).any()  # both happened
