"""W12 preparation's fast path equals its reference path bit for bit: the device encoder (`encode_device`,
exceptions listed from the blocks that hold them) against numpy's `encode`, and the jitted layout
(`layout.packed_planes`, in `to_nk`) against the composition it replaces (`pack_planes`, `tile_rows`,
`xor_tile_chunks`), on matrices with no exceptions, with trained-like ones and with many."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w12_mosaic import layout
from specpilot.formats import w12
from w12_helpers import adversarial_weights


def _weights(kind: str, k: int, n: int, seed: int) -> np.ndarray:
    """bf16 bits [K, N]: none (one exponent: no exceptions), normal (N(0, 0.02): about 1e-4), adversarial
    (2%, Inf and NaN payloads), dense (40% zeros and wild exponents: more than a slot row takes)."""
    rng = np.random.default_rng(seed)
    if kind == "none":
        sign = rng.integers(0, 2, (k, n)) << 15
        return (sign | (0x3F << 8) | rng.integers(0, 256, (k, n))).astype(np.uint16)
    if kind == "normal":
        return (rng.standard_normal((k, n)) * 0.02).astype(jnp.bfloat16).view(np.uint16)
    if kind == "adversarial":
        return adversarial_weights(k, n, seed, finite=False).view(np.uint16)
    body = (rng.standard_normal((k, n)) * 0.02).astype(jnp.bfloat16).view(np.uint16)
    wild = rng.integers(0, 65536, (k, n), dtype=np.uint16)
    return np.where(rng.random((k, n)) < 0.4, np.where(rng.random((k, n)) < 0.5, 0, wild), body).astype(np.uint16)


def _reference_packed(w: w12.W12, block_k: int) -> np.ndarray:
    """The packed planes as the step-by-step composition builds them (eager ops, no jit)."""
    sm_t, nib_t = jnp.asarray(w.sm).T, jnp.asarray(w.nib).T
    packed = layout.tile_rows(layout.pack_planes(sm_t, nib_t, block_k), block_k, 3 * block_k)
    return np.asarray(layout.xor_tile_chunks(packed) if block_k == layout.XOR_STEP else packed)


@pytest.mark.parametrize("k,n,block_k", [(256, 128, 64), (512, 192, 128), (1024, 64, 64), (256, 256, 128)])
def test_packed_planes_equal_the_step_by_step_layout(k, n, block_k):
    rng = np.random.default_rng(k + n + block_k)
    sm = rng.integers(-128, 128, (k, n), dtype=np.int8)
    nib = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
    ref = w12.W12(sm=sm, nib=nib, base=None, exc_ptr=None, exc_row=None, exc_col=None, exc_val=None, shape=(k, n))
    got = layout.packed_planes(jnp.asarray(sm), jnp.asarray(nib), block_k)
    np.testing.assert_array_equal(np.asarray(got), _reference_packed(ref, block_k))


@pytest.mark.parametrize("kind,k,n,block_k", [(kind, 512, 256, 64) for kind in ("none", "normal", "adversarial")]
                         + [("none", 256, 384, 128), ("normal", 1024, 384, 128)])  # 2% fills more than a row at 128
def test_fast_preparation_equals_the_reference_path(kind, k, n, block_k):
    """to_nk(encode_device(w)) == the reference path from numpy's encode, field by field."""
    bits = _weights(kind, k, n, seed=k + n)
    ref = w12.encode(bits.view(jnp.bfloat16))
    if kind == "none":
        assert ref.num_exceptions == 0
    elif kind == "adversarial":
        assert ref.num_exceptions > 0.01 * k * n
    fast = w12.encode_device(jnp.asarray(bits.view(jnp.bfloat16)))
    for f in w12.FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(fast, f)), getattr(ref, f), err_msg=f)
    nk = layout.to_nk(fast, block_k)
    assert all(isinstance(a, jax.Array) for a in (nk.packed, nk.base7, nk.slots))
    np.testing.assert_array_equal(np.asarray(nk.packed), _reference_packed(ref, block_k))
    np.testing.assert_array_equal(np.asarray(nk.base7), ref.base.astype(np.int32) << 7)
    np.testing.assert_array_equal(np.asarray(nk.slots), layout.exception_slots(ref, block_k))
    np.testing.assert_array_equal(np.asarray(layout.decode_nk(nk)).view(np.uint16), bits)


def test_many_exceptions_encode_exactly_and_are_refused_alike():
    """40% exceptions: the device encoder still lists every one in CSR order, and both paths refuse the
    Mosaic layout (a step holds more than a slot row takes)."""
    bits = _weights("dense", 256, 192, seed=3)
    ref = w12.encode(bits.view(jnp.bfloat16), group_n=64, group_k=16)
    fast = w12.encode_device(jnp.asarray(bits.view(jnp.bfloat16)), group_n=64, group_k=16)
    assert ref.num_exceptions > 0.3 * bits.size
    for f in w12.FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(fast, f)), getattr(ref, f), err_msg=f)
    for w in (ref, fast):
        with pytest.raises(NotImplementedError, match="more than 255"):
            layout.to_nk(w, 64)
