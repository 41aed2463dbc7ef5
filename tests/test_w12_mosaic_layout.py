"""The Mosaic GPU W12 kernel's weight layouts (`pallas_kernels.w12_mosaic.layout`): W12NK and TwinNK give back
every bit of their matrix (`decode_nk`, `untile_twin`), the slot table lists every exception once (against
the W12's CSR lists), the refusals are clear, and the two register orders hold the claims the kernel
rests on, checked against jax's own layout definitions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.w12_mosaic import layout
from specpilot.formats import w12
from w12_helpers import adversarial_weights


@pytest.mark.parametrize("block_k", [64, 128])
@pytest.mark.parametrize("weights", ["every_pattern", "adversarial", "no_exceptions"])
def test_nk_layout_gives_back_every_bit(weights, block_k):
    """`to_nk` then `decode_nk` (jnp, traceable) returns the matrix bit for bit: each of the 65,536 bf16
    patterns (spread two exponents per column, so few exceptions per step), 1-2% adversarial exceptions with
    Inf and NaN payloads, and a matrix without exceptions. Steps of 64 store chunk-ordered tiles, steps of
    128 plain ones: both are undone."""
    k, n = 512, 128
    if weights == "every_pattern":
        pats = np.arange(65536, dtype=np.uint32)
        order = np.argsort(((pats >> 7) & 0xFF) * 256 + (pats & 0xFF), kind="stable")
        rng = np.random.default_rng(1)
        bits = np.stack([rng.permutation(c) for c in pats[order].astype(np.uint16).reshape(n, k)]).T.copy()
    elif weights == "adversarial":  # 2% exceptions fill a step of 64 (164 of 255 slots); thinned for 128
        bits = adversarial_weights(k, n, seed=4, finite=False).view(np.uint16).copy()
        if block_k == 128:
            body = (np.random.default_rng(4).standard_normal((k, n)) * 0.02).astype(jnp.bfloat16).view(np.uint16)
            bits = np.where(np.random.default_rng(5).random((k, n)) < 0.5, bits, body)
    else:
        bits = np.full((k, n), 0x3F00, np.uint16)
    enc = jax.device_put(w12.encode(bits.view(jnp.bfloat16)))
    nk = layout.to_nk(enc, block_k)
    assert nk.slot_k == block_k and nk.xor_chunks == (block_k == 64)
    assert nk.packed.shape == (n * (k // 2 // block_k), 3 * block_k)
    back = jax.jit(layout.decode_nk)(nk)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint16), bits)


@pytest.mark.parametrize("block_k", [64, 128])
def test_twin_tiles_give_back_the_matrix(block_k):
    """`tile_twin` pairs each step's lower and upper K-half tiles side by side, tile by tile; `untile_twin`
    undoes it exactly, and the tile of step kb of column block jb holds those rows and columns."""
    k, n = 512, 128
    w = jnp.asarray(adversarial_weights(k, n, seed=6))
    tiles = layout.tile_twin(w.T, block_k)
    tw = layout.TwinNK(tiles=tiles, shape=(k, n), block_k=block_k)
    np.testing.assert_array_equal(np.asarray(layout.untile_twin(tw)).view(np.uint16), np.asarray(w).view(np.uint16))
    steps, kh = k // 2 // block_k, k // 2
    jb, kb = 1, steps - 1
    tile = np.asarray(tiles[64 * (jb * steps + kb):64 * (jb * steps + kb + 1)]).view(np.uint16)
    w_t = np.asarray(w).T.view(np.uint16)
    np.testing.assert_array_equal(tile[:, :block_k], w_t[64 * jb:64 * (jb + 1), kb * block_k:(kb + 1) * block_k])
    np.testing.assert_array_equal(tile[:, block_k:],
                                  w_t[64 * jb:64 * (jb + 1), kh + kb * block_k:kh + (kb + 1) * block_k])


def test_exception_slots_list_every_exception_once():
    """The slot table against the CSR lists it is built from: every exception in its step's row, once,
    with its bits and position (the column in mma order); counts match; a step over MAX_SLOTS - 1
    exceptions gives no table, and `to_nk` refuses such a matrix (NotImplementedError: it stays W12)."""
    k, n, bk = 512, 192, 64
    enc = w12.encode(adversarial_weights(k, n, seed=5))
    table = layout.exception_slots(enc, bk)
    assert table is not None and table.shape[1] % layout.SLOT_ALIGN == 0
    kh = k // 2
    perm = layout.mma_order(bk)
    got = set()
    for row_i, row in enumerate(table.astype(np.int64)):
        kb, jb = divmod(row_i, n // layout.BN)  # step-major rows
        for e in row[1:1 + row[0]] & 0xFFFFFFFF:
            half, n_loc, k_loc = (e >> 15) & 1, (e >> 8) & 0x3F, perm[e & 0xFF]
            got.add((int(kb * bk + k_loc + half * kh), int(jb * layout.BN + n_loc), int(e >> 16)))
        assert not (row[1 + row[0]:]).any()
    want = {(int(r), int(c), int(v)) for r, c, v in zip(enc.exc_row, enc.exc_col, np.asarray(enc.exc_val))}
    assert got == want and int(table[:, 0].sum()) == enc.num_exceptions
    bits = np.random.default_rng(0).integers(0, 1 << 16, (512, 64), dtype=np.uint16)  # mostly exceptions
    dense = w12.encode(bits.view(jnp.bfloat16))
    assert layout.exception_slots(dense, 128) is None
    with pytest.raises(NotImplementedError, match="more than 255 exceptions"):
        layout.to_nk(dense, 128)
    with pytest.raises(ValueError, match="block_k <= 256"):
        layout.exception_slots(enc, 512)


def test_shapes_the_tiles_do_not_fit_are_refused():
    enc = w12.encode(adversarial_weights(256, 96, seed=0))  # N % 64 != 0
    with pytest.raises(NotImplementedError, match="N % 64 == 0"):
        layout.to_nk(enc, 64)
    with pytest.raises(NotImplementedError, match="K/2 % 128 == 0"):
        layout.check_shape(384, 128, 128)


def test_storage_bytes_count_what_the_kernel_reads():
    """12 bits of planes per weight, base << 7 as int32 per column, and the slot table."""
    k, n = 256, 128
    nk = layout.to_nk(w12.encode(adversarial_weights(k, n, seed=3)), 64)
    b = layout.storage_bytes(nk)
    assert b["planes"] == 3 * k * n // 2 and b["base"] == 4 * n
    assert b["exceptions"] == nk.slots.size * 4 and b["total"] == b["planes"] + b["base"] + b["exceptions"]


def _layout_positions(layout, shape):
    """[warp, lane, *register index, vector element] -> the element's flat index in a `shape` array, computed
    from a Mosaic GPU TiledLayout's own tiling, warp and lane dimensions (as its `thread_idxs` does)."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    contig = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    strides = layout.tiling.tile_strides(tuple(contig))
    tiled = layout.tiled_tiling_shape
    tile_strides = strides[-len(tiled):]

    def offset(idx, dims):
        sizes = [d.times if isinstance(d, fa.Replicated) else tiled[d] for d in dims]
        out = 0
        for q, (d, size) in enumerate(zip(dims, sizes)):
            if not isinstance(d, fa.Replicated):
                out += (idx // int(np.prod(sizes[q + 1:])) % size) * tile_strides[d]
        return out

    regs = layout.registers_shape(shape)
    out = np.zeros((4, 32, *regs, layout.vector_length), np.int64)
    for warp in range(4):
        for lane in range(32):
            base = offset(warp, layout.warp_dims) + offset(lane, layout.lane_dims)
            for r in np.ndindex(regs):
                lin = base + sum(i * st for i, st in zip(r, strides))
                for v in range(layout.vector_length):
                    out[(warp, lane, *r, v)] = lin + v * tile_strides[layout.vector_dim]
    return out


def test_chunk_order_makes_the_upcast_loads_conflict_free():
    """Why planes are stored in `chunk_order`: a warp's 32-bit loads of a [64, 192] plane tile in the
    upcast layout (positions from jax's own layout definition) hit each shared-memory bank up to 4 times
    when the rows are stored plain (rows r and r + 2 share banks), and exactly once in `chunk_order`. The
    order keeps each byte in its row and 64-byte plane, is its own inverse, and `xor_tile_chunks` applies
    it to every tile."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    up = _layout_positions(fa.WGMMA_LAYOUT_UPCAST_2X, (64, 64))  # [warp, lane, *registers, byte]
    order = layout.chunk_order()

    def worst(stored_col):  # the most distinct 4-byte words one bank serves in one load of one warp
        out = 1
        for plane in range(3):
            for warp in range(4):
                for reg in np.ndindex(up.shape[2:-1]):
                    first = up[(warp, slice(None), *reg, 0)]  # each lane's first byte (its 4 are contiguous)
                    assert np.all(up[(warp, slice(None), *reg, 3)] == first + 3)
                    rows, cols = first // 64, first % 64 + 64 * plane
                    addr = rows * 192 + stored_col(rows, cols)
                    assert np.all(addr % 4 == 0)
                    words = np.unique(addr // 4)
                    out = max(out, int(np.bincount(words % 32).max()))
        return out

    assert worst(lambda r, c: c) == 4
    assert worst(lambda r, c: order[r, c]) == 1
    np.testing.assert_array_equal(order // 64, np.arange(192)[None, :] // 64 + 0 * order)  # same plane
    np.testing.assert_array_equal(np.sort(order, axis=1), np.tile(np.arange(192), (64, 1)))  # a permutation
    np.testing.assert_array_equal(np.take_along_axis(order, order, axis=1), np.tile(np.arange(192), (64, 1)))
    tiles = jnp.asarray(np.random.default_rng(0).integers(-128, 128, (128, 192)), jnp.int8)
    stored = np.asarray(layout.xor_tile_chunks(tiles))
    for r in range(128):
        np.testing.assert_array_equal(stored[r, order[r % 64]], np.asarray(tiles)[r])
    np.testing.assert_array_equal(np.asarray(layout.xor_tile_chunks(jnp.asarray(stored))), np.asarray(tiles))
    with pytest.raises(ValueError, match="xor_tile_chunks takes tiled planes"):
        layout.xor_tile_chunks(tiles[:, :128])


@pytest.mark.parametrize("width", [64, 128])
def test_mma_order_puts_each_loaded_element_in_its_wgmma_register(width):
    """The claim `ptx.ptx_decode` rests on, checked against jax's layout definitions: with planes in
    `mma_order`, element e of the upcast-layout register [.., g, .., h, ..] that a thread loads is, in true
    columns, element e % 2 of its WGMMA-layout register [.., 2g + e // 2, .., h, ..]; and the order is its
    own inverse."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    perm = layout.mma_order(width)
    np.testing.assert_array_equal(perm[perm], np.arange(width))
    up = _layout_positions(fa.WGMMA_LAYOUT_UPCAST_2X, (64, width))
    wg = _layout_positions(fa.WGMMA_LAYOUT, (64, width))
    assert sorted(up.ravel()) == sorted(wg.ravel()) == list(range(64 * width))
    true = up // width * width + perm[up % width]  # the true position of each loaded (stored) element
    for idx in np.ndindex(up.shape):
        warp, lane, *r, e = idx
        target = [0] * (wg.ndim - 3)
        target[1], target[4] = 2 * r[1] + e // 2, r[4]
        assert wg[(warp, lane, *target, e % 2)] == true[idx], idx
    x = np.arange(3 * width).reshape(3, width)
    np.testing.assert_array_equal(np.asarray(layout.unpermute_jnp(jnp.asarray(x[:, perm]))), x)
