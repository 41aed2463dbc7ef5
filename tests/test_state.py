"""Per-layer state: path gather and snapshot selection against numpy brute force; tree masks against
each root-to-node path run as its own chain; the state's dtype follows the target's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import state as st
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from helpers import random_params

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, tap_layers=(0,))
F32_TOL = 1e-5  # float32 logits of two programs summing the same terms in another order, relative to max


def _random_attention(rng, b, s, kvh=2, d=3):
    return st.AttentionState(jnp.asarray(rng.normal(size=(b, kvh, s, d)), jnp.float32),
                             jnp.asarray(rng.normal(size=(b, kvh, s, d)), jnp.float32))


def _random_recurrent(rng, b, t):
    r = st.init_recurrent_state(b, conv_width=4, conv_channels=5, num_heads=2, key_dim=3, value_dim=2,
                                max_snapshots=t, dtype=jnp.float32)
    conv = jnp.asarray(rng.normal(size=r.conv.shape), jnp.float32)
    matrix = jnp.asarray(rng.normal(size=r.matrix.shape), jnp.float32)
    r = st.RecurrentState(conv, matrix, r.conv_snapshots, r.matrix_snapshots)
    return r.write_snapshots(jnp.asarray(rng.normal(size=r.conv_snapshots.shape), jnp.float32),
                             jnp.asarray(rng.normal(size=r.matrix_snapshots.shape), jnp.float32))


def _gather_numpy(buf, lengths, path, count):
    """buf [B, S, ...]: row b's slots lengths[b] + path[b, i] (i < count[b]) copied to lengths[b] + i."""
    out = buf.copy()
    for b in range(buf.shape[0]):
        rows = [buf[b, lengths[b] + path[b, i]].copy() for i in range(count[b])]
        for i, row in enumerate(rows):
            out[b, lengths[b] + i] = row
    return out


def test_gather_path_moves_accepted_nodes_like_numpy():
    rng = np.random.default_rng(0)
    b, s = 4, 24
    lengths = np.array([3, 10, 0, 19])
    # Root-first paths through a tree of up to 8 nodes; row 2 accepts nothing, row 3 fills the end.
    path = np.array([[0, 2, 5, 6, 7], [0, 1, 3, 4, 0], [0, 0, 0, 0, 0], [0, 2, 3, 4, 4]], np.int32)
    count = np.array([4, 3, 0, 5], np.int32)
    layers = (_random_attention(rng, b, s), _random_recurrent(rng, b, 8), _random_attention(rng, b, s))
    state = st.TargetState(layers, jnp.asarray(lengths, jnp.int32))
    out = jax.jit(st.TargetState.gather_path)(state, jnp.asarray(path), jnp.asarray(count))
    np.testing.assert_array_equal(np.asarray(out.lengths), lengths + count)
    for i in (0, 2):
        for name in ("k", "v"):
            # the cache is [B, KVH, S, D]: gather along the slots of each head
            want = _gather_numpy(np.asarray(getattr(layers[i], name)).swapaxes(1, 2), lengths, path, count)
            np.testing.assert_array_equal(np.asarray(getattr(out.layers[i], name)), want.swapaxes(1, 2))
    rec, new = layers[1], out.layers[1]
    for row in range(b):  # the recurrent layer takes the snapshot of the path's last node
        node = path[row, count[row] - 1] if count[row] else None
        want_conv = rec.conv[row] if node is None else rec.conv_snapshots[row, node]
        want_matrix = rec.matrix[row] if node is None else rec.matrix_snapshots[row, node]
        np.testing.assert_array_equal(np.asarray(new.conv[row]), np.asarray(want_conv))
        np.testing.assert_array_equal(np.asarray(new.matrix[row]), np.asarray(want_matrix))
        np.testing.assert_array_equal(np.asarray(new.conv_snapshots), np.asarray(rec.conv_snapshots))


def test_select_snapshot_and_commit():
    rng = np.random.default_rng(1)
    b, t = 3, 4
    rec = _random_recurrent(rng, b, t)
    index = np.array([2, -1, 0])
    got = rec.select_snapshot(jnp.asarray(index))
    for row, i in enumerate(index):
        want = rec.conv[row] if i < 0 else rec.conv_snapshots[row, i]
        np.testing.assert_array_equal(np.asarray(got.conv[row]), np.asarray(want))
        want = rec.matrix[row] if i < 0 else rec.matrix_snapshots[row, i]
        np.testing.assert_array_equal(np.asarray(got.matrix[row]), np.asarray(want))
    # commit(n) = lengths + n and each recurrent layer's snapshot n - 1 (n = 0 keeps it)
    attn = _random_attention(rng, b, 16)
    state = st.TargetState((attn, rec), jnp.asarray([2, 5, 7], jnp.int32))
    n = np.array([3, 0, 1])
    committed = state.commit(jnp.asarray(n, jnp.int32))
    np.testing.assert_array_equal(np.asarray(committed.lengths), [5, 5, 8])
    np.testing.assert_array_equal(np.asarray(committed.layers[0].k), np.asarray(attn.k))
    expect = rec.select_snapshot(jnp.asarray(n - 1))
    np.testing.assert_array_equal(np.asarray(committed.layers[1].matrix), np.asarray(expect.matrix))
    # a chain is the path 0..n-1: gather_path and commit agree
    chain = state.gather_path(jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)), jnp.asarray(n))
    for a, c in zip(jax.tree.leaves(chain), jax.tree.leaves(committed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    with pytest.raises(ValueError, match="snapshots"):
        rec.write_snapshots(jnp.zeros((b, t + 1, 3, 5)), jnp.zeros((b, t + 1, 2, 3, 2)))


def test_state_dtype_is_never_a_silent_bf16():
    with pytest.raises(ValueError, match="dtype must be given"):
        dense.init_state(CFG, 1, 8)
    target = dense.target(CFG, jnp.float32)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(target.init_state(1, 8))
               if leaf.dtype != jnp.int32)


def test_float32_prefill_and_decode_equal_the_full_forward():
    """A float32 model decoded through a state built with the target's default dtype keeps float32
    precision: prefill + decode logits equal a full forward over the whole sequence."""
    params = random_params(dense.param_shapes(CFG), 0.3, 0)
    target = dense.target(CFG, params["embed"].dtype)
    seq = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
    want, _, _ = dense.chain_forward(params, CFG, jnp.asarray(seq), target.init_state(2, 16))
    logits, _, state = dense.prefill(params, CFG, jnp.asarray(seq[:, :6]), jnp.asarray([6, 6]),
                                     target.init_state(2, 16))
    got = [logits]
    for i in range(6, 12):
        logits, _, state = dense.decode_step(params, CFG, jnp.asarray(seq[:, i]), state)
        got.append(logits)
    got = np.stack([np.asarray(g) for g in got[:-1]], axis=1)  # logits at positions 5..10
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, np.asarray(want)[:, 5:11], rtol=0, atol=F32_TOL * scale)


def test_a_prompts_logits_at_its_last_token_alone_equal_the_full_heads():
    # a prefill keeps one position per row: the head reads just those rows (16 x 1,024 positions of a
    # 151,936-token vocabulary in float32 are 10 GB), the state as the full forward leaves it
    params = random_params(dense.param_shapes(CFG), 0.3, 0)
    target = dense.target(CFG, params["embed"].dtype)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (3, 9)).astype(np.int32))
    lengths = jnp.asarray([9, 4, 1], jnp.int32)
    fresh = target.init_state(3, 16)
    positions = st.chain_positions(fresh, 9)
    full, taps, full_state = target.forward(params, tokens, positions, fresh, st.prompt_mask(fresh, positions, lengths))
    full_state = full_state.commit(lengths)
    last, last_taps, state = st.prompt_forward(target, params, tokens, lengths, target.init_state(3, 16))
    assert last.shape == (3, CFG.vocab_size)
    want = np.asarray(full)[np.arange(3), np.asarray(lengths) - 1]
    np.testing.assert_allclose(np.asarray(last), want, rtol=0, atol=F32_TOL * float(np.abs(want).max()))
    assert np.array_equal(np.asarray(last_taps), np.asarray(taps))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(full_state)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_prefill_chunk_bounds_the_tokens_of_a_pass_and_fits_the_cache():
    assert st.prefill_chunk(1, 512, 768) == 512  # 512 tokens over the batch: one pass
    assert st.prefill_chunk(16, 1024, 1280) == 256  # 4,096 tokens a pass
    assert st.prefill_chunk(16, 1024, 1152) == 128  # a row done early writes a chunk past its prompt
    assert st.prefill_chunk(16, 1024, 1060) == 1024  # no room for one: one pass
    assert st.prefill_chunk(3, 1000, 2048, tokens_per_pass=200) == 64  # never under 64 tokens


def test_a_prefill_in_chunks_leaves_what_one_pass_leaves():
    """Three passes of 64 tokens a row against one pass (dense target, float32): the same last logits,
    taps at every prompt position and committed K/V, to the written tolerance; padding committed nowhere."""
    params = random_params(dense.param_shapes(CFG), 0.3, 0)
    target = dense.target(CFG, params["embed"].dtype)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, CFG.vocab_size, (3, 150)).astype(np.int32))
    lengths = np.array([150, 64, 3], np.int32)
    run = jax.jit(st.prompt_forward, static_argnums=(0, 5))
    one = run(target, params, tokens, jnp.asarray(lengths), target.init_state(3, 256), 10_000)
    chunked = run(target, params, tokens, jnp.asarray(lengths), target.init_state(3, 256), 64)
    (last1, taps1, state1), (last, taps, state) = one, chunked
    scale = float(np.abs(np.asarray(last1)).max())
    np.testing.assert_allclose(np.asarray(last), np.asarray(last1), rtol=0, atol=F32_TOL * scale)
    assert np.array_equal(np.asarray(state.lengths), lengths) and taps.shape == taps1.shape
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(taps[b, :n]), np.asarray(taps1[b, :n]), rtol=0,
                                   atol=F32_TOL * float(np.abs(np.asarray(taps1)).max()))
        for layer, layer1 in zip(state.layers, state1.layers):
            for kv, kv1 in ((layer.k, layer1.k), (layer.v, layer1.v)):
                np.testing.assert_allclose(np.asarray(kv[b, :, :n]), np.asarray(kv1[b, :, :n]), rtol=0,
                                           atol=F32_TOL * float(np.abs(np.asarray(kv1)).max()))


# A tree of 7 nodes after the committed prefix; node 0 is the last committed-side token (the root).
PARENTS = [-1, 0, 0, 1, 1, 2, 5]


def _ancestors(parents):
    t = len(parents)
    anc = np.zeros((t, t), bool)
    for j in range(t):
        k = j
        while k >= 0:
            anc[j, k] = True
            k = parents[k]
    return anc


def _path(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_tree_mask_forward_equals_each_path_as_a_chain():
    params = random_params(dense.param_shapes(CFG), 0.3, 3)
    target = dense.target(CFG, jnp.float32)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, CFG.vocab_size, 5), rng.integers(0, CFG.vocab_size, 9)]
    tokens = np.zeros((2, 9), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    _, _, base = dense.prefill(params, CFG, jnp.asarray(tokens), jnp.asarray([5, 9]),
                               target.init_state(2, 32))
    tree_tokens = rng.integers(0, CFG.vocab_size, (2, len(PARENTS))).astype(np.int32)
    depth = _ancestors(PARENTS).sum(1) - 1
    ancestors = jnp.asarray(np.broadcast_to(_ancestors(PARENTS), (2,) + (len(PARENTS),) * 2))
    positions = base.lengths[:, None] + jnp.asarray(depth, jnp.int32)[None, :]
    # jitted: one compile per program (and per path length) instead of one per op under eager dispatch
    chain_forward = jax.jit(lambda p, t, s: st.chain_forward(target, p, t, s))
    logits, _, tree_state = jax.jit(target.forward)(params, jnp.asarray(tree_tokens), positions, base,
                                                    st.tree_mask(base, ancestors))
    scale = float(jnp.abs(logits).max())
    for node in range(len(PARENTS)):
        path = _path(PARENTS, node)
        want, _, _ = chain_forward(params, jnp.asarray(tree_tokens[:, path]), base)
        np.testing.assert_allclose(np.asarray(logits[:, node]), np.asarray(want[:, -1]), rtol=0,
                                   atol=F32_TOL * scale, err_msg=f"node {node} (path {path})")
    # Accepting a path and gathering it gives the state a chain over that path commits.
    path = _path(PARENTS, 6)  # [0, 2, 5, 6]
    gathered = tree_state.gather_path(jnp.asarray([path, path], jnp.int32), jnp.asarray([4, 2]))
    _, _, chained = chain_forward(params, jnp.asarray(tree_tokens[:, path]), base)
    chained = chained.commit(jnp.asarray([4, 2]))
    np.testing.assert_array_equal(np.asarray(gathered.lengths), np.asarray(chained.lengths))
    for g, c in zip(gathered.layers, chained.layers):
        for row, n in enumerate(np.asarray(chained.lengths)):
            for name in ("k", "v"):
                want = np.asarray(getattr(c, name)[row, :, :n])  # [B, KVH, S, D]
                np.testing.assert_allclose(np.asarray(getattr(g, name)[row, :, :n]), want, rtol=0,
                                           atol=F32_TOL * np.abs(want).max())


def test_capacity_and_masks():
    with pytest.raises(st.CacheOverflowError, match="cache holds 8"):
        st.check_capacity(8, 9)
    state = dense.init_state(CFG, 2, 6, jnp.float32).with_lengths(jnp.asarray([1, 3]))
    positions = st.chain_positions(state, 2)
    np.testing.assert_array_equal(np.asarray(positions), [[1, 2], [3, 4]])
    mask = np.asarray(st.causal_mask(state, positions))
    np.testing.assert_array_equal(mask[1], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])
    anc = jnp.asarray([[[1, 0], [0, 1]], [[1, 0], [1, 1]]], bool)  # row 0: siblings; row 1: a chain
    tree = np.asarray(st.tree_mask(state, anc))
    np.testing.assert_array_equal(tree[0], [[1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(tree[1], mask[1])
