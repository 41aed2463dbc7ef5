"""Pallas split-K GEMV against the XLA reference, in interpret mode on the CPU (kernel on GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv import GemvBlocks, check_blocks, default_blocks, gemv, gemv_partials, gemv_reference

ON_CPU = jax.devices()[0].platform == "cpu"


def _rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _inputs(seed, k, n, layout):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (1, k), jnp.bfloat16)
    w = (0.05 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
    return x, (w if layout == "kn" else w.T)


CASES = [
    (256, 512, None),
    (384, 128, None),  # K = 3 * 128: split_k must make K / split_k a power of two
    (256, 512, GemvBlocks(block_n=128, block_k=16, split_k=4)),
    (512, 256, GemvBlocks(block_n=64, block_k=64, split_k=2, num_warps=8, num_stages=2)),
]


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("k,n,blocks", CASES)
def test_gemv_matches_reference(layout, k, n, blocks):
    x, w = _inputs(k + n, k, n, layout)
    got = gemv(x, w, layout=layout, blocks=blocks, interpret=ON_CPU)
    # float64 reference on the same bf16 inputs; float32 accumulation lands far below 1e-5.
    want = np.asarray(x, np.float64) @ (np.asarray(w, np.float64) if layout == "kn"
                                        else np.asarray(w, np.float64).T)
    assert got.shape == (1, n) and got.dtype == jnp.float32
    assert _rel_err(got, want) < 1e-5


def test_partials_sum_to_result():
    x, w = _inputs(3, 256, 256, "kn")
    b = GemvBlocks(block_n=128, block_k=32, split_k=4)
    parts = gemv_partials(x, w, blocks=b, interpret=ON_CPU)
    assert parts.shape == (4, 256)
    ref = gemv_reference(x, w)
    assert _rel_err(parts.sum(0)[None], ref) < 1e-5


def test_m_above_one_falls_through_to_xla():
    kx, kw = jax.random.split(jax.random.PRNGKey(5))
    x = jax.random.normal(kx, (3, 128), jnp.bfloat16)
    w = jax.random.normal(kw, (128, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError):
        gemv_partials(x, w, interpret=ON_CPU)
    np.testing.assert_array_equal(gemv(x, w, interpret=ON_CPU), gemv_reference(x, w))


def test_default_blocks_tile_qwen3_8b_shapes():
    for k, n in [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]:
        for layout in ("kn", "nk"):
            b = default_blocks(k, n, layout)
            check_blocks(k, n, b)
            assert (n // b.block_n) * b.split_k >= 132 or b.split_k == k // b.block_k


def test_bad_blocks_raise():
    with pytest.raises(ValueError):
        check_blocks(256, 256, GemvBlocks(block_n=96))
    with pytest.raises(ValueError):
        check_blocks(384, 256, GemvBlocks(split_k=1))  # K / split_k = 384 is not a power of two
