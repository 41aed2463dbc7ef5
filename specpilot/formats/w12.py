"""W12: a lossless 12-bit storage format for bf16 weight matrices, encoded once offline.

A bf16 value is sign (1) | exponent (8) | mantissa (7). Trained weights use few exponents (all-MiniLM-L6-v2:
entropy ~2.6 bits, 16 consecutive exponents cover 99.99%), so W12 keeps sign and mantissa verbatim and
replaces the exponent by a 4-bit code relative to a per-column base:

    bf16 bits = (sign << 15) | ((base[n] + code) << 7) | mantissa          (code in 0..15)

Layout of a [K, N] matrix (`[in, out]`, as `specpilot.models` stores linear weights):
- `sm`   int8  [K, N]   sign << 7 | mantissa. int8 on purpose: sign extension to int32 puts the sign at
                        bit 15, so the kernel builds bf16 bits with one AND/OR, no shift.
- `nib`  uint8 [Kh, N]  Kh = ceil(K / 2); code[k] | code[Kh + k] << 4. Rows k and Kh + k share a byte, so
                        a [bk, BN] nibble tile expands to two [bk, BN] code tiles (AND, SHIFT) with no
                        interleaving shuffle; the kernel runs the two K halves side by side.
- `base` uint8 [N]      per output column: the start of the 16-exponent window covering most of that
                        column (one byte per column is ~0.002 bits/weight at K = 4096).
- exceptions            every value whose exponent falls outside its column's window (zeros, -0,
                        subnormals, Inf, NaN payloads, outliers): `exc_row`, `exc_col` (int32) and the full
                        bf16 bits `exc_val` (uint16). Their dense slots hold code 0, and the decoder
                        overwrites them. All 16 codes are real exponents (no escape code): listing positions
                        explicitly halves the exception rate of a 15-code window plus escape.
- `exc_ptr` int32 [n_cb * n_g + 1]  CSR offsets: exceptions are sorted by column block (`group_n`
                        columns), then by paired-row group (`group_k` rows of the Kh half-index k mod Kh),
                        so a kernel tile finds its exceptions with two scalar loads and patches only tiles
                        that have any. Kernel block sizes need not match the groups: positions are global
                        and a superset range is harmless.

Exactness holds for every bf16 bit pattern (tested over all 65,536): sign and mantissa are stored
verbatim; the exponent is either base + code or listed. Encoding runs once: `encode` (numpy) is the
reference, `encode_device` gives the same fields bit for bit with jitted ops on the weight's device
(`encode_params` uses it). Tensors are stored with safetensors (`save`/`load`), so loading is a memory
map.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WINDOW = 16  # exponents one 4-bit code reaches
DEFAULT_GROUP_N = 128  # CSR column block; 128 divides every Qwen3 / Llama dim incl. vocab 151936
DEFAULT_GROUP_K = 32  # CSR paired-row group: one default kernel tile of 2 x 32 x 128 weights
FIELDS = ("sm", "nib", "base", "exc_ptr", "exc_row", "exc_col", "exc_val")
LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")  # separate or fused layout


class _EncodedMatrix:
    """What W12 and W12NK share: a bf16 [K, N] matrix to the code that multiplies by it."""

    @property
    def num_exceptions(self) -> int:
        return int(self.exc_row.shape[0])

    @property
    def dtype(self):
        return jnp.bfloat16

    @property
    def ndim(self) -> int:
        return 2


@dataclasses.dataclass(frozen=True)
class W12(_EncodedMatrix):
    """A W12-encoded [K, N] matrix. Arrays are numpy (offline) or jax (device); a pytree either way."""

    sm: Any  # int8 [K, N]
    nib: Any  # uint8 [Kh, N]
    base: Any  # uint8 [N]
    exc_ptr: Any  # int32 [n_cb * n_g + 1]
    exc_row: Any  # int32 [E]
    exc_col: Any  # int32 [E]
    exc_val: Any  # uint16 [E]
    shape: tuple[int, int]  # static: (K, N)
    group_n: int = DEFAULT_GROUP_N
    group_k: int = DEFAULT_GROUP_K
    # static: how `linear` multiplies by it: "pallas" (the fused decode-matmul kernel, Pallas' Triton
    # backend on GPUs) or "xla" (decode to bf16, then XLA's dot: bit-identical to the bf16 model's dot)
    kernel: str = "pallas"

    @property
    def k_half(self) -> int:
        return (self.shape[0] + 1) // 2

    @property
    def n_groups_k(self) -> int:
        return -(-self.k_half // self.group_k)

    @property
    def n_groups_n(self) -> int:
        return -(-self.shape[1] // self.group_n)


jax.tree_util.register_dataclass(W12, data_fields=list(FIELDS), meta_fields=["shape", "group_n", "group_k", "kernel"])


@dataclasses.dataclass(frozen=True)
class W12NK(_EncodedMatrix):
    """A W12 matrix in the Mosaic GPU kernel's layout (`pallas_kernels.w12_mosaic.to_nk`): planes in
    N-major order, packed step by step by default, and each kernel step's exceptions in a slot table.
    `linear` multiplies by it with that kernel (`kernel="mosaic"` in `encode_params`)."""

    sm_t: Any  # int8 [N, K], or an empty placeholder when the planes are packed
    nib_t: Any  # uint8 [N, K // 2], likewise
    base7: Any  # int32 [N]: base << 7
    exc_ptr: Any  # the W12's exception lists (CSR), read only when a step overflows its slot row
    exc_row: Any
    exc_col: Any
    exc_val: Any
    slots: Any  # int32 [N / 64 * (K / 2) / slot_k, P]: each step's exceptions
    packed: Any  # int8 [N, 3 K / 2]: per step of slot_k rows, [sm lower | sm upper | nibbles] (or `tiled`)
    shape: tuple[int, int]  # static: (K, N)
    group_n: int  # static: the CSR cells
    group_k: int
    n_groups_k: int
    slot_k: int  # static: the step the slots were built for; 0 = no slots (the kernel reads the CSR)
    # static: the packed planes' columns are stored in the wgmma register order (`w12_mosaic.mma_order`)
    mma_order: bool = False
    # static: packed steps pair adjacent row blocks, not the K halves (`w12_mosaic.pack_planes`)
    adjacent: bool = False
    # static: the packed planes are stored tile by tile, each step's [64, 3 slot_k] tile contiguous
    # (`w12_mosaic.tile_rows`): packed is then [N * K / 2 / slot_k, 3 slot_k]
    tiled: bool = False
    # static: each tiled step's rows have their 16-byte chunks XOR-permuted within each 64-byte plane
    # (`w12_mosaic.chunk_order`), so that the kernel's own loads hit distinct shared-memory banks
    xor_chunks: bool = False

    @property
    def has_packed_planes(self) -> bool:
        """Whether the planes are packed (row by row or tile by tile); else `packed` is a 1-row placeholder
        and the separate `sm_t` / `nib_t` hold them."""
        return self.packed.shape[0] > 1


jax.tree_util.register_dataclass(W12NK, data_fields=["sm_t", "nib_t", "base7", "exc_ptr", "exc_row", "exc_col",
                                                     "exc_val", "slots", "packed"],
                                 meta_fields=["shape", "group_n", "group_k", "n_groups_k", "slot_k", "mma_order",
                                              "adjacent", "tiled", "xor_chunks"])
@dataclasses.dataclass(frozen=True)
class TwinNK:
    """A bf16 matrix tiled once for the Mosaic kernel's bf16 twin (`w12_mosaic.tile_twin` of W^T at the
    runs' twin step), so that the twin reads its tiles as W12NK's planes are read, without tiling them at
    every call. Not a compressed format: 16 bits per weight, the same products as the twin of the bf16
    matrix (`linear(..., dense_kernel=True, implementation="mosaic")`), bit for bit. Made by
    `twin_params`; a bf16 baseline with the W12 kernel's structure."""

    tiles: Any  # bf16 [N / 64 * (K / 2) / block_k * 64, 2 block_k]
    shape: tuple[int, int]  # static: (K, N)
    block_k: int  # static: the step it was tiled for
    adjacent: bool = False  # static: steps pair adjacent row blocks (`w12_mosaic.ADJACENT`)


jax.tree_util.register_dataclass(TwinNK, data_fields=["tiles"], meta_fields=["shape", "block_k", "adjacent"])
ENCODED = (W12, W12NK, TwinNK)  # the weight types `linear` multiplies by a kernel of their own


def bf16_bits(w) -> np.ndarray:
    """uint16 bit patterns of a bf16 array (numpy, jax, or already uint16)."""
    a = np.asarray(w)
    if a.dtype == np.uint16:
        return a
    if a.dtype != jnp.bfloat16:
        raise TypeError(f"W12 encodes bf16 weights only (lossless for bf16), got {a.dtype}")
    return a.view(np.uint16)


def _best_bases(e: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """Per column of exponents e [K, N], the base b in 0..240 whose window [b, b + 15] holds most values."""
    _, n = e.shape
    out = np.empty(n, np.uint8)
    for c0 in range(0, n, chunk):
        blk = e[:, c0:c0 + chunk].astype(np.int64)
        nc = blk.shape[1]
        counts = np.bincount((blk + 256 * np.arange(nc)[None, :]).ravel(), minlength=256 * nc)
        cs = np.zeros((nc, 257), np.int64)
        np.cumsum(counts.reshape(nc, 256), axis=1, out=cs[:, 1:])
        win = cs[:, WINDOW:] - cs[:, :257 - WINDOW]  # [nc, 241]: values in [b, b + 15]
        out[c0:c0 + nc] = np.argmax(win, axis=1)
    return out


def encode(w, group_n: int = DEFAULT_GROUP_N, group_k: int = DEFAULT_GROUP_K) -> W12:
    """bf16 [K, N] (or [N], taken as one row) -> W12 with numpy arrays. Exact for every bit pattern."""
    bits = bf16_bits(w)
    if bits.ndim == 1:
        bits = bits[None, :]
    if bits.ndim != 2 or bits.size == 0:
        raise ValueError(f"W12 encodes non-empty 1-D or 2-D arrays, got shape {bits.shape}")
    k, n = bits.shape
    kh = (k + 1) // 2
    e = ((bits >> 7) & 0xFF).astype(np.int16)
    base = _best_bases(e)
    code = e - base[None, :].astype(np.int16)
    exc = (code < 0) | (code >= WINDOW)
    code = np.where(exc, 0, code).astype(np.uint8)
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8).view(np.int8)
    lo, hi = code[:kh], np.zeros((kh, n), np.uint8)
    hi[:k - kh] = code[kh:]
    nib = lo | (hi << 4)

    rows, cols = np.nonzero(exc)
    ptr, rows, cols, vals = _csr(rows, cols, bits[rows, cols], k, n, group_n, group_k)
    return W12(sm=sm, nib=nib, base=base, exc_ptr=ptr, exc_row=rows, exc_col=cols, exc_val=vals, shape=(k, n),
               group_n=group_n, group_k=group_k)


def _csr(rows, cols, vals, k: int, n: int, group_n: int, group_k: int):
    """Exceptions (any order) -> (CSR offsets int32, rows int32, cols int32, bits uint16), sorted by CSR
    cell (column block, then paired-row group), then row-major inside a cell."""
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    kh = (k + 1) // 2
    n_cb, n_g = -(-n // group_n), -(-kh // group_k)
    key = (cols // group_n) * n_g + (rows % kh) // group_k
    order = np.lexsort((cols, rows, key))
    ptr = np.zeros(n_cb * n_g + 1, np.int64)
    np.cumsum(np.bincount(key, minlength=n_cb * n_g), out=ptr[1:])
    return (ptr.astype(np.int32), rows[order].astype(np.int32), cols[order].astype(np.int32),
            np.asarray(vals)[order].astype(np.uint16))


# ---- device encoder: same fields as `encode`, dense work on the device -------------------------------

def _device_bits(w) -> jax.Array:
    a = w if isinstance(w, jax.Array) else jnp.asarray(w)
    if a.dtype == jnp.bfloat16:
        a = jax.lax.bitcast_convert_type(a, jnp.uint16)
    elif a.dtype != jnp.uint16:
        raise TypeError(f"W12 encodes bf16 weights only (lossless for bf16), got {a.dtype}")
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"W12 encodes non-empty 1-D or 2-D arrays, got shape {a.shape}")
    return a


def _exceptions_mask(e: jax.Array, base: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(code [K, N] int32 with exceptions set to 0, exception mask [K, N]) for exponents e and bases."""
    code = e - base.astype(jnp.int32)[None, :]
    exc = (code < 0) | (code >= WINDOW)
    return jnp.where(exc, 0, code), exc


def _exponents(bits: jax.Array) -> jax.Array:
    return (bits.astype(jnp.int32) >> 7) & 0xFF


@jax.jit
def _device_planes(bits: jax.Array):
    """uint16 [K, N] -> (sm int8 [K, N], nib uint8 [Kh, N], base uint8 [N], exception count int32 [])."""
    k, n = bits.shape
    kh = (k + 1) // 2
    e = _exponents(bits)
    # Per-column exponent histogram: one scatter-add over col * 256 + exponent (N * 256 int32 bins).
    slot = e + 256 * jnp.arange(n, dtype=jnp.int32)[None, :]
    counts = jnp.zeros(n * 256, jnp.int32).at[slot.reshape(-1)].add(1).reshape(n, 256)
    cs = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), jnp.cumsum(counts, axis=1)], axis=1)  # [N, 257]
    win = cs[:, WINDOW:] - cs[:, :257 - WINDOW]  # [N, 241]: values in [b, b + 15]
    base = jnp.argmax(win, axis=1).astype(jnp.uint8)  # first maximum, as np.argmax
    code, exc = _exceptions_mask(e, base)
    b32 = bits.astype(jnp.int32)
    sm = jax.lax.bitcast_convert_type((((b32 >> 8) & 0x80) | (b32 & 0x7F)).astype(jnp.uint8), jnp.int8)
    hi = jnp.pad(code[kh:], ((0, 2 * kh - k), (0, 0)))
    nib = (code[:kh] | (hi << 4)).astype(jnp.uint8)
    return sm, nib, base, jnp.sum(exc, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("size",))
def _device_exceptions(bits: jax.Array, base: jax.Array, size: int):
    """The exceptions in row-major order (np.nonzero's): (per-row counts int32 [K], columns int32 [size],
    bf16 bits uint16 [size]); slots past the count are 0. Each exception scatters to its rank (row offset
    + rank in its row); every other entry gets the out-of-range slot `size` and is dropped, so no index
    exceeds the exception count, whatever K * N."""
    _, n = bits.shape
    _, exc = _exceptions_mask(_exponents(bits), base)
    exc32 = exc.astype(jnp.int32)
    in_row = jnp.cumsum(exc32, axis=1)  # [K, N] inclusive rank inside the row
    row_cnt = in_row[:, -1]
    row_off = jnp.cumsum(row_cnt) - row_cnt  # exclusive
    slot = jnp.where(exc, row_off[:, None] + in_row - 1, size).reshape(-1)
    cols = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], bits.shape).reshape(-1)
    out_col = jnp.zeros(size, jnp.int32).at[slot].set(cols, mode="drop")
    out_val = jnp.zeros(size, jnp.uint16).at[slot].set(bits.reshape(-1), mode="drop")
    return row_cnt, out_col, out_val


def encode_device(w, group_n: int = DEFAULT_GROUP_N, group_k: int = DEFAULT_GROUP_K) -> W12:
    """`encode` on the weight's device: bf16 [K, N] (or [N], one row) jax array -> W12 with jax arrays on
    that device, equal to `encode(w)` field by field.

    The dense planes, the per-column bases (same window counts and first-maximum tie-break) and the
    exception count come from one jitted call; a second one lists the exceptions (about 1e-4 of trained
    weights) in row-major order, and only those come to the host, where the CSR order and offsets are
    built with numpy exactly as `encode` builds them. Device memory beyond the planes is a few int32
    [K, N] temporaries and N * 256 int32 histogram bins; no 64-bit types (x64 may stay off)."""
    bits = _device_bits(w)
    k, n = bits.shape
    if n * 256 >= 2**31:
        raise ValueError(f"N = {n} columns overflow the int32 histogram index")
    devices = bits.devices()
    device = next(iter(devices)) if len(devices) == 1 else None
    sm, nib, base, count = _device_planes(bits)
    count = int(count)
    if count:
        size = max(256, 1 << (count - 1).bit_length())  # power-of-two buckets: few distinct compiles
        row_cnt, cols, vals = jax.device_get(_device_exceptions(bits, base, size))
        rows = np.repeat(np.arange(k, dtype=np.int64), row_cnt)
        cols, vals = cols[:count].astype(np.int64), vals[:count]
    else:
        rows = cols = np.zeros(0, np.int64)
        vals = np.zeros(0, np.uint16)
    small = jax.device_put(_csr(rows, cols, vals, k, n, group_n, group_k), device)
    return W12(sm=sm, nib=nib, base=base, exc_ptr=small[0], exc_row=small[1], exc_col=small[2],
               exc_val=small[3], shape=(k, n), group_n=group_n, group_k=group_k)


def decode_bits(w: W12) -> np.ndarray:
    """W12 -> uint16 bf16 bit patterns [K, N] (numpy; the exact inverse of `encode`)."""
    k, _ = w.shape
    nib = np.asarray(w.nib)
    code = np.concatenate([nib & 0xF, nib >> 4], axis=0)[:k].astype(np.uint16)
    sm = np.asarray(w.sm).view(np.uint8).astype(np.uint16)
    e = code + np.asarray(w.base).astype(np.uint16)[None, :]
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    bits[np.asarray(w.exc_row), np.asarray(w.exc_col)] = np.asarray(w.exc_val)
    return bits


def decode(w: W12) -> np.ndarray:
    """W12 -> bf16 numpy array [K, N]."""
    return decode_bits(w).view(jnp.bfloat16)


def decode_jnp(w: W12) -> jax.Array:
    """W12 -> bf16 [K, N] with jax ops (traceable): the reference decode and the XLA fallback path."""
    k, _ = w.shape
    nib = w.nib.astype(jnp.int32)
    code = jnp.concatenate([nib & 0xF, nib >> 4], axis=0)[:k]
    bits = (w.sm.astype(jnp.int32) & 0x807F) | ((code + w.base.astype(jnp.int32)[None, :]) << 7)
    # a sentinel row of -1 (kernel operands of a matrix without exceptions) is dropped, not wrapped around
    rows = jnp.where(w.exc_row < 0, k, w.exc_row)
    bits = bits.at[rows, w.exc_col].set(w.exc_val.astype(jnp.int32), mode="drop")
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _nbytes(a) -> int:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def storage_bytes(w: W12 | W12NK) -> dict[str, int]:
    """Bytes per part: the dense planes, per-column bases, CSR offsets and exception lists. For W12NK,
    what its kernel reads: the packed (or separate) planes, base << 7 as int32, and the slot table, or
    the CSR lists when there is none."""
    if isinstance(w, W12NK):
        planes = _nbytes(w.packed) if w.has_packed_planes else _nbytes(w.sm_t) + _nbytes(w.nib_t)
        ptr = 0 if w.slot_k else _nbytes(w.exc_ptr)
        exc = _nbytes(w.slots) if w.slot_k else _nbytes(w.exc_row) + _nbytes(w.exc_col) + _nbytes(w.exc_val)
        base = _nbytes(w.base7)
        return {"planes": planes, "base": base, "exc_ptr": ptr, "exceptions": exc,
                "total": planes + base + ptr + exc}
    nb = {f: _nbytes(getattr(w, f)) for f in FIELDS}
    return {"planes": nb["sm"] + nb["nib"], "base": nb["base"], "exc_ptr": nb["exc_ptr"],
            "exceptions": nb["exc_row"] + nb["exc_col"] + nb["exc_val"], "total": sum(nb.values())}


def stats(w: W12) -> dict[str, float]:
    """Bits per weight (everything stored, exceptions and metadata included) and the exception rate."""
    numel = w.shape[0] * w.shape[1]
    b = storage_bytes(w)
    return {"numel": numel, "exceptions": w.num_exceptions, "exception_rate": w.num_exceptions / numel,
            "bits_per_weight": 8 * b["total"] / numel,
            **{f"bits_{part}": 8 * v / numel for part, v in b.items() if part != "total"}}


# ---- safetensors I/O: one file holds any mix of W12 and plain tensors --------------------------------

def save(path: str, tensors: dict[str, Any]) -> None:
    """Write {name: W12 | array} to a safetensors file; W12 fields become `name.w12.<field>` tensors and
    their static fields go to the header metadata."""
    from safetensors.numpy import save_file

    flat, meta = {}, {}
    for name, t in tensors.items():
        if isinstance(t, W12):
            for f in FIELDS:
                flat[f"{name}.w12.{f}"] = np.ascontiguousarray(np.asarray(getattr(t, f)))
            meta[name] = {"shape": list(t.shape), "group_n": t.group_n, "group_k": t.group_k}
        else:
            flat[name] = np.ascontiguousarray(np.asarray(t))
    save_file(flat, path, metadata={"w12": json.dumps(meta)})


def load(path: str) -> dict[str, Any]:
    """Inverse of `save` (numpy arrays; `jax.device_put` the result to move it)."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    with safe_open(path, "np") as f:
        meta = json.loads((f.metadata() or {}).get("w12", "{}"))
    flat = load_file(path)
    out = {k: v for k, v in flat.items() if ".w12." not in k}
    for name, m in meta.items():
        out[name] = W12(**{f: flat[f"{name}.w12.{f}"] for f in FIELDS}, shape=tuple(m["shape"]),
                        group_n=m["group_n"], group_k=m["group_k"])
    return out


# ---- model integration ----------------------------------------------------------------------------

KERNELS = ("pallas", "xla", "mosaic")


def encode_params(params: dict, names: tuple[str, ...] = LINEAR_NAMES, lm_head: bool = True,
                  max_exception_rate: float = 0.01, kernel: str = "pallas", extra: tuple[str, ...] = (),
                  rows: int = 1, **kw) -> dict:
    """Dense-model params with the named per-layer linear weights (and `lm_head`, and the top-level
    matrices named in `extra`, e.g. a drafter's `fc`) replaced by W12 on the device, multiplied by
    `kernel` (see `W12.kernel`). A matrix whose exception rate exceeds
    `max_exception_rate` stays bf16: its patch work would sit on the kernel's hot path and its storage
    would approach 16 bits. `rows`: the most rows a decoding step multiplies per call (batch x
    verification block); the Mosaic kernel's step is chosen for it (`w12_mosaic.default_block_k`)."""
    if kernel not in KERNELS:
        raise ValueError(f"W12 kernel must be one of {KERNELS}, got {kernel!r}")

    def enc(x):
        w = encode_device(x, **kw)
        if w.num_exceptions > max_exception_rate * x.size:
            return x
        if kernel == "mosaic":  # the Mosaic GPU kernel's own layout (imported on use: it imports this module)
            from pallas_kernels import w12_mosaic

            step = w12_mosaic.run_block_k(*x.shape, rows)
            w12_mosaic.check_shape(*x.shape, step)
            nk = w12_mosaic.to_nk(w, step, mma=w12_mosaic.default_mma(*x.shape, rows),
                                  adjacent=w12_mosaic.ADJACENT, tiled=w12_mosaic.TILED,
                                  xor_chunks=w12_mosaic.run_xor_chunks(step))
            if nk.adjacent != w12_mosaic.ADJACENT:  # a step overflows its slot row: keep bf16, so that every
                return x  # matrix of a run pairs its rows as the runs' twin does (`_mosaic_rows`)
            if w12_mosaic.WIDE_SWIZZLE and step == 128 and not w12_mosaic.run_w12_options(nk)["wide_swizzle"]:
                return x  # likewise: unpacked planes (a step over 255 exceptions) cannot take the twin's pairing
            return nk
        return dataclasses.replace(w, kernel=kernel)

    return _map_matrices(enc, params, names, lm_head, extra)


def _map_matrices(fn, params: dict, names: tuple[str, ...], lm_head: bool, extra: tuple[str, ...]) -> dict:
    """Params with `fn` applied to the named per-layer matrices, `lm_head` (if asked) and the top-level
    matrices named in `extra`; everything else as it is."""
    out = dict(params)
    out["layers"] = tuple({k: fn(v) if k in names else v for k, v in layer.items()} for layer in params["layers"])
    if lm_head and "lm_head" in params:
        out["lm_head"] = fn(params["lm_head"])
    for name in extra:
        if name in params:
            out[name] = fn(params[name])
    return out


def twin_params(params: dict, names: tuple[str, ...] = LINEAR_NAMES, lm_head: bool = True,
                extra: tuple[str, ...] = (), keep_untileable: bool = False) -> dict:
    """Dense-model params with the matrices `encode_params(kernel="mosaic")` would encode (the named per-layer
    linear weights, `lm_head`, `extra`) tiled once for the Mosaic kernel's bf16 twin (`TwinNK`): the twin
    path of a run without the per-call tiling of its bf16 weights. Shapes the kernel does not take raise, as
    they do for W12. Every matrix is tiled, so a run pairs bit for bit with the W12 run of the same weights
    when that one kept none bf16."""
    from pallas_kernels import w12_mosaic  # imported on use: it imports this module

    def tile(x):
        k, n = x.shape
        steps = w12_mosaic.run_twin_steps(k, n)
        try:
            w12_mosaic.check_shape(k, n, steps["block_k"])
        except NotImplementedError:
            if keep_untileable:  # the caller falls through to XLA's dot for this matrix
                return x
            raise
        if not w12_mosaic.TILED:
            raise NotImplementedError("twin_params tiles the twin's weights: w12_mosaic.TILED must be on")
        tiles = w12_mosaic.tile_twin(jnp.asarray(x, jnp.bfloat16).T, steps["block_k"], w12_mosaic.ADJACENT)
        return TwinNK(tiles=tiles, shape=(k, n), block_k=steps["block_k"], adjacent=w12_mosaic.ADJACENT)

    return _map_matrices(tile, params, names, lm_head, extra)


def linear(x: jax.Array, w, b: jax.Array | None = None, *, out_dtype=None, implementation: str | None = None,
           interpret: bool | None = None, dense_kernel: bool = False) -> jax.Array:
    """Drop-in for `layers.linear`: x [..., K] @ w [K, N], float32 accumulation, result in `out_dtype`
    (default x's dtype). W12 weights go through `implementation` (default: the weight's own `kernel`):
    the fused decode-matmul kernel, or decode + XLA dot; bf16 arrays through
    XLA's dot, or through the kernel's bf16 twin with `dense_kernel=True` (same tiling and order, so its
    outputs equal the W12 path bit for bit)."""
    # imported on use: the kernel module imports this one
    from pallas_kernels import w12_matmul as kern

    if isinstance(w, (W12NK, TwinNK)):
        y = _mosaic_rows(x, w, interpret=interpret)
    elif isinstance(w, W12):
        y = kern.w12_matmul(x, w, implementation=implementation or w.kernel, interpret=interpret)
    elif dense_kernel and implementation == "mosaic":
        y = _mosaic_rows(x, w, interpret=interpret)
    elif dense_kernel:
        y = kern.bf16_matmul(x, w, implementation=implementation or "pallas", interpret=interpret)
    else:
        y = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


def _mosaic_rows(x: jax.Array, w, interpret: bool | None = None) -> jax.Array:
    """x [..., K] @ w through the Mosaic GPU kernel (W12NK) or its bf16 twin (a bf16 [K, N] array, read
    transposed), 64 rows per call (the kernel's largest M; more rows loop over blocks of 64, or, with
    `w12_mosaic.PREFILL_DECODE`, are multiplied by XLA's dot of the decoded matrix): float32 [..., N]. The W12
    path and the twin take the same route, so they agree bit for bit at any number of rows."""
    from pallas_kernels import w12_mosaic

    if interpret is None:
        interpret = jax.devices()[0].platform == "cpu"
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x {x.shape} does not match a [{k}, {n}] weight")
    rows = x.reshape(-1, k).astype(jnp.bfloat16)
    if rows.shape[0] > max(w12_mosaic.MP_CHOICES) and w12_mosaic.PREFILL_DECODE:
        return _decoded_rows(rows, w).reshape(*x.shape[:-1], n)
    if isinstance(w, W12NK):
        w = w12_mosaic.run_operands(w)
    y = _mosaic_rows_2d(rows, w, interpret=bool(interpret), knobs=w12_mosaic.knobs())
    if w12_mosaic.SUM_BARRIER:  # the summed product materialized: XLA does not recompute the sum in consumers
        y = jax.lax.optimization_barrier(y)
    return y.reshape(*x.shape[:-1], n)


def _decoded_rows(rows: jax.Array, w) -> jax.Array:
    """rows [M, K] bf16 @ w by XLA's dot (`w12_mosaic.PREFILL_DECODE`): a W12NK decoded to its bf16 matrix
    first (exact), materialized so that the dot is the same as the twin's, which multiplies its bf16 weight
    as it is: the two agree bit for bit. float32 [M, N]."""
    from pallas_kernels import w12_mosaic

    if isinstance(w, TwinNK):
        raise NotImplementedError("w12_mosaic.PREFILL_DECODE takes W12NK or bf16 weights, not a TwinNK")
    if isinstance(w, W12NK):
        w = jax.lax.optimization_barrier(decode_jnp(w12_mosaic.unpack_nk(w)))
    return jnp.einsum("mk,kn->mn", rows, jnp.asarray(w), preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("interpret", "knobs"))
def _mosaic_rows_2d(rows: jax.Array, w, *, interpret: bool, knobs: tuple) -> jax.Array:
    """`_mosaic_rows` on rows [M, K] bf16. Jitted so that a model's products of one shape are traced and
    lowered once, not once per layer (a Qwen3-8B step has 145 of them); `knobs` (the kernel module's
    switches, which the trace reads) is part of the cache key, so a changed switch traces anew."""
    from pallas_kernels import w12_mosaic

    del knobs
    k, n = w.shape
    step = max(w12_mosaic.MP_CHOICES)
    if isinstance(w, W12NK):
        def call(r):  # the splits are added before the transpose (`w12_mosaic.sum_rows`)
            return w12_mosaic.sum_rows(w12_mosaic.w12_mosaic_partials(
                r, w, interpret=interpret, raw=True, **w12_mosaic.run_w12_options(w),
                **w12_mosaic.run_options(w.adjacent)), len(r), w12_mosaic.OUT_ROWS)
    else:
        adjacent, tiled = w12_mosaic.ADJACENT, w12_mosaic.TILED
        steps = w12_mosaic.run_twin_steps(k, n)
        if isinstance(w, TwinNK):  # tiled once (`twin_params`), for the knobs of that time
            if (w.block_k, w.adjacent, tiled) != (steps["block_k"], adjacent, True):
                raise ValueError(f"a TwinNK tiled for step {w.block_k}, adjacent={w.adjacent} does not match the "
                                 f"runs' twin now (step {steps['block_k']}, w12_mosaic.ADJACENT={adjacent}, "
                                 f"TILED={tiled}): tile it again with twin_params")
            w_t = w.tiles
        else:
            w_t = jnp.asarray(w).T
            if tiled:  # the twin of tiled planes reads its tiles as they are stored
                w_t = w12_mosaic.tile_twin(w_t, steps["block_k"], adjacent)

        def call(r):
            return w12_mosaic.sum_rows(w12_mosaic.bf16_mosaic_partials(
                r, w_t, interpret=interpret, raw=True, adjacent=adjacent, tiled=tiled, **steps,
                **w12_mosaic.run_options(adjacent)), len(r), w12_mosaic.OUT_ROWS)
    m = rows.shape[0]
    if m <= step:
        return call(rows)
    # one kernel call in a loop over blocks of `step` rows (the last one zero-padded): a prefill's program
    # holds one call per matrix, not m / step of them (compile time grows with the calls)
    blocks = jnp.pad(rows, ((0, -m % step), (0, 0))).reshape(-1, step, k)
    return jax.lax.map(call, blocks).reshape(-1, n)[:m]
