"""Tree-verification attention: the committed prefix split over the cache (flash-decoding) plus the tree
block under its ancestor mask, as a Pallas Triton-backend kernel, and its jnp reference (the model's
attention under the full tree mask). Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import largest_pow2_divisor, pow2

_NEG = -0.7 * float(np.finfo(np.float32).max)  # a hidden score: finite, so exp(_NEG - m) is 0, never NaN


def tree_mask_from_ancestors(lengths, ancestors, max_len: int):
    """[B, N, S] bool: node i sees slots < lengths[b] and slot lengths[b] + j where ancestors[b, i, j]
    (what `specpilot.state.tree_mask` builds)."""
    b, n, _ = ancestors.shape
    rel = jnp.arange(max_len, dtype=jnp.int32)[None, :] - lengths[:, None]  # [B, S]
    node = jnp.take_along_axis(ancestors, jnp.clip(rel, 0, n - 1)[:, None, :].repeat(n, axis=1), axis=2)
    return (rel < 0)[:, None, :] | (((rel >= 0) & (rel < n))[:, None, :] & node)


def float32_products(spec: str, a, b):
    """einsum(spec, a, b) accumulated in float32 from the operands' own products. On a CPU backend the
    operands are widened to float32 first: its runtime has no bf16 x bf16 -> f32 product for the cache's
    [B, KVH, S, D] layout, and a bf16 product is exact in float32, so the sum is the same one."""
    if jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def cache_attention(q, k, v, mask):
    """The model's GQA attention (`layers.attention`): q [B, T, H, D], k, v [B, KVH, S, D], mask [B, T, S]."""
    b, t, h, d = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, t, kvh, h // kvh, d)  # [B, T, KVH, G, D]
    scores = float32_products("btkgd,bksd->bkgts", qg, k)
    scores = scores * (1.0 / np.sqrt(d))
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = float32_products("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, h, d).astype(q.dtype)


def tree_attention_reference(q, k_cache, v_cache, lengths, ancestors):
    """q [B, N, H, D] (the nodes' queries), k_cache, v_cache [B, KVH, S, D] (the nodes' K/V already at
    slots lengths[b] + j), lengths [B] int32 (committed slots), ancestors [B, N, N] bool -> [B, N, H, D]
    in q's dtype: the model's attention under the tree mask."""
    mask = tree_mask_from_ancestors(lengths, ancestors, k_cache.shape[2])
    return cache_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)


# ---- the kernel ----------------------------------------------------------------------------------------

def _kernel(lengths_ref, q_ref, k_ref, v_ref, kt_ref, vt_ref, visible_ref, o_ref, m_ref, l_ref, *,
            scale: float, block_k: int, blocks_per_split: int, splits: int):
    # lengths_ref: [] committed slots of this row; q_ref: [BM, D] query rows (node-major, G per node)
    # k_ref, v_ref: [S, D] this row's cache for this KV head; kt_ref, vt_ref: [NP, D] the tree nodes' K/V
    # visible_ref: [BM, NP] int32 (1: the row's node sees tree node j)
    # o_ref: [BM, D] float32 unnormalised partial; m_ref, l_ref: [BM] its running max and sum
    split = pl.program_id(3)
    q = q_ref[...]
    f32 = q.dtype == jnp.float32

    def dot(a, b, trans_b=False):
        return plt.dot(a, b, trans_b=trans_b, allow_tf32=False if f32 else None)

    def absorb(carry, s, vals):  # online softmax: fold scores s [BM, K] over values vals [K, D]
        o, m, l = carry
        m_next = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        o = correction[:, None] * o + dot(p.astype(vals.dtype), vals)
        return o, m_next, correction * l + p.sum(axis=-1)

    bm, d = q.shape
    init = (jnp.zeros((bm, d), jnp.float32), jnp.full((bm,), _NEG, jnp.float32), jnp.zeros((bm,), jnp.float32))

    def store(carry):
        o, m, l = carry
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l

    @pl.when(split < splits)
    def _prefix():
        length = lengths_ref[()]
        first = split * blocks_per_split
        stop = jnp.minimum(first + blocks_per_split, pl.cdiv(length, block_k))

        def body(i, carry):
            window = pl.ds(i * block_k, block_k)
            s = dot(q, k_ref[window, :], trans_b=True) * scale  # [BM, block_k]
            slots = i * block_k + jnp.arange(block_k)
            s = jnp.where((slots < length)[None, :], s, _NEG)
            return absorb(carry, s, v_ref[window, :])

        store(jax.lax.fori_loop(first, stop, body, init))

    @pl.when(split == splits)
    def _tree():
        s = dot(q, kt_ref[...], trans_b=True) * scale  # [BM, NP]
        s = jnp.where(visible_ref[...] != 0, s, _NEG)
        store(absorb(init, s, vt_ref[...]))


def _rows(n: int, g: int, block_m: int) -> tuple[int, int]:
    """(rows per program, padded row count) for n nodes x g query heads per KV head."""
    m = n * g
    bm = min(block_m, max(16, 1 << (m - 1).bit_length()))
    return bm, -(-m // bm) * bm


@functools.partial(jax.jit, static_argnames=("block_m", "block_k", "splits", "num_warps", "num_stages",
                                             "interpret"))
def tree_attention_pallas(q, k_cache, v_cache, lengths, ancestors, *, block_m: int = 64, block_k: int = 64,
                          splits: int = 8, num_warps: int = 4, num_stages: int = 2, interpret: bool = False):
    """The pallas_call and the combine, on any backend the caller asks for (block_k must divide S): same
    arguments and result as `tree_attention_reference`."""
    b, n, h, d = q.shape
    kvh, s_len = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    if s_len % block_k:
        raise NotImplementedError(f"block_k {block_k} does not divide the cache length {s_len}")
    dtype = k_cache.dtype
    bm, m_pad = _rows(n, g, block_m)
    n_pad = max(16, 1 << (n - 1).bit_length())
    blocks_per_split = -(-(s_len // block_k) // splits)

    # query rows: [B, KVH, N*G (padded), D], row r = node r // G, head kvh * G + r % G
    rows = q.astype(dtype).reshape(b, n, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, n * g, d)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, m_pad - n * g), (0, 0)))
    # the tree block: the nodes' K/V out of the cache (the caller guarantees lengths + N <= S)
    def tree_block(cache):  # [B, KVH, S, D] -> [B, KVH, NP, D]
        nodes = jax.vmap(lambda c, start: jax.lax.dynamic_slice_in_dim(c, start, n, axis=1))(cache, lengths)
        return jnp.pad(nodes, ((0, 0), (0, 0), (0, n_pad - n), (0, 0)))

    visible = jnp.repeat(ancestors.astype(jnp.int32), g, axis=1)  # [B, N*G, N]
    visible = jnp.pad(visible, ((0, 0), (0, m_pad - n * g), (0, n_pad - n)))

    kernel = functools.partial(_kernel, scale=1.0 / math.sqrt(d), block_k=block_k,
                               blocks_per_split=blocks_per_split, splits=splits)
    grid = (b, kvh, m_pad // bm, splits + 1)
    cache_spec = pl.BlockSpec((None, None, s_len, d), lambda i, j, r, s: (i, j, 0, 0))
    tree_spec = pl.BlockSpec((None, None, n_pad, d), lambda i, j, r, s: (i, j, 0, 0))
    part = (b, kvh, splits + 1, m_pad)
    o, m, l = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((None,), lambda i, j, r, s: (i,)),
                  pl.BlockSpec((None, None, bm, d), lambda i, j, r, s: (i, j, r, 0)),
                  cache_spec, cache_spec, tree_spec, tree_spec,
                  pl.BlockSpec((None, bm, n_pad), lambda i, j, r, s: (i, r, 0))],
        out_specs=[pl.BlockSpec((None, None, None, bm, d), lambda i, j, r, s: (i, j, s, r, 0)),
                   pl.BlockSpec((None, None, None, bm), lambda i, j, r, s: (i, j, s, r)),
                   pl.BlockSpec((None, None, None, bm), lambda i, j, r, s: (i, j, s, r))],
        out_shape=[jax.ShapeDtypeStruct(part + (d,), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_attention",
    )(lengths.astype(jnp.int32), rows, k_cache, v_cache, tree_block(k_cache), tree_block(v_cache), visible)

    # the combine: fold the splits + 1 partials of each row
    m_all = jax.lax.optimization_barrier(m.max(axis=2))  # [B, KVH, M]; barrier: as jax's decode_attention
    correction = jnp.exp(m - m_all[:, :, None])  # [B, KVH, splits + 1, M]
    out = (o * correction[..., None]).sum(axis=2) / (l * correction).sum(axis=2)[..., None]
    out = out[:, :, :n * g].reshape(b, kvh, n, g, d).transpose(0, 2, 1, 3, 4).reshape(b, n, h, d)
    return out.astype(q.dtype)


# ---- public API ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TreeAttentionTritonConfig:
    """The Triton-backend kernel's settings: query rows per program (`block_m`, nodes x query heads per KV
    head; capped at what the tree needs), cache slots per inner step (`block_k`; the largest power of two
    dividing the cache length up to this is used), prefix splits per (row, KV head), the launch's warps and
    pipeline stages, and interpret (Pallas' interpreter: CPU tests; False on a CPU backend falls through)."""

    block_m: int = 64
    block_k: int = 64
    splits: int = 8
    num_warps: int = 4
    num_stages: int = 2
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_k", "num_warps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and pow2(value)):
                raise ValueError(f"{name} must be a power of two, got {value!r}")
        if self.block_m < 16 or self.block_k < 16:
            raise ValueError(f"block_m and block_k must be >= 16 (tl.dot), got {self.block_m}, {self.block_k}")
        for name in ("splits", "num_stages"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_shapes(q, k_cache, v_cache, lengths, ancestors) -> None:
    """ValueError unless the arrays have the op's consistent shapes (see the reference)."""
    if q.ndim != 4:
        raise ValueError(f"q {q.shape} must be [B, N, H, D]")
    b, n, h, d = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be [B, KVH, S, D] "
                         f"with B, D = {(b, d)}")
    if h % k_cache.shape[1]:
        raise ValueError(f"{h} query heads are not a multiple of {k_cache.shape[1]} KV heads")
    if n > k_cache.shape[2]:
        raise ValueError(f"{n} tree nodes do not fit a cache of {k_cache.shape[2]} slots")
    if lengths.shape != (b,):
        raise ValueError(f"lengths {lengths.shape} must be [B] = {(b,)}")
    if ancestors.shape != (b, n, n):
        raise ValueError(f"ancestors {ancestors.shape} must be [B, N, N] = {(b, n, n)}")


def tree_attention(q, k_cache, v_cache, lengths, ancestors,
                   config: TreeAttentionTritonConfig = TreeAttentionTritonConfig()):
    """Tree attention through the kernel (same arguments and result as `tree_attention_reference`).
    Raises NotImplementedError where the kernel does not apply (shape or backend)."""
    check_shapes(q, k_cache, v_cache, lengths, ancestors)
    d, s_len = q.shape[-1], k_cache.shape[2]
    if not pow2(d):
        raise NotImplementedError(f"the kernel tiles power-of-two head dims, got D {d}")
    block_k = largest_pow2_divisor(s_len, config.block_k)
    if block_k < 16:
        raise NotImplementedError(f"the cache length {s_len} has no power-of-two divisor >= 16 up to "
                                  f"block_k {config.block_k}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")
    return tree_attention_pallas(q, k_cache, v_cache, lengths, ancestors, block_m=config.block_m,
                                 block_k=block_k, splits=config.splits, num_warps=config.num_warps,
                                 num_stages=config.num_stages, interpret=config.interpret)
