"""A chain forward's attention block in one Pallas Triton-backend kernel: from the fused qkv projection's
output to the attention output, with qk-norm, RoPE and the K/V cache write folded in (XLA leaves about
a dozen small kernels there per layer), and its pure-jnp reference, the model's own expressions.
Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import NUM_SMS_H200, largest_pow2_divisor, pow2
from pallas_kernels.ragged_attention import check_split_launch, first_copy, pad_rows, visible_mask
from pallas_kernels.tree_attention import cache_attention

MIN_ROWS = 16  # tl.dot's smallest M (and N, K)
MAX_ROWS = 256  # query rows (T x heads per KV head) one program holds, as the ragged kernel
TARGET_PROGRAMS = 2 * NUM_SMS_H200  # the automatic split fills about two waves of SMs
_NEG = -0.7 * float(np.finfo(np.float32).max)  # the running max's start: finite, so exp(_NEG - _NEG) = 1


# ---- the reference: the model's path, written from the same jnp expressions ----------------------------

def split_heads(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """qkv [B, T, (H + 2 KVH) D] -> q [B, T, H, D], k, v [B, T, KVH, D] (as `dense.decoder_layer`)."""
    b, t, _ = qkv.shape
    q, k, v = jnp.split(qkv, [num_heads * head_dim, (num_heads + num_kv_heads) * head_dim], axis=-1)
    return (q.reshape(b, t, num_heads, head_dim), k.reshape(b, t, num_kv_heads, head_dim),
            v.reshape(b, t, num_kv_heads, head_dim))


def rms_norm(x, weight, eps: float):
    """`specpilot.models.layers.rms_norm`."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(dtype)


def apply_rope(x, cos, sin):
    """`specpilot.models.layers.apply_rope`: x [B, T, N, D], cos/sin [B, T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


def write_slots(cache, new, start):
    """`specpilot.state.write_slots`: new [B, T, KVH, D] into cache [B, KVH, S, D] at slots start[b] + t."""
    def one(c, n, s):
        return jax.lax.dynamic_update_slice(c, jnp.swapaxes(n, 0, 1).astype(c.dtype), (0, s, 0))
    return jax.vmap(one)(cache, new, start)


def attention_block_reference(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, *,
                              num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """What `dense.decoder_layer` computes between the qkv and o products of a chain forward:
    -> (attn [B, T, H D] in qkv's dtype, k_cache, v_cache with the T new tokens at slots lengths[b] + t)."""
    check_shapes(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, num_heads, num_kv_heads,
                 head_dim)
    b, t, _ = qkv.shape
    q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache, v_cache = write_slots(k_cache, k, lengths), write_slots(v_cache, v, lengths)
    mask = visible_mask(lengths, counts, t, k_cache.shape[2])
    attn = cache_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
    return attn.reshape(b, t, num_heads * head_dim), k_cache, v_cache


def check_shapes(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, num_heads, num_kv_heads,
                 head_dim) -> None:
    """ValueError unless the arrays have the op's consistent shapes (see the reference)."""
    if qkv.ndim != 3 or qkv.shape[2] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {qkv.shape} must be [B, T, (H + 2 KVH) D] with H, KVH, D = "
                         f"{(num_heads, num_kv_heads, head_dim)}")
    b, t, _ = qkv.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and w.shape != (head_dim,):
            raise ValueError(f"{name} {w.shape} must be [D] = ({head_dim},) or None")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.shape != (b, t, head_dim):
            raise ValueError(f"{name} {x.shape} must be [B, T, D] = {(b, t, head_dim)}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[:2] != (b, num_kv_heads) \
            or k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be [B, KVH, S, D] "
                         f"with B, KVH, D = {(b, num_kv_heads, head_dim)}")
    if t > k_cache.shape[2]:
        raise ValueError(f"{t} new tokens do not fit a cache of {k_cache.shape[2]} slots")
    for name, x in (("lengths", lengths), ("counts", counts)):
        if x.shape != (b,):
            raise ValueError(f"{name} {x.shape} must be [B] = ({b},)")


# ---- the kernel ----------------------------------------------------------------------------------------

def _mul(a, b, dtype):
    # a * b rounded once to dtype: the float32 product of two bf16 (or f16) values is exact, so this is the
    # activation dtype's own product, and no backend can fuse it into a differently rounded FMA
    return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(dtype)


def _add(a, b, dtype):
    # a + b rounded to dtype; for bf16 operands the float32 sum rounds to the same bf16 value as the exact sum
    return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(dtype)


def _norm_rope(load, d: int, w_ref, cos, sin, *, normed: bool, eps: float):
    """The model's qk-norm and RoPE of one head's rows (load(columns) -> [T, columns] of it) -> its halves,
    each [T, D/2] in its dtype; cos, sin: (first half, second half), each [T, D/2] in that dtype. Everything
    stays 2D: on the H200 the same steps over [T, G, D] values (3D, size-1 dims) cost tens of microseconds."""
    half = d // 2
    x1, x2 = load(slice(0, half)), load(slice(half, d))
    dtype = x1.dtype
    if normed:
        xf = load(slice(None)).astype(jnp.float32)
        factor = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)  # [T, 1] over the whole row
        x1 = _mul(w_ref[:half][None, :], (x1.astype(jnp.float32) * factor).astype(dtype), dtype)
        x2 = _mul(w_ref[half:][None, :], (x2.astype(jnp.float32) * factor).astype(dtype), dtype)
    (c1, c2), (s1, s2) = cos, sin
    # rotate_half: (x1, x2) -> (-x2, x1); out = x * cos + rotated * sin, each op rounded as the reference's
    return _add(_mul(x1, c1, dtype), _mul(-x2, s1, dtype), dtype), _add(_mul(x2, c2, dtype), _mul(x1, s2, dtype), dtype)


def _kernel(lengths_ref, counts_ref, q_ref, k_ref, v_ref, cos_ref, sin_ref, qw_ref, kw_ref, kc_ref, vc_ref,
            kc_out, vc_out, *out_refs, q_normed: bool, k_normed: bool, eps: float,
            block_s: int, splits: int):
    # lengths_ref, counts_ref: [] this row's committed slots and the new tokens its queries see
    # q_ref: [T, G, D] this KV head's query heads (read head by head, as 2D [T, D] values); k_ref, v_ref:
    # [T, D] its new K/V (projection outputs); cos_ref, sin_ref: [T, D] float32; qw_ref, kw_ref: [D] norm
    # weights (unread without the norm); kc_ref, vc_ref: [S, D] this row's cache for this KV head, read below
    # `length` only; kc_out, vc_out: the same buffers (aliased), where the last split writes the T new tokens
    # at slots length .. length + T - 1; out_refs: splits == 1: attn [T, G, D]; else this split's partial
    # o [T, G, D] (unnormalised) and its m, l [T, G] float32
    split = pl.program_id(2)
    length, count = lengths_ref[()], counts_ref[()]
    t, d = k_ref.shape
    s_len, half, dtype, cache_dtype = kc_ref.shape[0], d // 2, k_ref.dtype, kc_ref.dtype
    rows = max(MIN_ROWS, t)  # query rows and new-token columns per dot; past T: repeated, masked
    scale = 1.0 / float(np.sqrt(d))
    last = splits - 1

    cos = (cos_ref[:, :half].astype(dtype), cos_ref[:, half:].astype(dtype))  # [T, D/2] each
    sin = (sin_ref[:, :half].astype(dtype), sin_ref[:, half:].astype(dtype))
    group = q_ref.shape[1]
    queries = [tuple(pad_rows(x, rows) for x in _norm_rope(lambda c, e=e: q_ref[:, e, c], d, qw_ref, cos, sin,
                                                               normed=q_normed, eps=eps))
               for e in range(group)]  # per head: halves [R, D/2]
    k1, k2 = _norm_rope(lambda c: k_ref[:, c], d, kw_ref, cos, sin, normed=k_normed, eps=eps)  # [T, D/2] each
    v_new = v_ref[...]  # [T, D]

    @pl.when(split == last)
    def _write():
        start = jnp.minimum(length, s_len - t)  # write_slots' clamp (callers keep lengths + T <= S)
        plt.store(kc_out.at[pl.ds(start, t), pl.ds(0, half)], k1.astype(cache_dtype))
        plt.store(kc_out.at[pl.ds(start, t), pl.ds(half, half)], k2.astype(cache_dtype))
        plt.store(vc_out.at[pl.ds(start, t), :], v_new.astype(cache_dtype))

    def dot(a, b, trans_b=False):
        return plt.dot(a, b, trans_b=trans_b, allow_tf32=False if dtype == jnp.float32 else None)

    def absorb(carry, query, key1, key2, vals, visible):
        # online softmax of one head: fold the scores of query (halves [R, D/2]) against K keys (halves
        # [K, D/2]) where visible ([R, K] or [1, K]) over values vals [K, D]
        o, m, l = carry
        s = (dot(query[0], key1, trans_b=True) + dot(query[1], key2, trans_b=True)) * scale
        s = jnp.where(visible, s, -jnp.inf)  # -inf: exp gives 0 against the finite running max
        m_next = jnp.maximum(m, s.max(axis=-1))
        correction = jnp.exp(m - m_next)
        p = jnp.exp(s - m_next[:, None])
        o = correction[:, None] * o + dot(p.astype(vals.dtype), vals)
        return o, m_next, correction * l + p.sum(axis=-1)

    # the committed slots: this split's contiguous share of the row's own ceil(length / block_s) blocks
    num_blocks = pl.cdiv(length, block_s)
    per_split = pl.cdiv(num_blocks, splits)
    first = split * per_split
    offsets = jax.lax.broadcasted_iota(jnp.int32, (block_s,), 0)

    def body(i, carries):
        start = pl.multiple_of(i * block_s, block_s)
        valid = start + offsets < length  # [BS]; slots past it are never loaded (another program writes there)

        def load(ref, cols, width):  # [BS, width] in the activation dtype, zeros past length
            mask = jnp.broadcast_to(valid[:, None], (block_s, width))
            return plt.load(ref.at[pl.ds(start, block_s), cols], mask=mask, other=0).astype(dtype)

        key1, key2 = load(kc_ref, pl.ds(0, half), half), load(kc_ref, pl.ds(half, half), half)
        vals = load(vc_ref, slice(None), d)
        return tuple(absorb(c, q, key1, key2, vals, valid[None, :]) for c, q in zip(carries, queries))

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    carries = jax.lax.fori_loop(first, jnp.minimum(first + per_split, num_blocks), body, (init,) * group)

    # the T new tokens, from registers as the cache would return them (the last split's share)
    def as_read(x):
        return pad_rows(x.astype(cache_dtype).astype(dtype), rows)

    token = jax.lax.broadcasted_iota(jnp.int32, (rows, rows), 0) % t
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, rows), 1)
    seen = (col < t) & (col <= token) & (col < count) & (split == last)  # col >= T: a repeated copy
    own1, own2, own_v = as_read(k1), as_read(k2), as_read(v_new)
    for e, (carry, query) in enumerate(zip(carries, queries)):
        o, m, l = (first_copy(x, t) for x in absorb(carry, query, own1, own2, own_v, seen))
        if splits == 1:
            plt.store(out_refs[0].at[:, np.int32(e), :], (o / l[:, None]).astype(out_refs[0].dtype))
        else:
            o_ref, m_ref, l_ref = out_refs
            plt.store(o_ref.at[:, np.int32(e), :], o)
            plt.store(m_ref.at[:, np.int32(e)], m)
            plt.store(l_ref.at[:, np.int32(e)], l)


def combine(o, m, l):
    """The splits' partials o [P, B, T, H, D], m, l [P, B, T, H] -> the normalised output [B, T, H, D] float32."""
    m_all = m.max(axis=0)
    correction = jnp.exp(m - m_all[None])
    return (o * correction[..., None]).sum(axis=0) / (l * correction).sum(axis=0)[..., None]


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "head_dim", "eps", "block_s", "splits",
                                             "num_warps", "num_stages", "interpret"))
def attention_block_pallas(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, *, num_heads: int,
                           num_kv_heads: int, head_dim: int, eps: float, block_s: int, splits: int,
                           num_warps: int = 4, num_stages: int = 1, interpret: bool = False):
    """The pallas_call (and with splits > 1 the combine) on any backend the caller asks for: same arguments
    and results as `attention_block_reference` (block_s must divide the cache's S)."""
    b, t, _ = qkv.shape
    h, kvh, d, s_len = num_heads, num_kv_heads, head_dim, k_cache.shape[2]
    g = h // kvh
    heads = qkv.reshape(b, t, h + 2 * kvh, d)  # q heads, then k heads, then v heads
    unused = jnp.zeros((d,), qkv.dtype)
    kernel = functools.partial(_kernel, q_normed=q_norm is not None, k_normed=k_norm is not None,
                               eps=float(eps), block_s=block_s, splits=splits)

    scalar = pl.BlockSpec((None,), lambda i, j, p: (i,))
    table = pl.BlockSpec((None, t, d), lambda i, j, p: (i, 0, 0))
    weight = pl.BlockSpec((d,), lambda i, j, p: (0,))
    cache = pl.BlockSpec((None, None, s_len, d), lambda i, j, p: (i, j, 0, 0))
    in_specs = [scalar, scalar,
                pl.BlockSpec((None, t, g, d), lambda i, j, p: (i, 0, j, 0)),  # query heads j G .. j G + G - 1
                pl.BlockSpec((None, t, None, d), lambda i, j, p: (i, 0, h + j, 0)),
                pl.BlockSpec((None, t, None, d), lambda i, j, p: (i, 0, h + kvh + j, 0)),
                table, table, weight, weight, cache, cache]
    caches = [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    if splits == 1:
        out_specs = [cache, cache, pl.BlockSpec((None, t, g, d), lambda i, j, p: (i, 0, j, 0))]
        out_shape = caches + [jax.ShapeDtypeStruct((b, t, h, d), qkv.dtype)]
    else:
        stats = pl.BlockSpec((None, None, t, g), lambda i, j, p: (p, i, 0, j))
        out_specs = [cache, cache, pl.BlockSpec((None, None, t, g, d), lambda i, j, p: (p, i, 0, j, 0)), stats, stats]
        out_shape = caches + [jax.ShapeDtypeStruct((splits, b, t, h, d), jnp.float32),
                              jax.ShapeDtypeStruct((splits, b, t, h), jnp.float32),
                              jax.ShapeDtypeStruct((splits, b, t, h), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={9: 0, 10: 1},  # the caches: updated in place inside a jit or loop carry
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="attention_block",
    )(lengths.astype(jnp.int32), counts.astype(jnp.int32), heads, heads, heads, cos.astype(jnp.float32),
      sin.astype(jnp.float32), unused if q_norm is None else q_norm, unused if k_norm is None else k_norm,
      k_cache, v_cache)
    attn = outs[2] if splits == 1 else combine(*outs[2:5]).astype(qkv.dtype)
    return attn.reshape(b, t, h * d), outs[0], outs[1]


# ---- public API ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AttentionBlockConfig:
    """The kernel's settings: cache slots per inner step (`block_s`; the largest power of two dividing the
    cache length up to this is used), splits of each row's committed slots (0: automatic, `auto_splits`;
    1: no combine, the kernel writes the output itself), the launch's warps and pipeline stages, and
    interpret (Pallas' interpreter: CPU tests; False on a CPU backend raises NotImplementedError)."""

    block_s: int = 64
    splits: int = 0
    num_warps: int = 4
    num_stages: int = 1
    interpret: bool = False

    def __post_init__(self):
        check_split_launch(self)


def auto_splits(batch: int, kv_heads: int, slots: int, block_s: int) -> int:
    """Splits per (row, KV head) so the grid has about TARGET_PROGRAMS programs, at most one per block of
    the cache (a row's blocks are shared out among the splits at run time, by its own length)."""
    return max(1, min(-(-TARGET_PROGRAMS // (batch * kv_heads)), slots // block_s))


def attention_block(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, *, num_heads: int,
                    num_kv_heads: int, head_dim: int, eps: float,
                    config: AttentionBlockConfig = AttentionBlockConfig()):
    """The attention block through the kernel: same arguments and results as `attention_block_reference`
    (lengths[b] + T <= S). Raises NotImplementedError where the kernel does not apply (shape, dtype or
    backend), so the caller runs the unfused path."""
    check_shapes(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts, num_heads, num_kv_heads,
                 head_dim)
    b, t, _ = qkv.shape
    g, s_len = num_heads // num_kv_heads, k_cache.shape[2]
    if not (pow2(t) and pow2(g)):
        raise NotImplementedError(f"the kernel tiles power-of-two token counts and heads per KV head, got T {t}, "
                                  f"{g} heads per KV head")
    if not pow2(head_dim) or head_dim < 2 * MIN_ROWS:
        raise NotImplementedError(f"the kernel takes power-of-two head dims >= {2 * MIN_ROWS} (RoPE's halves feed "
                                  f"tl.dot), got {head_dim}")
    if max(MIN_ROWS, t * g) > MAX_ROWS:
        raise NotImplementedError(f"{t} tokens x {g} heads per KV head need {t * g} query rows in one program; "
                                  f"the kernel holds at most {MAX_ROWS}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and w.dtype != qkv.dtype:
            raise NotImplementedError(f"{name} is {w.dtype} but qkv {qkv.dtype}; the kernel norms in one dtype")
    block_s = largest_pow2_divisor(s_len, config.block_s)
    if block_s < MIN_ROWS:
        raise NotImplementedError(f"the cache length {s_len} has no power-of-two divisor >= {MIN_ROWS} up to "
                                  f"block_s {config.block_s}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")
    splits = config.splits or auto_splits(b, num_kv_heads, s_len, block_s)
    return attention_block_pallas(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, lengths, counts,
                                  num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=float(eps),
                                  block_s=block_s, splits=splits, num_warps=config.num_warps,
                                  num_stages=config.num_stages, interpret=config.interpret)
