"""Two-level verification: the rooted-subtree selection against brute force, the early exit against a
truncated target, greedy two-level output equals AR token for token on dense and hybrid targets, token
forcing through a two-level step is clean, sampled output follows the target's exact distribution, and
every bad plan field fails naming it."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import forcing
from specpilot import plan as plan_mod
from specpilot import state as st
from specpilot.decoding import ar, tree, two_level
from specpilot.decoding import token_tree as tt
from specpilot.decoding.sampling import SamplingConfig
from specpilot.models import dense
from specpilot.models import drafter as dr
from helpers import random_params
from test_tree import CFG, PROMPTS, TARGET
import test_hybrid_spec as hs

N = 20


@pytest.fixture(scope="module")
def target():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    return ar.generate(TARGET, target, PROMPTS, N).tokens


@pytest.fixture(scope="module")
def block_drafter():
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=8)
    return dr.BlockDrafter(dcfg, CFG), random_params(dr.param_shapes(dcfg), 0.5, 1)


# ---- selection ------------------------------------------------------------------------------------

def _random_tree(rng, n):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    depths = [0]
    for i in range(1, n):
        depths.append(depths[parents[i]] + 1)
    p = jnp.asarray([parents], jnp.int32)
    return tt.Tree(jnp.asarray([rng.integers(0, 50, n)], jnp.int32), p, jnp.asarray([depths], jnp.int32),
                   tt.ancestors_of(p, max(depths))), parents


def _rooted_subtrees(parents, keep):
    for rest in itertools.combinations(range(1, len(parents)), keep - 1):
        chosen = {0, *rest}
        if all(parents[i] in chosen for i in rest):
            yield sorted(chosen)


@pytest.mark.parametrize("n,keep", [(5, 2), (7, 4), (8, 5), (9, 3), (10, 9)])
def test_selection_is_the_best_rooted_subtree(n, keep):
    rng = np.random.default_rng(n * 10 + keep)
    for trial in range(6):
        t, parents = _random_tree(rng, n)
        if trial % 2 == 0:  # path log-probabilities: sums of negative terms down each path
            raw = np.asarray(two_level.path_scores(t, jnp.asarray(-rng.exponential(size=(1, n))), n))[0]
            closed = raw
        else:  # arbitrary scores: a node counts as the lowest score on its root path
            raw = rng.normal(size=n)
            closed = np.array([min(raw[j] for j in range(n) if np.asarray(t.ancestors)[0, i, j] and j)
                               if i else np.inf for i in range(n)])
        depths = np.asarray(t.depths)[0]
        # the best rooted subtree: its nodes' (score, shallower, earlier) keys, best first, compared in order
        best = max(_rooted_subtrees(parents, keep),
                   key=lambda s: sorted(((closed[i], -depths[i], -i) for i in s), reverse=True))
        if trial % 2 == 0:  # distinct path scores: that is also the rooted subtree of the largest total
            assert best == max(_rooted_subtrees(parents, keep), key=lambda s: sum(closed[i] for i in s if i))
        sub, kept = two_level.select_subtree(t, jnp.asarray(raw[None]), keep)
        assert np.asarray(kept)[0].tolist() == best
        # the compacted tree: tokens, depths and parents of the kept nodes, ancestors recomputed agree
        new_of = {old: new for new, old in enumerate(best)}
        want_parents = [-1] + [new_of[parents[i]] for i in best[1:]]
        assert np.asarray(sub.parents)[0].tolist() == want_parents
        np.testing.assert_array_equal(sub.tokens[0], np.asarray(t.tokens)[0, best])
        np.testing.assert_array_equal(sub.depths[0], np.asarray(t.depths)[0, best])
        np.testing.assert_array_equal(sub.ancestors, tt.ancestors_of(sub.parents, n))


def test_path_scores_sum_each_root_path():
    rng = np.random.default_rng(1)
    t, parents = _random_tree(rng, 12)
    terms = -rng.exponential(size=12)
    got = np.asarray(two_level.path_scores(t, jnp.asarray(terms[None]), 11))[0]
    for i in range(12):
        want, j = 0.0, i
        while j > 0:
            want, j = want + terms[j], parents[j]
        np.testing.assert_allclose(got[i], want, rtol=1e-6)


# ---- the early exit -------------------------------------------------------------------------------

def test_early_exit_scores_equal_a_truncated_target_along_each_root_path(target):
    """Early-exit log-probabilities of a tree's nodes = a target cut to its first L layers (same final
    norm and head) run as a chain along each node's root path."""
    exit_layer = 1
    short_cfg = dataclasses.replace(CFG, num_layers=exit_layer, tap_layers=(0,))
    short = dense.target(short_cfg, jnp.float32)
    short_params = dict(target, layers=target["layers"][:exit_layer])
    rng = np.random.default_rng(0)
    b, nodes, depth, k = len(PROMPTS), 9, 3, 3
    logprobs = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, depth, CFG.vocab_size)) * 3.0), axis=-1)
    t = tt.build_tree(logprobs, jnp.asarray(rng.integers(0, CFG.vocab_size, size=b)), nodes, depth, k)
    tokens, lengths = ar.pack_prompts(PROMPTS, 64)
    state = TARGET.init_state(b, 64)
    prompt_forward = jax.jit(st.prompt_forward, static_argnums=0)  # one compile, not one per op
    _, _, state = prompt_forward(TARGET, target, jnp.asarray(tokens), jnp.asarray(lengths), state)
    got = jax.jit(two_level.early_exit_node_logprob, static_argnums=(0, 4))(TARGET, target, state, t, exit_layer)
    short_state = short.init_state(b, 64)
    _, _, short_state = prompt_forward(short, short_params, jnp.asarray(tokens), jnp.asarray(lengths),
                                       short_state)
    toks, par = np.asarray(t.tokens), np.asarray(t.parents)
    chain = jax.jit(lambda p, x, s: st.chain_forward(short, p, x, s)[0])  # one compile per path length
    for row in range(b):
        row_state = jax.tree.map(lambda x: x[row:row + 1], short_state)
        for i in range(1, nodes):
            path, j = [], i
            while j >= 0:
                path.insert(0, int(toks[row, j]))
                j = int(par[row, j])
            logits = chain(short_params, jnp.asarray([path[:-1]]), row_state)
            want = jax.nn.log_softmax(logits[0, -1])[path[-1]]
            np.testing.assert_allclose(got[row, i], want, rtol=1e-4, atol=1e-4)


# ---- decoding -------------------------------------------------------------------------------------

@pytest.mark.parametrize("first,keep,exit_layer", [("drafter_confidence", 6, None), ("early_exit", 6, 1),
                                                   pytest.param("early_exit", 3, 1, marks=pytest.mark.slow)])
def test_two_level_greedy_equals_ar(target, ar_tokens, block_drafter, first, keep, exit_layer):
    drafter, dparams = block_drafter
    res = two_level.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=12, depth=5, branching=3,
                             first=first, keep=keep, exit_layer=exit_layer)
    np.testing.assert_array_equal(res.tokens, ar_tokens)
    assert res.stats.emitted.sum() == len(PROMPTS) * (N - 1)


def test_drafter_confidence_keeps_the_smaller_tree(target, block_drafter):
    """Drafter confidence over an N-node tree keeps what the builder drafts at M nodes (continuous
    drafter scores, no ties): every step accepts the same, so the acceptance histograms agree."""
    drafter, dparams = block_drafter
    cut = two_level.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=16, depth=5, branching=3,
                             first="drafter_confidence", keep=7)
    small = tree.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=7, depth=5, branching=3)
    np.testing.assert_array_equal(cut.tokens, small.tokens)
    np.testing.assert_array_equal(cut.stats.accept_hist, small.stats.accept_hist)


def test_two_level_forcing_is_clean(target, ar_tokens):
    ref = forcing.chunked_scorer(target, TARGET, chunk=1)
    cand = forcing.two_level_scorer(target, TARGET, 12, 4, 3, "early_exit", 6, 1)
    report = forcing.force(ref, cand, PROMPTS, ar_tokens)
    assert report.passed, report.summary()
    assert report.num_positions == len(PROMPTS) * N


@pytest.fixture(scope="module")
def hybrid_target():
    return hs.hybrid_params(hs.CFG, 0)


@pytest.mark.parametrize("first,exit_layer", [("drafter_confidence", None), ("early_exit", 2)])
def test_hybrid_two_level_greedy_equals_ar(hybrid_target, first, exit_layer):
    # exit_layer 2: a linear-attention (per-node recurrence) and a full-attention layer score the tree
    want = ar.generate(hs.TARGET, hybrid_target, hs.PROMPTS, N).tokens
    dcfg = dr.DrafterConfig.for_target(hs.CFG, num_layers=1, block_size=8)
    drafter, dparams = dr.BlockDrafter(dcfg, hs.CFG), dr.init(jax.random.key(1), dcfg, jnp.float32, 0.5)
    res = two_level.generate(hs.TARGET, hybrid_target, drafter, dparams, hs.PROMPTS, N, nodes=12, depth=5,
                             branching=3, first=first, keep=6, exit_layer=exit_layer)
    np.testing.assert_array_equal(res.tokens, want)


def test_hybrid_two_level_forcing_is_clean(hybrid_target):
    want = ar.generate(hs.TARGET, hybrid_target, hs.PROMPTS, N).tokens
    report = forcing.force(forcing.chunked_scorer(hybrid_target, hs.TARGET, chunk=1),
                           forcing.two_level_scorer(hybrid_target, hs.TARGET, 12, 4, 3, "early_exit", 6, 2),
                           hs.PROMPTS, want)
    assert report.passed, report.summary()


def test_exit_layer_past_the_target_is_refused(target, block_drafter):
    drafter, dparams = block_drafter
    with pytest.raises(ValueError, match="exit_layer 2 must be below the target's 2 layers"):
        two_level.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=12, depth=5, branching=3,
                           first="early_exit", keep=6, exit_layer=2)


# ---- plans ----------------------------------------------------------------------------------------

KW = dict(drafter_block_size=8, default_matmul={"bf16": ["xla"], "w12": ["xla"]})
TREE = {"nodes": 16, "depth": 7, "branching": 2}


def test_a_two_level_plan_builds():
    p = plan_mod.build("t", {"verify": "two_level", "tree": TREE,
                             "two_level": {"first": "early_exit", "keep": 8, "exit_layer": 3}}, **KW)
    assert p.block_size == 16 and p.two_level == plan_mod.TwoLevel("early_exit", 8, 3) and p.uses_drafter
    assert p.describe()["two_level"] == {"first": "early_exit", "keep": 8, "exit_layer": 3, "exit_head": None}
    head = plan_mod.build("t", {"verify": "two_level", "tree": TREE, "two_level": {
        "first": "early_exit", "keep": 8, "exit_layer": 3, "exit_head": "/heads/exit3"}}, **KW)
    assert head.two_level == plan_mod.TwoLevel("early_exit", 8, 3, "/heads/exit3")


@pytest.mark.parametrize("level,match", [
    (None, r"t\.two_level: a two_level plan needs"),
    ({"first": "oracle", "keep": 8}, r"t\.two_level\.first: .*must be one of"),
    ({"keep": 8}, r"t\.two_level\.first: missing"),
    ({"first": "drafter_confidence"}, r"t\.two_level\.keep: missing"),
    ({"first": "drafter_confidence", "keep": 16}, r"t\.two_level\.keep: .*2\.\.15"),
    ({"first": "drafter_confidence", "keep": 1}, r"t\.two_level\.keep: .*2\.\.15"),
    ({"first": "drafter_confidence", "keep": 4.5}, r"t\.two_level\.keep: "),
    ({"first": "early_exit", "keep": 8}, r"t\.two_level\.exit_layer: .*positive integer for early_exit"),
    ({"first": "early_exit", "keep": 8, "exit_layer": 0}, r"t\.two_level\.exit_layer: "),
    ({"first": "drafter_confidence", "keep": 8, "exit_layer": 2}, r"t\.two_level\.exit_layer: .*belongs to"),
    ({"first": "early_exit", "keep": 8, "layer": 2}, r"t\.two_level: unknown key.*'layer'"),
    ({"first": "drafter_confidence", "keep": 8, "exit_head": "/h"}, r"t\.two_level\.exit_head: .*belongs to the early_exit"),
    ({"first": "early_exit", "keep": 8, "exit_layer": 2, "exit_head": ""}, r"t\.two_level\.exit_head: .*folder"),
    ({"first": "early_exit", "keep": 8, "exit_layer": 2, "exit_head": 3}, r"t\.two_level\.exit_head: .*folder"),
    ("early_exit", r"t\.two_level: expected a mapping"),
])
def test_bad_two_level_fields_fail_naming_the_field(level, match):
    fields = {"verify": "two_level", "tree": TREE}
    if level is not None:
        fields["two_level"] = level
    with pytest.raises(plan_mod.PlanError, match=match):
        plan_mod.build("t", fields, **KW)


def test_first_level_fields_belong_to_two_level_plans():
    with pytest.raises(plan_mod.PlanError, match=r"t\.two_level: a first level belongs to verify: two_level"):
        plan_mod.build("t", {"verify": "tree", "tree": TREE, "two_level": {"first": "drafter_confidence",
                                                                           "keep": 8}}, **KW)
    with pytest.raises(plan_mod.PlanError, match=r"t\.tree: a tree plan needs tree"):
        plan_mod.build("t", {"verify": "two_level", "two_level": {"first": "drafter_confidence", "keep": 8}}, **KW)


@pytest.mark.parametrize("first,exit_layer", [pytest.param("early_exit", 1, marks=pytest.mark.slow),
                                              ("drafter_confidence", None)])
def test_two_level_sampling_matches_target_distribution_end_to_end(first, exit_layer):
    """Sampled two-level output's joint distribution of 3 tokens equals the target's exact one (the
    first level chooses which siblings the recursive rejection sees, never what it accepts)."""
    from test_rejection import SMALL, _exact_joint, assert_distributed_as

    params = random_params(dense.param_shapes(SMALL), 0.3, 3)
    dcfg = dr.DrafterConfig.for_target(SMALL, num_layers=1, block_size=3)
    drafter, dparams = dr.BlockDrafter(dcfg, SMALL), random_params(dr.param_shapes(dcfg), 0.3, 4)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt, n = [1, 2, 3], 4000
    small = dense.target(SMALL, jnp.float32)
    res = two_level.generate(small, params, drafter, dparams, [prompt] * n, 3, nodes=6, depth=2, branching=2,
                             first=first, keep=3, exit_layer=exit_layer, sampling=sampling,
                             key=jax.random.key(5), cache_len=10)
    assert_distributed_as(res.tokens @ np.array([64, 8, 1]), _exact_joint(params, prompt, sampling),
                          f"two-level {first} (t1, t2, t3)")
    assert res.stats.accept_hist[0] > 0 and res.stats.accept_hist[1:].sum() > 0
