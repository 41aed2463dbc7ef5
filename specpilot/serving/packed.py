"""Packed verification: only each row's kept candidates enter the verify forward, in one token stream.

Design choices:
- Row b sends counts[b] tokens (its last token and its first kept drafts; 0 for a row not decoding).
  They are packed back to back, without padding, into one `[1, N]` stream whose size N is static (the
  batch's token budget); the tail past sum(counts) is idle (`packed_layout`).
- Each packed token keeps its row's rotary position (the row's committed length plus its offset in
  the row's segment) and writes its K/V into its own row's next slot, as the padded forward does; the
  cache is read flat as one `[1, S_rows x max_len]` sequence under a block-diagonal causal mask
  (`packed_mask`): a token sees its own row's committed slots and its row's earlier candidates only.
  This is the reference of the layout; it reads every row's slots per token (a ragged kernel would
  read only its own), and the flat view moves each layer's cache from the state's heads-before-rows
  layout `[S_rows, KVH, max_len, D]` to `[1, KVH, S_rows x max_len, D]` and back, one copy each way.
- The decoder layers are `dense.decoder_layer` itself over a K/V view (`_PackedKV`) whose write
  scatters to the rows' slots, so the packed and padded forwards share every projection, norm and
  rope. The logits and taps come back unpacked as `[S, T, ...]` (rows past counts[b] are filler the
  caller never accepts), so verification and the drafter's context update are the padded ones.
- Dense single-device targets only: a hybrid target's recurrent layers would need a segmented scan,
  and a sharded state spreads rows over the data axis (the engine refuses both, naming the field).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specpilot.models import dense
from specpilot.models.layers import rms_norm, rope_tables
from specpilot.state import AttentionState, TargetState


def packed_layout(counts: jax.Array, n: int):
    """counts [S] int32 (sum <= n) -> (rows [N], offsets [N], valid [N], starts [S]): packed token i
    is token offsets[i] of row rows[i]'s segment, which starts at starts[row]."""
    ends = jnp.cumsum(counts.astype(jnp.int32))
    starts = ends - counts
    i = jnp.arange(n, dtype=jnp.int32)
    rows = jnp.minimum(jnp.searchsorted(ends, i, side="right"), counts.shape[0] - 1).astype(jnp.int32)
    valid = i < ends[-1]
    offsets = jnp.where(valid, i - starts[rows], 0)
    return rows, offsets, valid, starts


def packed_mask(lengths: jax.Array, max_len: int, rows: jax.Array, positions: jax.Array,
                valid: jax.Array) -> jax.Array:
    """[1, N, S_rows * max_len] bool: packed token i sees flat slot r * max_len + s iff r is its row and
    s <= its position (the row's committed K/V and its earlier candidates). Idle tokens see slot 0."""
    flat = jnp.arange(lengths.shape[0] * max_len, dtype=jnp.int32)
    see = ((flat // max_len)[None, :] == rows[:, None]) & ((flat % max_len)[None, :] <= positions[:, None])
    return jnp.where(valid[:, None], see, (flat == 0)[None, :])[None]


@dataclasses.dataclass(frozen=True)
class _PackedKV:
    """One layer's K/V read flat ([1, KVH, S_rows * max_len, D]); `write` scatters the packed tokens'
    K/V ([1, N, KVH, D]) to their rows' slots `dest [N]` (idle tokens at an out-of-range slot: dropped)."""

    k: jax.Array
    v: jax.Array
    dest: jax.Array

    @classmethod
    def of(cls, kv: AttentionState, dest: jax.Array) -> "_PackedKV":
        flat = lambda a: jnp.swapaxes(a, 0, 1).reshape((1, a.shape[1], -1, a.shape[3]))  # noqa: E731
        return cls(flat(kv.k), flat(kv.v), dest)

    def rows(self, like: AttentionState) -> AttentionState:
        """The flat K/V back in the state's [S_rows, KVH, max_len, D] layout."""
        r, h, s, d = like.k.shape
        back = lambda a: jnp.swapaxes(a.reshape(h, r, s, d), 0, 1)  # noqa: E731
        return AttentionState(back(self.k), back(self.v))

    def write(self, k: jax.Array, v: jax.Array, start) -> "_PackedKV":
        del start  # the destinations are per token
        put = lambda buf, new: buf.at[0, :, self.dest].set(new[0].astype(buf.dtype), mode="drop")  # noqa: E731
        return _PackedKV(put(self.k, k), put(self.v, v), self.dest)


def check_packable(target) -> None:
    if type(target) is not dense.Target:
        raise NotImplementedError(f"batching.verify: packed verification runs dense targets; "
                                  f"{type(target).__module__}.{type(target).__name__} needs verify: padded")
    if target.mesh is not None:
        raise NotImplementedError("batching.verify: packed verification runs on one device; a sharded "
                                  "plan needs verify: padded")


def packed_forward(target, params, block: jax.Array, counts: jax.Array, state: TargetState, n: int):
    """block [S, T] (row b's first counts[b] tokens are its candidates), counts [S] (sum <= n) ->
    (logits [S, T, V] float32, taps [S, T, n_taps*H], state with K/V written at slots lengths[b] ..
    lengths[b]+counts[b]-1, uncommitted). At j < counts[b] the logits are the padded forward's."""
    cfg = target.cfg
    s, t = block.shape
    max_len = state.max_len
    rows, offsets, valid, starts = packed_layout(counts, n)
    tokens = jnp.where(valid, block[rows, jnp.minimum(offsets, t - 1)], 0)  # [N]
    positions = state.lengths[rows] + offsets  # [N]
    dest = jnp.where(valid, rows * max_len + positions, s * max_len)
    mask = packed_mask(state.lengths, max_len, rows, positions, valid)  # [1, N, S * max_len]
    cos, sin = rope_tables(positions[None], cfg.inv_freq())
    x = dense.embed(params, tokens[None])  # [1, N, H]
    layers, taps = [], []
    for i, p in enumerate(params["layers"]):
        kv = state.layers[i]
        x, flat = dense.decoder_layer(p, cfg, x, cos, sin, _PackedKV.of(kv, dest), None, mask)
        layers.append(flat.rows(kv))
        if i in cfg.tap_layers:
            taps.append(x)
    taps = jnp.concatenate(taps, axis=-1) if taps else jnp.zeros((1, n, 0), x.dtype)
    logits = dense.lm_head(params, cfg, rms_norm(x, params["final_norm"], cfg.rms_norm_eps))  # [1, N, V]
    idx = jnp.minimum(starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], n - 1)  # [S, T]
    return logits[0][idx], taps[0][idx], TargetState(tuple(layers), state.lengths)
