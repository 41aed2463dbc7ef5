"""Tree decoding on sharded targets (simulated CPU devices, tests/conftest.py): greedy output equals the
one-device AR output with the target's state sharded over data x tensor meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import sharding
from specpilot.decoding import ar, tree
from specpilot.models import dense, hybrid
from specpilot.models import drafter as dr
from helpers import random_params
from test_sharding import CFG, HYBRID, N, PROMPTS, _mesh


def test_sharded_dense_tree_equals_ar():
    params = random_params(dense.param_shapes(CFG), 0.5, 0)
    want = ar.generate(dense.target(CFG, jnp.float32), params, PROMPTS, N + 10).tokens
    mesh = _mesh(2, 2)
    target = dense.target(CFG, jnp.float32, mesh)
    reference = jnp.asarray(dr.replay_reference(PROMPTS, want.tolist()))
    replay = dr.ReplayDrafter(CFG.vocab_size, 8, shift=1, wrong_every=3, runner_up=2.0).with_mesh(mesh)
    res = tree.generate(target, sharding.shard_params(params, mesh), replay, reference, PROMPTS, N,
                        nodes=12, depth=5, branching=2)
    np.testing.assert_array_equal(res.tokens, want[:, :N])
    assert res.stats.tau > 2.0  # second siblings accepted: the path commit ran sharded


@pytest.mark.slow
def test_sharded_hybrid_tree_equals_one_device():
    params = hybrid.init_wide_margin(jax.random.key(0), HYBRID, dtype=jnp.float32)
    want = ar.generate(hybrid.target(HYBRID, jnp.float32), params, PROMPTS, N + 10).tokens
    mesh = _mesh(1, 2)
    target = hybrid.target(HYBRID, jnp.float32, mesh=mesh)
    reference = jnp.asarray(dr.replay_reference(PROMPTS, want.tolist()))
    replay = dr.ReplayDrafter(HYBRID.vocab_size, 8, shift=1, wrong_every=3, runner_up=2.0)
    res = tree.generate(target, sharding.shard_params(params, mesh), replay, reference, PROMPTS, N,
                        nodes=12, depth=5, branching=2)
    np.testing.assert_array_equal(res.tokens, want[:, :N])
    assert res.stats.tau > 2.0
