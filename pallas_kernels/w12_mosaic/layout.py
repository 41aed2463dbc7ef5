"""The Mosaic GPU W12 kernel's weight layouts, built once offline: `W12NK` (a W12 matrix) and `TwinNK` (a
bf16 matrix for the bf16 twin), and their exact inverses (`decode_nk`, `untile_twin`). Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.formats.w12 import W12, Bf16Matrix, placement

BN = 64  # W^T rows (W columns) per program: one warpgroup's wgmma M
MAX_SLOTS = 256  # a step's slot row is one TMA box (<= 256 elements): 1 count + up to 255 exceptions
SLOT_ALIGN = 32  # int32 entries per 128 bytes
XOR_STEP = 64  # the step whose tiles are stored in `chunk_order` (copied plain: a TMA box row <= 256 bytes)


@dataclasses.dataclass(frozen=True)
class W12NK(Bf16Matrix):
    """A W12 matrix in the Mosaic GPU kernel's layout (`to_nk`): its planes packed step by step in mma order,
    stored tile by tile (chunk-ordered at steps of 64), and each step's exceptions in a slot table."""

    packed: Any  # int8 [N / 64 * steps * 64, 3 slot_k]: per step [sm lower | sm upper | nibbles], tile by tile
    base7: Any  # int32 [N]: base << 7
    slots: Any  # int32 [steps * N / 64, P]: each step's exceptions (`exception_slots`)
    shape: tuple[int, int]  # static: (K, N)
    slot_k: int  # static: the step (half-rows of K) the planes and slots were built for

    @property
    def xor_chunks(self) -> bool:
        """Whether each tile's rows are stored in `chunk_order` (steps of 64)."""
        return self.slot_k == XOR_STEP


jax.tree_util.register_dataclass(W12NK, data_fields=["base7", "slots", "packed"], meta_fields=["shape", "slot_k"])


@dataclasses.dataclass(frozen=True)
class TwinNK(Bf16Matrix):
    """A bf16 matrix tiled once for the Mosaic kernel's bf16 twin (`tile_twin` of W^T at step block_k): the
    same products as the W12 kernel at that step, bit for bit. Not compressed (16 bits per weight)."""

    tiles: Any  # bf16 [N / 64 * (K / 2) / block_k * 64, 2 block_k]
    shape: tuple[int, int]  # static: (K, N)
    block_k: int  # static: the step it was tiled for


jax.tree_util.register_dataclass(TwinNK, data_fields=["tiles"], meta_fields=["shape", "block_k"])


def check_shape(k: int, n: int, block_k: int = 64):
    """Raise NotImplementedError if a [K, N] weight does not fit the kernel's tiles at this step."""
    if k % 2 or (k // 2) % block_k or n % BN:
        raise NotImplementedError(f"the Mosaic W12 kernel needs K/2 % {block_k} == 0 and N % {BN} == 0, "
                                  f"got a [{k}, {n}] weight")


def mma_order(width: int) -> np.ndarray:
    """The column order of a plane tile in "mma order": stored column s holds true column perm[s].

    The kernel loads a plane tile 4 bytes per thread in the 8 -> 16-bit upcast layout, where a thread of
    a warp holds, of each 16 columns, 4 consecutive ones: lane%4 = 0, 1, 2, 3 hold columns 0-3, 8-11,
    4-7, 12-15. wgmma's A registers give that thread columns 2 (lane%4) + {0, 1} and 8 + 2 (lane%4) + {0, 1}.
    Storing the columns so that a thread's 4 loaded bytes are those 4 columns (swap bits 1 and 3 of the
    column within each 16) lets the decode write its registers straight into the wgmma layout, without
    the warp shuffle of the layout change. The order is its own inverse."""
    s = np.arange(width)
    return (s & ~0b1010) | (((s >> 3) & 1) << 1) | (((s >> 1) & 1) << 3)


def unpermute_jnp(a: jax.Array) -> jax.Array:
    """[R, C] in mma order -> true order (the interpreter's path; swaps bits 1 and 3 of each column)."""
    r, c = a.shape
    return a.reshape(r, c // 16, 2, 2, 2, 2).transpose(0, 1, 4, 3, 2, 5).reshape(r, c)


def exception_slots(w: W12, block_k: int) -> np.ndarray | None:
    """Each kernel step's exceptions as one row of a dense int32 table that the pipeline streams with the
    planes, so the patch loop reads shared memory instead of chasing CSR pointers in global memory.

    Row `kb * (N / 64) + jb` holds the exceptions of W^T rows [64 jb, 64 jb + 64) and K rows
    [block_k kb, block_k (kb + 1)) of both K halves: entry 0 is their count, then one int32 each,
    `bits << 16 | half << 15 | n_local << 8 | k_local`, k_local the stored (mma-order) column. Rows are
    padded to a multiple of SLOT_ALIGN entries (128 bytes), about 0.125 bits per weight at block_k = 64.
    None if a step holds more than MAX_SLOTS - 1."""
    k, n = w.shape
    kh = k // 2
    if block_k > 256:  # k_local has 8 bits in an entry
        raise ValueError(f"exception slots take block_k <= 256, got {block_k}")
    if w.num_exceptions == 0:
        return np.zeros((n // BN * (kh // block_k), SLOT_ALIGN), np.int32)
    rows, cols = np.asarray(w.exc_row, np.int64), np.asarray(w.exc_col, np.int64)
    vals = np.asarray(w.exc_val).astype(np.int64)
    half = (rows >= kh).astype(np.int64)
    kr = rows - half * kh
    step = (kr // block_k) * (n // BN) + cols // BN  # step-major: a step's column blocks are adjacent
    n_steps = n // BN * (kh // block_k)
    counts = np.bincount(step, minlength=n_steps)
    if counts.max() >= MAX_SLOTS:
        return None
    width = -(-(int(counts.max()) + 1) // SLOT_ALIGN) * SLOT_ALIGN
    table = np.zeros((n_steps, width), np.int64)
    table[:, 0] = counts
    order = np.argsort(step, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(len(order)) - starts[step[order]] + 1
    k_local = mma_order(block_k)[kr % block_k]
    packed = (vals << 16) | (half << 15) | ((cols % BN) << 8) | k_local
    table[step[order], slot] = packed[order]
    return table.astype(np.uint32).view(np.int32)


def pack_planes(sm_t: jax.Array, nib_t: jax.Array, block_k: int) -> jax.Array:
    """[N, 3 K/2] int8: for each step kb of block_k half-rows, sm^T of the lower half's rows, sm^T of the
    upper half's rows and the nibble bytes, side by side, each tile's columns in `mma_order`."""
    n, k = sm_t.shape
    kh, steps = k // 2, k // 2 // block_k
    parts = [sm_t[:, :kh], sm_t[:, kh:], jax.lax.bitcast_convert_type(nib_t, jnp.int8)]
    parts = [p_.reshape(n, steps, block_k)[:, :, mma_order(block_k)] for p_ in parts]
    return jnp.stack(parts, axis=2).reshape(n, 3 * kh)


def tile_rows(a: jax.Array, block_k: int, width: int) -> jax.Array:
    """[N, steps * width] (a step's `width` columns side by side, step by step) -> [N / 64 * steps * 64,
    width]: the tiles of 64 rows and one step stored one after another, column block by column block.
    Tile (jb, kb) is rows [64 (jb * steps + kb), 64 (jb * steps + kb + 1))."""
    n, cols = a.shape
    steps = cols // width
    if n % BN or cols % width or width % block_k:
        raise ValueError(f"tile_rows takes N % {BN} == 0 and whole steps, got {a.shape} at width {width}")
    return a.reshape(n // BN, BN, steps, width).transpose(0, 2, 1, 3).reshape(n * steps, width)


def untile_rows(tiles: jax.Array, n: int) -> jax.Array:
    """The inverse of `tile_rows`: [N / 64 * steps * 64, width] -> [N, steps * width]."""
    rows, width = tiles.shape
    steps = rows // n
    return tiles.reshape(n // BN, steps, BN, width).transpose(0, 2, 1, 3).reshape(n, steps * width)


@functools.partial(jax.jit, static_argnames=("block_k",))
def tile_twin(w_t: jax.Array, block_k: int) -> jax.Array:
    """The twin's bf16 W^T [N, K] stored tile by tile: per step, the lower and upper tiles side by side
    ([64, 2 block_k], as W12's packed planes pair them), each step's tile contiguous. Jitted: one copy,
    compiled once per shape."""
    n, k = w_t.shape
    kh, steps = k // 2, k // 2 // block_k
    paired = jnp.stack([w_t[:, :kh].reshape(n, steps, block_k), w_t[:, kh:].reshape(n, steps, block_k)],
                       axis=2).reshape(n, k)
    return tile_rows(paired, block_k, 2 * block_k)


def untile_twin(w: TwinNK) -> jax.Array:
    """The bf16 [K, N] matrix a TwinNK holds (jax ops, traceable; exact)."""
    k, n = w.shape
    kh, steps = k // 2, k // 2 // w.block_k
    paired = untile_rows(w.tiles, n).reshape(n, steps, 2, w.block_k)
    w_t = jnp.concatenate([paired[:, :, 0].reshape(n, kh), paired[:, :, 1].reshape(n, kh)], axis=1)
    return w_t.T


def chunk_order(rows: int = BN, width: int = 3 * XOR_STEP) -> np.ndarray:
    """[rows, width] int: for each byte of a step's [64, 192] plane tile, the column it is stored at:
    within each 64-byte plane the 16-byte chunk c of row r moves to c ^ ((r // 2) % 4). The kernel's loads
    in the upcast layout read 4 bytes per lane from 8 rows and 4 chunks per warp; plain [64, 192] rows put
    rows r and r + 2 on the same banks (a 4-way conflict); stored this way every load of a warp hits 32
    distinct banks (tests check both claims against jax's layout). Its own inverse."""
    r = np.arange(rows)[:, None]
    c = np.arange(width)[None, :]
    return (c & ~63) | ((c & 63) ^ (16 * ((r >> 1) & 3)))


def xor_tile_chunks(tiles: jax.Array) -> jax.Array:
    """Tiled packed planes [T * 64, 192] with each tile's rows stored in `chunk_order` (and back: the
    order is its own inverse). Static slices and selects only, so the interpreted kernel runs it too."""
    rows, width = tiles.shape
    if rows % BN or width != 3 * XOR_STEP:
        raise ValueError(f"xor_tile_chunks takes tiled planes of steps of 64, [T * {BN}, 192], got {tiles.shape}")
    key = (jax.lax.broadcasted_iota(jnp.int32, tiles.shape, 0) >> 1) & 3  # the row's chunk XOR
    out = tiles
    for t in (1, 2, 3):  # the rows whose chunks c are stored at c ^ t
        moved = jnp.concatenate([tiles[:, 64 * p + 16 * (c ^ t):64 * p + 16 * (c ^ t) + 16]
                                 for p in range(3) for c in range(4)], axis=1)
        out = jnp.where(key == t, moved, out)
    return out


@functools.partial(jax.jit, static_argnames=("block_k",))
def packed_planes(sm: jax.Array, nib: jax.Array, block_k: int) -> jax.Array:
    """W12's planes (sm [K, N], nib [Kh, N]) -> the packed, tiled planes of W12NK in one jitted pass:
    `tile_rows(pack_planes(sm^T, nib^T))`, chunk-ordered (`xor_tile_chunks`) at steps of 64, as reshapes and
    transposes alone (the mma order swaps bits 1 and 3 of a column, the chunk order flips chunk bits where
    the row's key bits are set), so XLA makes it one copy."""
    k, n = sm.shape
    kh, steps = k // 2, k // 2 // block_k
    planes = jnp.stack([sm[:kh], sm[kh:], jax.lax.bitcast_convert_type(nib, jnp.int8)])  # [3, Kh, N]
    # [part, kb, column / 16, column bits 3, 2, 1, 0, jb, row in block] -> [jb, kb, row, part, column / 16,
    # bits 1, 2, 3, 0]: stored column bits (3, 2, 1, 0) hold the true column's (1, 2, 3, 0) (`mma_order`)
    planes = planes.reshape(3, steps, block_k // 16, 2, 2, 2, 2, n // BN, BN).transpose(7, 1, 8, 0, 2, 5, 4, 3, 6)
    packed = planes.reshape(n * steps, 3 * block_k)
    if block_k != XOR_STEP:
        return packed
    # `chunk_order`: row 8a + 4 t1 + 2 t0 + p stores chunk (c1, c0) of each plane at (c1 ^ t1, c0 ^ t0)
    x = packed.reshape(n * steps // 8, 2, 2, 2, 3, 2, 2, 16)
    t1 = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) == 1
    t0 = jax.lax.broadcasted_iota(jnp.int32, x.shape, 2) == 1
    x = jnp.where(t0, jnp.flip(x, axis=6), x)
    x = jnp.where(t1, jnp.flip(x, axis=5), x)
    return x.reshape(n * steps, 3 * block_k)


def to_nk(w: W12, block_k: int) -> W12NK:
    """W12 [K, N] -> W12NK at a step of `block_k` half-rows (offline, like encoding): planes transposed,
    packed, tiled (chunk-ordered at steps of 64) in one jitted pass on the planes' device, and the
    exceptions tabulated per step on the host (only the lists travel). Raises NotImplementedError where
    the kernel does not take the matrix: a shape its tiles do not fit, or a step of more than 255
    exceptions (no slot row holds them)."""
    k, n = w.shape
    check_shape(k, n, block_k)
    slots = exception_slots(w, block_k)
    if slots is None:
        raise NotImplementedError(f"a step of {block_k} half-rows of this [{k}, {n}] matrix holds more than "
                                  f"{MAX_SLOTS - 1} exceptions: the Mosaic kernel's slot table cannot list them")
    sm, nib, base = (a if isinstance(a, jax.Array) else jnp.asarray(a) for a in (w.sm, w.nib, w.base))
    return W12NK(packed=packed_planes(sm, nib, block_k), base7=_base7(base),
                 slots=jax.device_put(slots, placement(sm)), shape=(k, n), slot_k=block_k)


@jax.jit
def _base7(base: jax.Array) -> jax.Array:
    return base.astype(jnp.int32) << 7


def _decoded_planes(w: W12NK) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sm^T [N, K] int8, codes^T [N, K] int32, base [N] int32) of a W12NK in true order."""
    k, n = w.shape
    kh, block_k = k // 2, w.slot_k
    steps = kh // block_k
    packed = xor_tile_chunks(w.packed) if w.xor_chunks else w.packed
    parts = untile_rows(packed, n).reshape(n, steps, 3, block_k)[..., mma_order(block_k)]
    sm_t = jnp.concatenate([parts[:, :, 0].reshape(n, kh), parts[:, :, 1].reshape(n, kh)], axis=1)
    nib = parts[:, :, 2].reshape(n, kh).astype(jnp.int32) & 0xFF
    codes = jnp.concatenate([nib & 0xF, nib >> 4], axis=1)
    return sm_t, codes, w.base7 >> 7


def decode_nk(w: W12NK) -> jax.Array:
    """W12NK -> the bf16 [K, N] matrix it holds (jax ops, traceable; exact): the planes decoded as W12's
    `decode_jnp` does, then each slot-table entry written to its element."""
    k, n = w.shape
    kh, block_k = k // 2, w.slot_k
    sm_t, codes, base = _decoded_planes(w)
    bits = (sm_t.astype(jnp.int32) & 0x807F) | ((codes + base[:, None]) << 7)  # [N, K]
    table = w.slots  # [steps * N / 64, P]
    n_rows, width = table.shape
    r = jnp.arange(n_rows)[:, None]
    e = jnp.arange(1, width)[None, :]
    entry = table[:, 1:]
    valid = e <= table[:, :1]
    k_true = jnp.asarray(mma_order(block_k))[entry & 0xFF]
    col = (r % (n // BN)) * BN + ((entry >> 8) & (BN - 1))
    row = ((entry >> 15) & 1) * kh + (r // (n // BN)) * block_k + k_true
    row = jnp.where(valid, row, k)  # entries past a step's count are dropped
    bits = bits.at[col, row].set((entry >> 16) & 0xFFFF, mode="drop")
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16).T


def storage_bytes(w: W12NK) -> dict[str, int]:
    """Bytes the kernel reads per part: the packed planes, base << 7 as int32 and the slot table."""
    def nb(a):
        return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize

    planes, base, exc = nb(w.packed), nb(w.base7), nb(w.slots)
    return {"planes": planes, "base": base, "exc_ptr": 0, "exceptions": exc, "total": planes + base + exc}
