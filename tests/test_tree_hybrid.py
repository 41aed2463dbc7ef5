"""Tree verification over a hybrid (Gated DeltaNet + attention) target: each node's recurrent and conv
state equals a chain forward along its root path (brute force), only the accepted path's states are
committed, and greedy tree output equals AR token for token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import forcing
from specpilot import state as st
from specpilot.decoding import ar, spec, tree
from specpilot.decoding import token_tree as tt
from specpilot.models import drafter as dr
from specpilot.models import hybrid
# The hybrid target, its prompts and the fixtures over them are test_hybrid_spec's (target, ar_tokens and
# reference are fixtures: pytest finds them by these names).
from test_hybrid_spec import CFG, EXTRA, N, PROMPTS, TARGET, ar_tokens, reference, target  # noqa: F401


def _prefilled(params, prompts, cache_len=64):
    tokens, lengths = ar.pack_prompts(prompts, cache_len)
    state = TARGET.init_state(len(prompts), cache_len)
    _, _, state = st.prompt_forward(TARGET, params, jnp.asarray(tokens), jnp.asarray(lengths), state)
    return state


@pytest.mark.slow  # over ~12 s on 2 cores; the default suite keeps its faster siblings
def test_every_node_state_equals_a_chain_along_its_root_path(target):
    rng = np.random.default_rng(0)
    nodes, depth, k = 12, 4, 3
    b = len(PROMPTS)
    logprobs = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, depth, CFG.vocab_size)) * 3.0), axis=-1)
    t = tt.build_tree(logprobs, jnp.asarray(rng.integers(0, CFG.vocab_size, size=b)), nodes, depth, k)
    assert int(t.depths.min(axis=1)[0]) == 0 and int(t.depths.max()) >= 3  # deep paths
    assert (np.asarray(t.depths[:, 1:4]) == 1).all()  # and three siblings at depth 1
    base = _prefilled(target, PROMPTS)
    logits, _, tstate = jax.jit(TARGET.forward)(target, t.tokens, base.lengths[:, None] + t.depths, base,
                                                st.tree_mask(base, t.ancestors), t.parents)
    toks, par = np.asarray(t.tokens), np.asarray(t.parents)
    linear = [i for i, lt in enumerate(CFG.layer_types) if lt == "linear_attention"]
    chain = jax.jit(lambda p, x, s: st.chain_forward(TARGET, p, x, s))
    for row in range(b):
        row_base = jax.tree.map(lambda x: x[row:row + 1], base)
        for i in range(nodes):
            path, j = [], i
            while j >= 0:
                path.insert(0, int(toks[row, j]))
                j = int(par[row, j])
            c_logits, _, cstate = chain(target, jnp.asarray([path]), row_base)
            last = len(path) - 1
            np.testing.assert_allclose(logits[row, i], c_logits[0, last], rtol=1e-5, atol=1e-5)
            for layer in linear:
                got, want = tstate.layers[layer], cstate.layers[layer]
                # layer 0 sees the same inputs on both sides; later layers' inputs come through attention at
                # other shapes (12 nodes against a path), a float32 rounding difference (~1e-6 relative)
                tol = 1e-6 if layer == 0 else 1e-5
                np.testing.assert_allclose(got.matrix_snapshots[row, i], want.matrix_snapshots[0, last],
                                           rtol=tol, atol=tol)
                np.testing.assert_allclose(got.conv_snapshots[row, i], want.conv_snapshots[0, last],
                                           rtol=tol, atol=tol)
    # committing one root path keeps that path's last node's states and nothing of its siblings
    last_node = jnp.full((b,), nodes - 1, jnp.int32)
    path = tt.root_path(t, last_node, depth + 1)
    count = t.depths[:, nodes - 1] + 1
    committed = tstate.gather_path(path, count)
    for layer in linear:
        np.testing.assert_array_equal(committed.layers[layer].matrix, tstate.layers[layer].matrix_snapshots[:, nodes - 1])
    np.testing.assert_array_equal(committed.lengths, base.lengths + count)


@pytest.mark.parametrize("nodes,depth,branching", [(8, 4, 2), pytest.param(12, 7, 3, marks=pytest.mark.slow)])
def test_block_drafter_hybrid_tree_greedy_equals_ar(target, ar_tokens, nodes, depth, branching):
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=8)
    drafter, dparams = dr.BlockDrafter(dcfg, CFG), dr.init(jax.random.key(1), dcfg, jnp.float32, 0.5)
    res = tree.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=nodes, depth=depth,
                        branching=branching)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])


@pytest.mark.slow  # over ~12 s on 2 cores; the default suite keeps its faster siblings
def test_hybrid_branching_finds_runner_up_drafts(target, ar_tokens, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8, shift=1, wrong_every=3, runner_up=2.0)
    chain = spec.generate(TARGET, target, drafter, reference, PROMPTS, N, block_size=8)
    branched = tree.generate(TARGET, target, drafter, reference, PROMPTS, N, nodes=16, depth=7, branching=2)
    np.testing.assert_array_equal(chain.tokens, ar_tokens[:, :N])
    np.testing.assert_array_equal(branched.tokens, ar_tokens[:, :N])
    assert branched.stats.tau > chain.stats.tau + 1.0


def test_a_tree_past_the_targets_snapshots_is_refused(target, reference):
    small = hybrid.target(CFG, jnp.float32, max_block_size=8)
    drafter = dr.ReplayDrafter(CFG.vocab_size, 8)
    with pytest.raises(ValueError, match="max_block_size 8"):
        tree.generate(small, target, drafter, reference, PROMPTS, N, nodes=12, depth=7, branching=2)


def test_tree_forcing_agrees_with_ar_steps(target, ar_tokens):
    """Forced AR output scored by tree forwards (the forced path inside a 12-node tree, per-node
    recurrent states, path commits) against AR steps, at every position."""
    report = forcing.force(forcing.chunked_scorer(target, TARGET, chunk=1),
                           forcing.tree_scorer(target, TARGET, 12, 5, 3), PROMPTS, ar_tokens[:, :N])
    assert report.passed, report.summary()
    assert report.num_positions == len(PROMPTS) * N
