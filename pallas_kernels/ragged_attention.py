"""Ragged attention: each row's queries read only that row's committed K/V and its own new tokens (row b:
`lengths[b]` committed slots, `counts[b]` new ones), as a Pallas Triton-backend kernel with an online
softmax, and its pure-jnp reference over the whole cache. Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common import pow2
from pallas_kernels.tree_attention import float32_products

MIN_ROWS = 16  # tl.dot's smallest M
# the most query rows (T x heads per KV head, padded) one program holds: on the H200 a prompt chunk's
# 2048 rows asked for 1.06 MB of shared memory (232 KB there); 256 rows is a 64-token verification at 4
# heads per KV head. Longer chunks (prefill) go to the reference.
MAX_ROWS = 256
NEG = -1e30  # the online softmax's starting max: finite, so exp(NEG - NEG) = 1 where nothing is seen yet


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

def _kernel(lengths_ref, counts_ref, q_ref, k_ref, v_ref, o_ref, *, block_s: int, group: int, scale: float):
    # lengths_ref, counts_ref: [B] int32; q_ref: [R, D] (row r = token r // group, head r % group of this
    # KV head; rows past T * group are padding); k_ref, v_ref: [S, D] this row's KV head; o_ref: [R, D]
    b = pl.program_id(0)
    length, count = lengths_ref[b], counts_ref[b]
    rows = q_ref.shape[0]
    q = q_ref[...].astype(jnp.float32) * scale  # [R, D]
    token = jax.lax.broadcasted_iota(jnp.int32, (rows, block_s), 0) // group
    limit = length + jnp.minimum(token + 1, count)  # [R, BS]
    offsets = jax.lax.broadcasted_iota(jnp.int32, (rows, block_s), 1)

    def body(j, carry):
        m, l, acc = carry  # [R], [R], [R, D] float32
        start = pl.multiple_of(j * block_s, block_s)
        keys = k_ref[pl.ds(start, block_s), :].astype(jnp.float32)  # [BS, D]
        values = v_ref[pl.ds(start, block_s), :].astype(jnp.float32)
        s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = jnp.where(start + offsets < limit, s, -jnp.inf)  # [R, BS]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = alpha[:, None] * acc + jnp.dot(p, values, preferred_element_type=jnp.float32)
        return m_new, alpha * l + jnp.sum(p, axis=1), acc

    num_blocks = (length + count + block_s - 1) // block_s  # this row's blocks only
    init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, q_ref.shape[1]), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "num_warps", "num_stages", "interpret"))
def ragged_attention_pallas(q, k, v, lengths, counts, *, block_s: int = 64, num_warps: int = 4,
                            num_stages: int = 1, interpret: bool = False):
    """The pallas_call (same arguments and result as `ragged_attention_reference`)."""
    b, t, h, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    group = h // kvh
    rows = query_rows(t, group)
    qg = q.reshape(b, t, kvh, group, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, t * group, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - t * group), (0, 0)))  # [B, KVH, R, D]
    per_head = pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0))
    cache = pl.BlockSpec((None, None, s, d), lambda i, j: (i, j, 0, 0))
    scalars = pl.BlockSpec((b,), lambda i, j: (0,))
    out = pl.pallas_call(
        functools.partial(_kernel, block_s=block_s, group=group, scale=1.0 / float(np.sqrt(d))),
        grid=(b, kvh),
        in_specs=[scalars, scalars, per_head, cache, cache],
        out_specs=per_head,
        out_shape=jax.ShapeDtypeStruct((b, kvh, rows, d), q.dtype),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(lengths.astype(jnp.int32), counts.astype(jnp.int32), qg, k, v)
    out = out[:, :, : t * group].reshape(b, kvh, t, group, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d)


# ---- public API ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RaggedAttentionConfig:
    """The Triton-backend kernel's settings: slots per key block (`block_s`, a power of two dividing the
    cache length), the launch's warps and pipeline stages, and interpret (Pallas' interpreter: CPU
    tests; False on a CPU backend falls through to the reference)."""

    block_s: int = 64
    num_warps: int = 4
    num_stages: int = 1
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_s", "num_warps"):
            value = getattr(self, name)
            if not (isinstance(value, int) and pow2(value)):
                raise ValueError(f"{name} must be a power of two, got {value!r}")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"num_stages must be a positive integer, got {self.num_stages!r}")


def ragged_attention(q, k, v, lengths, counts, config: RaggedAttentionConfig = RaggedAttentionConfig()):
    """Ragged attention through the kernel (as `ragged_attention_reference`). Raises NotImplementedError
    where the kernel does not apply (shape or backend). counts must be >= 1 (a row feeding nothing has
    no query to answer)."""
    check_shapes(q, k, v, lengths, counts)
    s, d = k.shape[2], k.shape[3]
    if s % config.block_s:
        raise NotImplementedError(f"block_s {config.block_s} does not divide the cache's {s} slots")
    if not pow2(d):
        raise NotImplementedError(f"the kernel tiles power-of-two head dims, got {d}")
    t, group = q.shape[1], q.shape[2] // k.shape[1]
    if query_rows(t, group) > MAX_ROWS:
        raise NotImplementedError(f"{t} tokens x {group} heads per KV head need {query_rows(t, group)} query rows "
                                  f"in one program; the kernel holds at most {MAX_ROWS}")
    backend = jax.default_backend()
    if not config.interpret and backend != "gpu":
        raise NotImplementedError(f"the Triton-backend kernel runs on GPUs (or interpreted), not {backend!r}")
    return ragged_attention_pallas(q, k, v, lengths, counts, block_s=config.block_s, num_warps=config.num_warps,
                                   num_stages=config.num_stages, interpret=config.interpret)
