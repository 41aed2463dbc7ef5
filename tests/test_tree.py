"""Tree decoding: the tree builder against brute force, greedy tree output equals AR token for token, and
branching raises tau where the right token is a non-first candidate."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding import ar, spec, tree
from specpilot.decoding import token_tree as tt
from specpilot.decoding.rejection import accept_greedy
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from specpilot.state import CacheOverflowError
from helpers import random_params

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
TARGET = dense.target(CFG, jnp.float32)
PROMPTS = [[1, 2, 3], [5, 9, 11, 40, 7, 3, 2, 8, 8, 1, 60], [17, 4, 99, 23, 5, 6]]
N = 24
EXTRA = 17


@pytest.fixture(scope="module")
def target():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    return ar.generate(TARGET, target, PROMPTS, N + EXTRA).tokens


@pytest.fixture(scope="module")
def reference(ar_tokens):
    return jnp.asarray(dr.replay_reference(PROMPTS, ar_tokens.tolist()))


# ---- the builder ----------------------------------------------------------------------------------

def _brute_force_paths(logprobs: np.ndarray, nodes: int, depth: int, k: int) -> set:
    """Every rank sequence of length 1..depth, scored as build_tree sums (float32, depth order); the
    nodes - 1 best by (score desc, depth asc), as sets of token paths."""
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]  # [D, k] top-k tokens per position
    cands = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            score = np.float32(0.0)
            for j, r in enumerate(ranks):
                score = np.float32(score + np.float32(logprobs[j, order[j, r]]))
            cands.append((-float(score), d, tuple(int(order[j, r]) for j, r in enumerate(ranks))))
    cands.sort(key=lambda c: (c[0], c[1]))
    return {c[2] for c in cands[:nodes - 1]}


def _node_paths(t: tt.Tree, b: int) -> set:
    toks, par = np.asarray(t.tokens[b]), np.asarray(t.parents[b])
    out = set()
    for i in range(1, len(toks)):
        path, j = [], i
        while j > 0:
            path.append(int(toks[j]))
            j = int(par[j])
        out.add(tuple(reversed(path)))
    return out


def _check_structure(t: tt.Tree, depth: int):
    toks, par, dep, anc = (np.asarray(x) for x in (t.tokens, t.parents, t.depths, t.ancestors))
    bsz, n = toks.shape
    for b in range(bsz):
        assert par[b, 0] == -1 and dep[b, 0] == 0
        for i in range(1, n):
            assert 0 <= par[b, i] < i, "parents precede their children"
            assert dep[b, i] == dep[b, par[b, i]] + 1 <= depth
            chain, j = {i}, i
            while j > 0:
                j = par[b, j]
                chain.add(j)
            np.testing.assert_array_equal(np.flatnonzero(anc[b, i]), sorted(chain))
        for i in range(n):  # siblings hold distinct tokens
            kids = toks[b][par[b] == i]
            assert len(set(kids.tolist())) == len(kids)


@pytest.mark.parametrize("depth,k,nodes", [(1, 3, 3), (2, 2, 7), (3, 2, 6), (3, 3, 11), (4, 2, 16), (3, 4, 9)])
def test_builder_equals_brute_force(depth, k, nodes):
    rng = np.random.default_rng(depth * 100 + k * 10 + nodes)
    bsz, v = 3, 7
    logits = rng.normal(size=(bsz, depth + 1, v)).astype(np.float32) * 2
    logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    t = jax.jit(tt.build_tree, static_argnums=(2, 3, 4))(jnp.asarray(logprobs), jnp.arange(bsz), nodes, depth, k)
    _check_structure(t, depth)
    np.testing.assert_array_equal(np.asarray(t.tokens[:, 0]), np.arange(bsz))
    for b in range(bsz):
        assert _node_paths(t, b) == _brute_force_paths(logprobs[b], nodes, depth, k)


def test_builder_with_ties_still_builds_a_tree():
    # One-hot logits: float32 log-probabilities of exactly 0 for the top token, so most paths tie.
    rng = np.random.default_rng(5)
    logits = 30.0 * jax.nn.one_hot(rng.integers(0, 9, size=(2, 5)), 9) + 29.0 * jax.nn.one_hot(
        rng.integers(0, 9, size=(2, 5)), 9)
    t = tt.build_tree(jax.nn.log_softmax(logits, axis=-1), jnp.array([3, 4]), 10, 5, 3)
    _check_structure(t, 5)


def test_top_k_by_argmax_is_lax_top_k():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 4, size=(50, 9)).astype(np.float32)  # many ties
    x[::5, 3:] = -np.inf  # rows with fewer finite entries than k
    for k in (1, 3, 7):
        vals, idx = tt.top_k_by_argmax(jnp.asarray(x), k)
        want_vals, want_idx = jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(vals, want_vals)
        np.testing.assert_array_equal(idx, want_idx)


def test_bad_shapes_are_refused():
    lp = jnp.zeros((1, 3, 5))
    with pytest.raises(ValueError, match="exceed the 7 nodes"):
        tt.build_tree(lp, jnp.zeros((1,), jnp.int32), 8, 2, 2)
    with pytest.raises(ValueError, match="drafted positions"):
        tt.build_tree(lp, jnp.zeros((1,), jnp.int32), 4, 4, 2)
    with pytest.raises(ValueError, match="branching"):
        tt.build_tree(lp, jnp.zeros((1,), jnp.int32), 4, 2, 0)


def test_greedy_acceptance_on_a_chain_is_prefix_matching():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(64, 5, 3)).astype(np.float32))
    drafts = jnp.asarray(rng.integers(0, 3, size=(64, 4)))
    t = tt.chain_tree(jnp.concatenate([jnp.zeros((64, 1), jnp.int32), drafts], axis=1))
    last, n_acc, nxt = tt.accept_tree_greedy(t, logits, 4)
    want_n, want_next = accept_greedy(drafts, logits)
    np.testing.assert_array_equal(n_acc, want_n)
    np.testing.assert_array_equal(last, want_n)
    np.testing.assert_array_equal(nxt, want_next)


# ---- decoding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("nodes,depth,branching", [(8, 4, 2), pytest.param(12, 7, 3, marks=pytest.mark.slow), (2, 1, 1)])
def test_block_drafter_tree_greedy_equals_ar(target, ar_tokens, nodes, depth, branching):
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=8)
    drafter, dparams = dr.BlockDrafter(dcfg, CFG), random_params(dr.param_shapes(dcfg), 0.5, 1)
    res = tree.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=nodes, depth=depth,
                        branching=branching)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    assert (res.num_generated == N).all()
    assert res.stats.emitted.sum() == len(PROMPTS) * (N - 1)


def test_oracle_replay_gives_tau_depth_plus_one(target, ar_tokens, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8)
    n = 1 + 2 * 6
    res = tree.generate(TARGET, target, drafter, reference, PROMPTS, n, nodes=10, depth=5, branching=2)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :n])
    assert res.stats.tau == 6 and res.stats.num_steps == 2


def test_branching_finds_runner_up_drafts(target, ar_tokens, reference):
    # Every third position's draft is wrong with the right token second: the chain stops there, a
    # tree with two candidates per position accepts through the second sibling.
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8, shift=1, wrong_every=3, runner_up=2.0)
    chain = spec.generate(TARGET, target, drafter, reference, PROMPTS, N, block_size=8)
    branched = tree.generate(TARGET, target, drafter, reference, PROMPTS, N, nodes=16, depth=7, branching=2)
    as_chain = tree.generate(TARGET, target, drafter, reference, PROMPTS, N, nodes=8, depth=7, branching=1)
    for res in (chain, branched, as_chain):
        np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    np.testing.assert_array_equal(as_chain.stats.accept_hist, chain.stats.accept_hist)
    assert branched.stats.tau > chain.stats.tau + 1.0


def test_tree_capacity_and_depth_are_checked(target, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4)
    with pytest.raises(ValueError, match="drafter block of 5"):
        tree.generate(TARGET, target, drafter, reference, PROMPTS, N, nodes=6, depth=4, branching=2)
    longest = max(len(p) for p in PROMPTS)
    with pytest.raises(CacheOverflowError, match="6-node tree"):
        tree.generate(TARGET, target, drafter, reference, PROMPTS, N, nodes=6, depth=3, branching=2,
                      cache_len=longest + N + 6 - 3)
