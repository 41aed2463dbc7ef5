"""Preallocated KV cache, written by position, committed by length.

Design choices (gpt-fast style):
- One `[B, S, KVH, D]` array per layer for K and for V, so a jitted step with the cache donated
  updates each in place; a tuple of per-layer arrays rather than one stacked array keeps XLA from
  materializing per-layer slices.
- `lengths[b]` counts committed positions of sequence b. A step writes its T tokens at positions
  `lengths[b] .. lengths[b]+T-1` without committing them; the caller commits the accepted ones with
  `commit`. Rejected draft positions are never copied or cleared: the attention mask hides every
  position at or past the query's own, and the next step overwrites them.
- Capacity is checked on the host before a jitted call (`check_capacity`): `dynamic_update_slice`
  would otherwise clamp an out-of-range write silently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


class CacheOverflowError(ValueError):
    """A write would run past the cache's preallocated length."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple[jax.Array, ...]  # L x [B, S, KVH, D]
    v: tuple[jax.Array, ...]  # L x [B, S, KVH, D]
    lengths: jax.Array  # [B] int32, committed positions per sequence

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    def commit(self, n: jax.Array | int) -> "KVCache":
        """Advance committed lengths by n (scalar or [B]) — the only way positions become visible."""
        return dataclasses.replace(self, lengths=self.lengths + jnp.asarray(n, jnp.int32))

    def with_lengths(self, lengths: jax.Array) -> "KVCache":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))


def init_cache(cfg, batch_size: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"cache needs positive batch_size and max_len, got {batch_size}, {max_len}")
    shape = (batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   lengths=jnp.zeros((batch_size,), jnp.int32))


def check_capacity(max_len: int, needed: int, what: str = "sequence") -> None:
    """Raise a clear error on the host when `needed` positions exceed the cache length."""
    if needed > max_len:
        raise CacheOverflowError(
            f"{what} needs {needed} cache positions but the cache holds {max_len}; "
            f"use a larger cache (max_len) or a shorter prompt / fewer new tokens")


def write_positions(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new[b] ([T, ...]) into buf[b] at positions start[b] .. start[b]+T-1."""
    # buf: [B, S, KVH, D]; new: [B, T, KVH, D]; start: [B]
    def one(b, n, s):
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (s, 0, 0))
    return jax.vmap(one)(buf, new, start)
