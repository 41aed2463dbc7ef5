"""L2 prefetch (pallas_kernels/l2_prefetch.py): which bytes a plan prefetches (against a brute-force
enumeration), that it lowers to a Mosaic GPU kernel ordered by its barrier, that it changes no value, and
its errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import l2_prefetch as lp

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("shape,dtype,fraction,segments", [
    ((4096, 4096), jnp.bfloat16, 1.0, 1),  # a whole o projection
    ((4096, 6144), jnp.bfloat16, 0.25, 1),  # a prefix
    ((4096, 6144), jnp.bfloat16, 0.3, 96),  # the first 30% of each of 96 parts (not a whole box each)
    ((96 * 256, 192), jnp.int8, 0.125, 96),  # W12 tiles, a few rows per part
    ((3, 512), jnp.float32, 1.0, 1),  # fewer rows than a box
    ((24, 256), jnp.uint8, 0.5, 3),  # 8 rows per part, 4 wanted
])
def test_boxes_cover_exactly_the_wanted_rows(shape, dtype, fraction, segments):
    """The boxes' rows are, as a set, the first ceil(fraction * part) rows of each part, nothing outside."""
    a = jnp.zeros(shape, dtype)
    view, plan = lp._as_rows(a, fraction, segments)
    rows = a.size * a.dtype.itemsize // lp.ROW_BYTES
    assert view.shape == (rows, lp.ROW_BYTES // a.dtype.itemsize)
    box = plan[2]
    assert 1 <= box <= lp.BOX_ROWS
    covered = np.zeros(rows, bool)
    for start in lp.box_starts(plan, segments):
        assert 0 <= start and start + box <= rows
        covered[start:start + box] = True
    part = rows // segments
    want = np.zeros(rows, bool)
    for s in range(segments):
        want[s * part:s * part + int(np.ceil(part * fraction))] = True
    np.testing.assert_array_equal(covered, want)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="whole 256-byte rows"):
        lp._as_rows(jnp.zeros((3, 5), jnp.bfloat16), 1.0, 1)
    with pytest.raises(ValueError, match="fraction must be in"):
        lp._as_rows(jnp.zeros((256, 128), jnp.bfloat16), 0.0, 1)
    with pytest.raises(ValueError, match="segments 3 does not cut the 256 rows"):
        lp._as_rows(jnp.zeros((256, 128), jnp.bfloat16), 1.0, 3)


def test_off_the_gpu_it_is_the_reference():
    """On the CPU there is no L2 to fill: `prefetch_l2` returns `after` itself, as the reference does."""
    w, x = jnp.ones((1024, 1024), jnp.bfloat16), jnp.arange(8.0)
    assert lp.prefetch_l2(w, x) is x and lp.prefetch_l2_reference(w, x) is x
    assert lp.prefetch_l2({"small": jnp.ones((4, 4))}, x, platform="gpu") is x  # nothing worth prefetching


def test_small_leaves_are_left_out():
    from specpilot.formats import w12

    big, small = S((4096, 4096), jnp.bfloat16), S((4096,), jnp.int32)
    tw = w12.TwinNK(tiles=big, shape=(4096, 4096), block_k=64)
    assert lp._leaves(tw) == [big]
    assert lp._leaves({"w": big, "scale": small, "meta": 3}) == [big]


@pytest.mark.parametrize("fraction,segments", [(1.0, 1), (0.25, 64)])
def test_lowers_for_cuda_and_after_is_read_through_its_token(fraction, segments):
    """GPU-free: the prefetch lowers to one Mosaic GPU kernel that takes `after` and the weights, and the
    step goes on from `after` selected through the kernel's token (so XLA keeps the kernel and orders it)."""
    fn = jax.jit(lambda w, x: lp.prefetch_l2(w, x, fraction=fraction, segments=segments, platform="gpu") * 2)
    text = fn.trace({"planes": S((4096 * 24, 192), jnp.int8), "bf16": S((4096, 4096), jnp.bfloat16)},
                    S((1, 1, 4096), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 1 and "(%arg2," in calls[0]  # after (the last argument) is the kernel's first input
    token = calls[0].split("=")[0].strip()
    assert f"stablehlo.slice {token}" in text and "stablehlo.select" in text


@pytest.mark.gpu
def test_on_the_gpu_values_are_unchanged_and_the_kernel_kept():
    """On the GPU: `after` comes back bit for bit, a product after it equals the same step without the
    prefetch bit for bit, and the compiled step keeps the prefetch kernel (a kernel whose only output is
    a token is dead code to XLA: the first version's was removed)."""
    w = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.bfloat16)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 4096), jnp.bfloat16)
    ident = jax.jit(functools.partial(lp.prefetch_l2, fraction=0.5, segments=16))
    np.testing.assert_array_equal(np.asarray(ident(w, x)), np.asarray(x))

    def step(w, x, platform):  # platform "cpu": the same step with the prefetch left out
        return lp.prefetch_l2(w, jnp.tanh(x), platform=platform) @ w

    with_pf, without = (jax.jit(functools.partial(step, platform=p)) for p in ("gpu", "cpu"))
    np.testing.assert_array_equal(np.asarray(with_pf(w, x)), np.asarray(without(w, x)))
    assert "mosaic_gpu" in with_pf.lower(w, x).compile().as_text()
    assert "mosaic_gpu" not in without.lower(w, x).compile().as_text()
