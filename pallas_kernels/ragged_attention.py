"""Ragged attention: each row's queries read only that row's committed K/V and its own new tokens (row b:
`lengths[b]` committed slots, `counts[b]` new ones), as a Pallas Triton-backend kernel that splits each
row's blocks over programs (flash-decoding, online softmax, a log-sum-exp combine), and its pure-jnp
reference over the whole cache. Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import NUM_SMS_H200, pow2
from pallas_kernels.tree_attention import float32_products

MIN_ROWS = 16  # tl.dot's smallest M
# the most query rows (T x heads per KV head, padded) one program holds: on the H200 a prompt chunk's
# 2048 rows asked for 1.06 MB of shared memory (232 KB there); 256 rows is a 64-token verification at 4
# heads per KV head. Longer chunks (prefill) go to the reference.
MAX_ROWS = 256
NEG = -1e30  # the online softmax's starting max: finite, so exp(NEG - NEG) = 1 where nothing is seen yet
TINY = 1e-30  # the sum's floor: a row that sees no slot (lengths = counts = 0) gets 0, not 0 / 0
TARGET_PROGRAMS = 2 * NUM_SMS_H200  # the automatic split: about two programs per SM


def query_rows(t: int, group: int) -> int:
    """The query rows one program holds: T x heads per KV head, padded to a power of two >= MIN_ROWS."""
    return max(MIN_ROWS, 1 << (t * group - 1).bit_length())


def visible_mask(lengths: jax.Array, counts: jax.Array, t: int, s: int) -> jax.Array:
    """[B, T, S] bool: query t of row b sees slots < lengths[b] + min(t + 1, counts[b])."""
    limit = lengths[:, None] + jnp.minimum(jnp.arange(t, dtype=jnp.int32)[None, :] + 1, counts[:, None])
    return jnp.arange(s, dtype=jnp.int32)[None, None, :] < limit[:, :, None]


def ragged_attention_reference(q, k, v, lengths, counts):
    """q [B, T, H, D]; k, v [B, KVH, S, D]; lengths, counts [B] int32 -> [B, T, H, D] in q's dtype.
    Grouped-query attention masked by length (scores and softmax in float32)."""
    check_shapes(q, k, v, lengths, counts)
    b, t, h, d = q.shape
    kvh = k.shape[1]
    mask = visible_mask(lengths, counts, t, k.shape[2])
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = float32_products("btkgd,bksd->bkgts", qg, k) / np.sqrt(d)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = float32_products("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, h, d).astype(q.dtype)


def check_shapes(q, k, v, lengths, counts) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"q {q.shape} must be [B, T, H, D] and k {k.shape}, v {v.shape} both [B, KVH, S, D]")
    b, _, h, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or h % k.shape[1]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on B or D, or H is not a multiple of KVH")
    for name, x in (("lengths", lengths), ("counts", counts)):
        if x.shape != (b,):
            raise ValueError(f"{name} {x.shape} must be [B] = ({b},)")


# ---- the kernel ----------------------------------------------------------------------------------------

def pad_rows(x, rows: int):
    """x [M, N] -> [rows, N] by repeating it (rows a power-of-two multiple of M): tl.dot needs >= 16 rows and
    Triton cannot concatenate along rows. The copies compute identical results; `first_copy` takes one."""
    m = x.shape[0]
    if m == rows:
        return x
    return jnp.broadcast_to(x[None], (rows // m, m, x.shape[1])).reshape(rows, x.shape[1])


def first_copy(x, m: int):
    """The first m rows of x [R, ...] built by `pad_rows` (all copies hold the same values)."""
    if x.shape[0] == m:
        return x
    return jnp.max(x.reshape((x.shape[0] // m, m) + x.shape[1:]), axis=0)


def _kernel(lengths_ref, counts_ref, q_ref, k_ref, v_ref, *out_refs, block_s: int, group: int, splits: int,
            scale: float):
    # lengths_ref, counts_ref: [B] int32; q_ref: this KV head's queries, [T, G, D] (natural layout) or
    # [R, D] (rows r = token r // G, head r % G, padded); k_ref, v_ref: [S, D] this row's KV head
    # out_refs: splits == 1: the output block (q_ref's shape); else this split's partial o (unnormalised,
    # float32, q_ref's shape) and its running max m and sum l (q_ref's shape less D)
    b, split = pl.program_id(0), pl.program_id(2)
    length, count = lengths_ref[b], counts_ref[b]
    d = q_ref.shape[-1]
    q = q_ref[...].reshape(-1, d)
    dtype, m_rows = q.dtype, q.shape[0]
    rows = max(MIN_ROWS, m_rows)
    q = pad_rows(q, rows)  # [rows, D]; row r holds query row r % m_rows
    token = (jax.lax.broadcasted_iota(jnp.int32, (rows, block_s), 0) % m_rows) // group
    limit = length + jnp.minimum(token + 1, count)  # [rows, BS]
    offsets = jax.lax.broadcasted_iota(jnp.int32, (rows, block_s), 1)

    def dot(a, b, trans_b=False):
        return plt.dot(a, b, trans_b=trans_b, allow_tf32=False if dtype == jnp.float32 else None)

    def body(j, carry):
        m, l, acc = carry  # [rows], [rows], [rows, D] float32
        start = pl.multiple_of(j * block_s, block_s)
        keys = k_ref[pl.ds(start, block_s), :].astype(dtype)  # [BS, D]
        values = v_ref[pl.ds(start, block_s), :].astype(dtype)
        s = dot(q, keys, trans_b=True) * scale  # float32 scores from the operands' own products
        s = jnp.where(start + offsets < limit, s, -jnp.inf)  # [rows, BS]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + dot(p.astype(dtype), values)
        return m_new, alpha * l + jnp.sum(p, axis=1), acc

    # this split's contiguous share of the row's own blocks (those below lengths + counts); a split past
    # the row's end runs no step and writes the neutral partial (m = NEG, l = 0, o = 0)
    num_blocks = pl.cdiv(length + count, block_s)
    per_split = pl.cdiv(num_blocks, splits)
    first = split * per_split
    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, jnp.minimum(first + per_split, num_blocks), body, init)
    m, l, acc = first_copy(m, m_rows), first_copy(l, m_rows), first_copy(acc, m_rows)
    if splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = (acc / jnp.maximum(l, TINY)[:, None]).reshape(o_ref.shape).astype(o_ref.dtype)
    else:
        o_ref, m_ref, l_ref = out_refs
        o_ref[...] = acc.reshape(o_ref.shape)
        m_ref[...] = m.reshape(m_ref.shape)
        l_ref[...] = l.reshape(l_ref.shape)


def _combine_kernel(o_ref, m_ref, l_ref, out_ref, *, splits: int):
    # o_ref [P, *Q, D], m_ref, l_ref [P, *Q]: one query head's (or KV head's) partials, Q its query rows;
    # out_ref [*Q, D]. A log-sum-exp merge: each split's sums rescaled to the common max. Unrolled, so
    # the splits' loads are all issued at once (a loop of dependent steps was latency-bound: 16 us)
    m_all = m_ref[0]
    for p in range(1, splits):
        m_all = jnp.maximum(m_all, m_ref[p])
    l = jnp.zeros(m_all.shape, jnp.float32)
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for p in range(splits):
        weight = jnp.exp(m_ref[p] - m_all)
        l = l + weight * l_ref[p]
        acc = acc + weight[..., None] * o_ref[p]
    out_ref[...] = (acc / jnp.maximum(l, TINY)[..., None]).astype(out_ref.dtype)


def combine(o, m, l):
    """The splits' partials o [P, ..., D], m, l [P, ...] -> the normalised output [..., D] float32 (a
    log-sum-exp merge in jnp: each split's sums rescaled to the common max)."""
    correction = jnp.exp(m - m.max(axis=0)[None])
    return (o * correction[..., None]).sum(axis=0) / jnp.maximum((l * correction).sum(axis=0), TINY)[..., None]


MERGES = ("xla", "kernel")


def natural_layout(t: int, group: int) -> bool:
    """Whether a KV head's queries are read in place from q [B, T, H, D] as a [T, G, D] block (Triton's
    blocks are powers of two); otherwise they are gathered into padded rows by a transpose first."""
    return pow2(t) and pow2(group)


@functools.partial(jax.jit, static_argnames=("block_s", "splits", "num_warps", "num_stages", "merge", "interpret"))
def ragged_attention_pallas(q, k, v, lengths, counts, *, block_s: int = 64, splits: int = 1, num_warps: int = 4,
                            num_stages: int = 1, merge: str = "xla", interpret: bool = False):
    """The pallas_call (and with splits > 1 the merge: `combine` in jnp, or the combine kernel): same
    arguments and result as `ragged_attention_reference` (block_s must divide the cache's S)."""
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    group = h // kvh
    if natural_layout(t, group):  # blocks of q [B, T, H, D] itself: no layout pass before or after
        queries = q
        block, at = (None, t, group, d), (lambda i, j: (i, 0, j, 0))
    else:  # [B, KVH, R, D]: row r = token r // G, head r % G of the KV head, padded to R rows
        rows = query_rows(t, group)
        queries = q.reshape(b, t, kvh, group, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * group, d)
        queries = jnp.pad(queries, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))
        block, at = (None, None, rows, d), (lambda i, j: (i, j, 0, 0))
    q_spec = pl.BlockSpec(block, lambda i, j, p: at(i, j))
    # a split's partials: o [P, *queries.shape] float32, m and l the same less D
    o_part = pl.BlockSpec((None,) + block, lambda i, j, p: (p,) + at(i, j))
    stat_part = pl.BlockSpec((None,) + block[:-1], lambda i, j, p: (p,) + at(i, j)[:-1])
    part = (splits,) + queries.shape[:-1]
    cache = pl.BlockSpec((None, None, s, d), lambda i, j, p: (i, j, 0, 0))
    scalars = pl.BlockSpec((b,), lambda i, j, p: (0,))
    params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    outs = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, group=group, splits=splits, scale=1.0 / float(np.sqrt(d))),
        grid=(b, kvh, splits),
        in_specs=[scalars, scalars, q_spec, cache, cache],
        out_specs=[q_spec] if splits == 1 else [o_part, stat_part, stat_part],
        out_shape=([jax.ShapeDtypeStruct(queries.shape, q.dtype)] if splits == 1 else
                   [jax.ShapeDtypeStruct(part + (d,), jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32),
                    jax.ShapeDtypeStruct(part, jnp.float32)]),
        compiler_params=params,
        interpret=interpret,
        name="ragged_attention",
    )(lengths.astype(jnp.int32), counts.astype(jnp.int32), queries, k, v)
    if splits == 1:
        out = outs[0]
    elif merge == "xla":
        out = combine(*outs).astype(q.dtype)
    else:  # the merge as one more small kernel (XLA's reduces over the split axis took three on the H200)
        if natural_layout(t, group):  # one program per (row, query head): [P, T, D] partials each
            grid, block, at = (b, h), (None, t, None, d), (lambda i, j: (i, 0, j, 0))
        else:
            grid = (b, kvh)
        all_parts = pl.BlockSpec((splits,) + block, lambda i, j: (0,) + at(i, j))
        all_stats = pl.BlockSpec((splits,) + block[:-1], lambda i, j: (0,) + at(i, j)[:-1])
        out = pl.pallas_call(
            functools.partial(_combine_kernel, splits=splits),
            grid=grid,
            in_specs=[all_parts, all_stats, all_stats],
            out_specs=pl.BlockSpec(block, at),
            out_shape=jax.ShapeDtypeStruct(queries.shape, q.dtype),
            compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
            interpret=interpret,
            name="ragged_attention_combine",
        )(*outs)
    if natural_layout(t, group):
        return out
    out = out[:, :, : t * group].reshape(b, kvh, t, group, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d)


# ---- public API ----------------------------------------------------------------------------------------

def check_split_launch(config) -> None:
    """The settings the cache-split Triton kernels share (this one's and `attention_block`'s): block_s and
    num_warps powers of two, block_s >= 16 (tl.dot), num_stages >= 1, splits >= 0 (0: automatic)."""
    for name in ("block_s", "num_warps"):
        value = getattr(config, name)
        if not (isinstance(value, int) and pow2(value)):
            raise ValueError(f"{name} must be a power of two, got {value!r}")
    if config.block_s < MIN_ROWS:
        raise ValueError(f"block_s must be >= {MIN_ROWS} (tl.dot), got {config.block_s}")
    if not (isinstance(config.num_stages, int) and config.num_stages >= 1):
        raise ValueError(f"num_stages must be a positive integer, got {config.num_stages!r}")
    if not (isinstance(config.splits, int) and config.splits >= 0):
        raise ValueError(f"splits must be a non-negative integer (0: automatic), got {config.splits!r}")


@dataclasses.dataclass(frozen=True)
class RaggedAttentionConfig:
    """The Triton-backend kernel's settings: slots per key block (`block_s`, a power of two >= 16 dividing
    the cache length), the launch's warps and pipeline stages, splits of each row's blocks (0: automatic,
    `auto_splits`; 1: no combine, the kernel writes the output itself), how splits merge (`merge`: "xla",
    the jnp log-sum-exp whose kernels XLA fuses, measured on the H200 at 10.0 us per call with the
    attention at batch 1 and 16 tokens; "kernel", one more Pallas kernel), and interpret (Pallas'
    interpreter: CPU tests; False on a CPU backend falls through to the reference)."""

    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 1
    splits: int = 0
    merge: str = "xla"
    interpret: bool = False

    def __post_init__(self):
        check_split_launch(self)
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {self.merge!r}")


def device_sms() -> int:
    """The default device's SM count (GPU devices report it), else the H200's."""
    return getattr(jax.devices()[0], "core_count", None) or NUM_SMS_H200


def auto_splits(batch: int, kv_heads: int, slots: int, block_s: int, sms: int = NUM_SMS_H200) -> int:
    """Splits per (row, KV head) so the grid has about two programs per SM, and at most one split per
    block of the cache (a row's own blocks are shared out among the splits at run time, by its length)."""
    return max(1, min(-(-2 * sms // (batch * kv_heads)), slots // block_s))


def ragged_attention(q, k, v, lengths, counts, config: RaggedAttentionConfig = RaggedAttentionConfig()):
    """Ragged attention through the kernel (as `ragged_attention_reference`). Raises NotImplementedError
    where the kernel does not apply (shape or backend). A row with counts 0 answers its queries from its
    committed slots alone."""
    check_shapes(q, k, v, lengths, counts)
    b, kvh, s, d = k.shape
    if s % config.block_s:
        raise NotImplementedError(f"block_s {config.block_s} does not divide the cache's {s} slots")
    if not pow2(d):
        raise NotImplementedError(f"the kernel tiles power-of-two head dims, got {d}")
    t, group = q.shape[1], q.shape[2] // kvh
    if query_rows(t, group) > MAX_ROWS:
        raise NotImplementedError(f"{t} tokens x {group} heads per KV head need {query_rows(t, group)} query rows "
                                  f"in one program; the kernel holds at most {MAX_ROWS}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")
    splits = min(config.splits or auto_splits(b, kvh, s, config.block_s, device_sms()), s // config.block_s)
    return ragged_attention_pallas(q, k, v, lengths, counts, block_s=config.block_s, splits=splits,
                                   num_warps=config.num_warps, num_stages=config.num_stages,
                                   merge=config.merge, interpret=config.interpret)
