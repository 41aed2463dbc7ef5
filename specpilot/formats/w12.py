"""W12: a lossless 12-bit storage format for bf16 weight matrices, encoded once offline: sign and mantissa
kept verbatim, the exponent as a 4-bit code from a per-column base, every other value listed as an
exception (CSR by tile). `encode` (numpy) is the reference, `encode_device` the same bits on device;
stored with safetensors. It imports no kernel. Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

WINDOW = 16  # exponents one 4-bit code reaches
DEFAULT_GROUP_N = 128  # CSR column block; 128 divides every Qwen3 / Llama dim incl. vocab 151936
DEFAULT_GROUP_K = 32  # CSR paired-row group: one default kernel tile of 2 x 32 x 128 weights
FIELDS = ("sm", "nib", "base", "exc_ptr", "exc_row", "exc_col", "exc_val")
LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")  # separate or fused layout


class Bf16Matrix:
    """What every stored form of a bf16 [K, N] matrix (W12 here, the kernels' layouts) shows the code that
    multiplies by it: the dtype and rank of the matrix it holds (its `shape` is its own field)."""

    @property
    def dtype(self):
        return jnp.bfloat16

    @property
    def ndim(self) -> int:
        return 2


@dataclasses.dataclass(frozen=True)
class W12(Bf16Matrix):
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

    @property
    def num_exceptions(self) -> int:
        return int(self.exc_row.shape[0])

    @property
    def k_half(self) -> int:
        return (self.shape[0] + 1) // 2

    @property
    def n_groups_k(self) -> int:
        return -(-self.k_half // self.group_k)

    @property
    def n_groups_n(self) -> int:
        return -(-self.shape[1] // self.group_n)


jax.tree_util.register_dataclass(W12, data_fields=list(FIELDS), meta_fields=["shape", "group_n", "group_k"])


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


# ---- device encoder: same fields as `encode`, every pass over the matrix on the device ----------------

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
    """(code with exceptions set to 0, exception mask) for exponents e and their columns' bases (broadcast)."""
    code = e - base.astype(jnp.int32)
    exc = (code < 0) | (code >= WINDOW)
    return jnp.where(exc, 0, code), exc


def _exponents(bits: jax.Array) -> jax.Array:
    return (bits.astype(jnp.int32) >> 7) & 0xFF


def _cell_geometry(k: int, n: int, group_n: int, group_k: int) -> tuple[int, int, int]:
    """(Kh, paired-row groups n_g, column blocks n_cb) of a [K, N] matrix."""
    kh = (k + 1) // 2
    return kh, -(-kh // group_k), -(-n // group_n)


def _by_cell(a: jax.Array, group_n: int, group_k: int) -> jax.Array:
    """[K, N] -> [n_cb, n_g, 2, group_k, group_n], zero-padded: the CSR's order (column block, paired-row
    group, then row-major inside a cell, which is K half, row, column: every lower-half row of a cell
    precedes its upper-half rows)."""
    k, n = a.shape
    kh, n_g, n_cb = _cell_geometry(k, n, group_n, group_k)
    rows, cols = n_g * group_k, n_cb * group_n
    lo = jnp.pad(a[:kh], ((0, rows - kh), (0, cols - n)))
    hi = jnp.pad(a[kh:], ((0, rows - (k - kh)), (0, cols - n)))
    return jnp.stack([lo, hi]).reshape(2, n_g, group_k, n_cb, group_n).transpose(3, 1, 0, 2, 4)


@functools.partial(jax.jit, static_argnames=("group_n", "group_k"))
def _device_planes(bits: jax.Array, group_n: int, group_k: int):
    """uint16 [K, N] -> (sm int8 [K, N], nib uint8 [Kh, N], base uint8 [N], exc_ptr int32 [n_cb n_g + 1],
    exceptions per block int32 [n_cb n_g 2 group_k] (a block: one row's group_n columns of a cell, in CSR
    order), [exceptions, blocks holding any] int32 [2])."""
    k, n = bits.shape
    kh = (k + 1) // 2
    e = _exponents(bits)
    # Per-column exponent histogram: one scatter-add over col * 256 + exponent (N * 256 int32 bins).
    slot = e + 256 * jnp.arange(n, dtype=jnp.int32)[None, :]
    counts = jnp.zeros(n * 256, jnp.int32).at[slot.reshape(-1)].add(1).reshape(n, 256)
    cs = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), jnp.cumsum(counts, axis=1)], axis=1)  # [N, 257]
    win = cs[:, WINDOW:] - cs[:, :257 - WINDOW]  # [N, 241]: values in [b, b + 15]
    base = jnp.argmax(win, axis=1).astype(jnp.uint8)  # first maximum, as np.argmax
    code, exc = _exceptions_mask(e, base[None, :])
    b32 = bits.astype(jnp.int32)
    sm = jax.lax.bitcast_convert_type((((b32 >> 8) & 0x80) | (b32 & 0x7F)).astype(jnp.uint8), jnp.int8)
    hi = jnp.pad(code[kh:], ((0, 2 * kh - k), (0, 0)))
    nib = (code[:kh] | (hi << 4)).astype(jnp.uint8)
    per_block = jnp.sum(_by_cell(exc, group_n, group_k), axis=-1, dtype=jnp.int32).reshape(-1)
    per_cell = per_block.reshape(-1, 2 * group_k).sum(axis=1)
    exc_ptr = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(per_cell, dtype=jnp.int32)])
    sizes = jnp.stack([exc_ptr[-1], jnp.sum(per_block > 0, dtype=jnp.int32)])
    return sm, nib, base, exc_ptr, per_block, sizes


@functools.partial(jax.jit, static_argnames=("size", "blocks", "group_n", "group_k"))
def _device_exceptions(bits: jax.Array, base: jax.Array, per_block: jax.Array, size: int, blocks: int,
                       group_n: int, group_k: int) -> jax.Array:
    """The exceptions in CSR order, as int32 [3, size] (rows, columns, bf16 bits; slots past the count 0).

    Only blocks that hold an exception are read (at most `blocks` of them): their indices are compacted by
    one scatter over the blocks, their values gathered and their exceptions found again; each exception
    then scatters to its block's offset plus its rank inside the block. No pass touches all K * N values."""
    k, n = bits.shape
    kh, n_g, _ = _cell_geometry(k, n, group_n, group_k)
    n_blocks = per_block.shape[0]
    held = per_block > 0
    rank = jnp.cumsum(held, dtype=jnp.int32) - 1
    chosen = jnp.full(blocks, n_blocks, jnp.int32).at[jnp.where(held, rank, blocks)].set(
        jnp.arange(n_blocks, dtype=jnp.int32), mode="drop")  # [blocks]: held blocks in order, then n_blocks
    start = (jnp.cumsum(per_block, dtype=jnp.int32) - per_block).at[chosen].get(mode="fill", fill_value=0)
    r, half = chosen % group_k, (chosen // group_k) % 2
    g, cb = (chosen // (2 * group_k)) % n_g, chosen // (2 * group_k * n_g)
    row = jnp.where(chosen < n_blocks, half * kh + g * group_k + r, k)  # k: a padding slot, out of range
    col = cb[:, None] * group_n + jnp.arange(group_n, dtype=jnp.int32)[None, :]  # [blocks, group_n]
    inside = (row[:, None] < k) & (col < n)
    val = bits.at[jnp.minimum(row, k - 1)[:, None], jnp.minimum(col, n - 1)].get(mode="clip")
    _, exc = _exceptions_mask(_exponents(val), base.at[jnp.minimum(col, n - 1)].get(mode="clip"))
    exc = exc & inside
    slot = jnp.where(exc, start[:, None] + jnp.cumsum(exc, axis=1, dtype=jnp.int32) - 1, size).reshape(-1)
    fields = jnp.stack([jnp.broadcast_to(row[:, None], col.shape), col, val.astype(jnp.int32)]).reshape(3, -1)
    return jnp.zeros((3, size), jnp.int32).at[:, slot].set(fields, mode="drop")


def _bucket(count: int, limit: int) -> int:
    """A power of two >= count (at least 256, at most `limit` where that holds count): few distinct compiles."""
    return max(count, min(limit, max(256, 1 << (count - 1).bit_length())))


def placement(a: jax.Array):
    """Where `jax.device_put` puts arrays made for `a`: on its device if `a` is committed there, else
    uncommitted (the default device), as jit outputs of `a` are. A jit compiles anew for a change of
    commitment, so a matrix's fields all follow its source."""
    devices = a.devices()
    return next(iter(devices)) if a.committed and len(devices) == 1 else None


def encode_device(w, group_n: int = DEFAULT_GROUP_N, group_k: int = DEFAULT_GROUP_K) -> W12:
    """`encode` on the weight's device: bf16 [K, N] (or [N], one row) jax array -> W12 with jax arrays on
    that device, equal to `encode(w)` field by field.

    One jitted call makes the dense planes, the per-column bases (same window counts and first-maximum
    tie-break), the CSR offsets and each block's exception count; one small sync reads the exception count,
    and a second jitted call lists the exceptions in CSR order from the blocks that hold them. Each call
    compiles once per shape (and power-of-two bucket of the counts); only the lists, about 1e-4 of trained
    weights, pass through the host, to be cut to their length. No 64-bit types (x64 may stay off)."""
    bits = _device_bits(w)
    k, n = bits.shape
    kh, n_g, n_cb = _cell_geometry(k, n, group_n, group_k)
    if n * 256 >= 2**31 or 2 * n_g * group_k * n_cb * group_n >= 2**31:
        raise ValueError(f"a [{k}, {n}] matrix overflows the encoder's int32 indices")
    sm, nib, base, exc_ptr, per_block, sizes = _device_planes(bits, group_n=group_n, group_k=group_k)
    count, held = (int(s) for s in jax.device_get(sizes))
    lists = np.zeros((3, 0), np.int32)
    if count:
        lists = _device_exceptions(bits, base, per_block, size=_bucket(count, 2**31 - 1),
                                   blocks=_bucket(held, per_block.shape[0]), group_n=group_n, group_k=group_k)
        lists = jax.device_get(lists)[:, :count]
    rows, cols, vals = jax.device_put((lists[0], lists[1], lists[2].astype(np.uint16)), placement(bits))
    return W12(sm=sm, nib=nib, base=base, exc_ptr=exc_ptr, exc_row=rows, exc_col=cols, exc_val=vals,
               shape=(k, n), group_n=group_n, group_k=group_k)


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


def storage_bytes(w: W12) -> dict[str, int]:
    """Bytes per part: the dense planes, per-column bases, CSR offsets and exception lists (a kernel
    layout's own: `pallas_kernels.w12_mosaic.storage_bytes`)."""
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
    with safe_open(path, "np") as f:
        meta = json.loads((f.metadata() or {}).get("w12", "{}"))
    flat = load_file(path)
    out = {k: v for k, v in flat.items() if ".w12." not in k}
    for name, m in meta.items():
        out[name] = W12(**{f: flat[f"{name}.w12.{f}"] for f in FIELDS}, shape=tuple(m["shape"]),
                        group_n=m["group_n"], group_k=m["group_k"])
    return out


# ---- model integration ----------------------------------------------------------------------------

def encode_params(params: dict, names: tuple[str, ...] = LINEAR_NAMES, lm_head: bool = True,
                  max_exception_rate: float = 0.01, extra: tuple[str, ...] = (), **kw) -> dict:
    """Dense-model params with the named per-layer linear weights (and `lm_head`, and the top-level
    matrices named in `extra`, e.g. a drafter's `fc`) replaced by W12 on the device (`encode_device`;
    keyword arguments go to it). A matrix whose exception rate exceeds `max_exception_rate` stays bf16: its
    patch work would sit on a kernel's hot path and its storage would approach 16 bits."""

    return map_matrices(lambda x: encode_matrix(x, max_exception_rate, **kw), params, names, lm_head, extra)


def encode_matrix(x, max_exception_rate: float = 0.01, **kw):
    """One matrix as `encode_params` stores it: W12 on its device, or `x` itself above `max_exception_rate`."""
    w = encode_device(x, **kw)
    return x if w.num_exceptions > max_exception_rate * x.size else w


def matrix_names(params: dict, names: tuple[str, ...] = LINEAR_NAMES, lm_head: bool = True,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """The paths (`layers.<i>.<name>`, `lm_head`, an extra's name) of the matrices `map_matrices` visits, in
    the order it visits them."""
    out = [f"layers.{i}.{k}" for i, layer in enumerate(params["layers"]) for k in layer if k in names]
    if lm_head and "lm_head" in params:
        out.append("lm_head")
    return out + [name for name in extra if name in params]


def map_matrices(fn, params: dict, names: tuple[str, ...] = LINEAR_NAMES, lm_head: bool = True,
                 extra: tuple[str, ...] = ()) -> dict:
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
