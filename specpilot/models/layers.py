"""Shared layers as pure functions: RMSNorm, RoPE, GQA attention over a positional cache, SwiGLU.

Numerics follow the Hugging Face reference: norms, softmax and RoPE tables in float32, matmuls in the
weights' dtype with float32 accumulation, results cast back to the activation dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels import tree_attention as _tree_attention
from specpilot.state import PagedAttentionState


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(dtype)


def linear(x: jax.Array, w, b: jax.Array | None = None, *, choice: dispatch.OpChoice | None = None,
           role: str = "") -> jax.Array:
    """x [..., K] @ w [K, N] with float32 accumulation, result in x's dtype, computed as `choice` says
    (`pallas_kernels.dispatch.matmul`; None: XLA's dot for bf16 arrays, a prepared weight's own kernel).
    `role` names the product ("qkv", "o", "gate_up", "down", "lm_head")."""
    return dispatch.matmul(x, w, b, choice=choice, role=role)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [B, T, D] for integer positions [B, T] (HF rotate_half layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # x: [B, T, N, D]; cos/sin: [B, T, D]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


# Grouped-query attention of T queries over S cached slots: q [B, T, H, D], k, v [B, KVH, S, D], mask
# [B, T, S] bool (True = visible) -> [B, T, H, D]. It lives beside the tree-attention kernel, whose
# reference it is (`pallas_kernels.tree_attention.cache_attention`).
attention = _tree_attention.cache_attention


def cache_attention(q: jax.Array, kv, start: jax.Array | None, mask: jax.Array,
                    parents: jax.Array | None = None, tree: dispatch.OpChoice | None = None,
                    chain: dispatch.OpChoice | None = None) -> jax.Array:
    """q [B, T, H, D]'s attention over an `AttentionState` kv whose slots start[b] .. start[b]+T-1 hold
    the T tokens' own K/V, under mask [B, T, S]. Without a choice for the forward's kind: the masked
    attention over the whole cache (`attention`).

    A tree forward (parents given) goes through `dispatch.tree_attention` with `tree`: the mask's block
    at those slots is the tree's ancestor mask (every mask of `specpilot.state` shows all slots < start
    and none past the block).

    A chain forward (no parents) goes through `dispatch.attention` with `chain`, which takes lengths
    and counts instead of a mask: lengths = start, counts = the slots the last query sees, minus start.
    That describes the mask exactly for the masks chains use (`specpilot.state`): `causal_mask` over
    `chain_positions` lets query t see slots <= start + t (counts = T), and `prompt_mask` adds slots
    < start + lengths[b], so query t sees slots < start + min(t + 1, lengths[b]) (counts = the row's
    prompt tokens in the chunk); both show every slot < start, and the serving engine picks one of the
    two per row. start None keeps the masked attention.

    A K/V view with an `attend(q, chain)` method brings its own layout and attention: packed verification's
    stream (`serving.packed`) attends by row. Paged K/V (`state.PagedAttentionState`) is gathered into a
    contiguous cache first, so every implementation reads it as it reads a preallocated one."""
    attend = getattr(kv, "attend", None)
    if attend is not None:
        return attend(q, chain)
    if isinstance(kv, PagedAttentionState):
        kv = kv.gather()
    if parents is not None:
        if tree is None:
            return attention(q, kv.k.astype(q.dtype), kv.v.astype(q.dtype), mask)
        t = q.shape[1]
        ancestors = jax.vmap(lambda m, s: jax.lax.dynamic_slice_in_dim(m, s, t, axis=1))(mask, start)  # [B, T, T]
        return dispatch.tree_attention(q, kv.k, kv.v, start, ancestors, choice=tree)
    if chain is None or start is None or tuple(chain.implementation) == ("xla",):
        # XLA alone (every plan's default): the mask the state built, not one rebuilt from its counts
        return attention(q, kv.k.astype(q.dtype), kv.v.astype(q.dtype), mask)
    counts = chain_counts(mask, start)
    return dispatch.attention(q, kv.k.astype(q.dtype), kv.v.astype(q.dtype), start, counts, choice=chain)


def chain_counts(mask: jax.Array, start: jax.Array) -> jax.Array:
    """[B] int32: the new tokens a chain mask [B, T, S] shows its last query past start [B] (0..T)."""
    seen = jnp.sum(mask[:, -1, :], axis=-1, dtype=jnp.int32)
    return jnp.clip(seen - start.astype(jnp.int32), 0, mask.shape[1])


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
           biases: tuple | None = None, choice: dispatch.OpChoice | None = None) -> jax.Array:
    bg, bu, bd = biases if biases is not None else (None, None, None)
    g = linear(x, gate, bg, choice=choice, role="gate")
    u = linear(x, up, bu, choice=choice, role="up")
    return linear(jax.nn.silu(g) * u, down, bd, choice=choice, role="down")
