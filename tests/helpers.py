"""Helpers shared by tests (imported as a plain module: pytest puts tests/ on sys.path)."""

import jax
import jax.numpy as jnp
import numpy as np


def random_params(shapes, std, seed):
    """dense.init's distribution drawn with numpy: eager jax.random would cost seconds of compiles."""
    rng = np.random.default_rng(seed)

    def make(path, shape):
        x = np.ones(shape) if str(path[-1].key).endswith("norm") else std * rng.standard_normal(shape)
        return jnp.asarray(x, jnp.float32)

    return jax.tree_util.tree_map_with_path(
        make, shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
