"""Packed verification: only each row's kept candidates enter the verify forward, in one token stream.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_attention import float32_products
from specpilot.models import dense
from specpilot.models.layers import cache_attention, rms_norm, rope_tables
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


@dataclasses.dataclass(frozen=True)
class _RowKV:
    """One layer's K/V `[S_rows, KVH, max_len, D]` seen from the packed stream: `write` scatters the packed
    tokens' K/V ([1, N, KVH, D]) to slots `slots [N]` of rows `rows [N]` (max_len for idle tokens: dropped);
    `attend` runs attention by row (`index [S, T]`: row b's token t's place in the stream)."""

    k: jax.Array
    v: jax.Array
    rows: jax.Array
    offsets: jax.Array
    slots: jax.Array
    index: jax.Array
    lengths: jax.Array

    def write(self, k: jax.Array, v: jax.Array, start) -> "_RowKV":
        del start  # the destinations are per token
        put = lambda buf, new: buf.at[self.rows, :, self.slots].set(new[0].astype(buf.dtype), mode="drop")  # noqa: E731
        return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))

    def attend(self, q: jax.Array, chain) -> jax.Array:
        """q [1, N, H, D] -> [1, N, H, D]: each row's queries over its committed slots and its earlier
        candidates (the padded chain forward's attention, through `chain`, `kernels.attention`'s choice)."""
        rows_q = q[0][self.index]  # [S, T, H, D]; queries past a row's count are filler
        positions = self.lengths[:, None] + jnp.arange(rows_q.shape[1], dtype=jnp.int32)[None, :]
        mask = jnp.arange(self.k.shape[2], dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
        out = cache_attention(rows_q, AttentionState(self.k, self.v), self.lengths, mask, chain=chain)
        return out[self.rows, self.offsets][None]


@dataclasses.dataclass(frozen=True)
class _StreamKV:
    """One layer's K/V seen from the packed stream: the committed cache `[S, KVH, max_len, D]`, read only,
    and the stream's own new K/V ([N, KVH, D], set by `write`). `attend` runs attention by row (`index
    [S, T]`: row b's token t's place in the stream) over both, so the cache is written once, after the
    forward (`write_stream`), and a switch over stream sizes never copies it."""

    k: jax.Array
    v: jax.Array
    rows: jax.Array
    offsets: jax.Array
    index: jax.Array
    lengths: jax.Array
    new_k: jax.Array | None = None
    new_v: jax.Array | None = None

    def write(self, k: jax.Array, v: jax.Array, start) -> "_StreamKV":
        del start  # the stream's K/V enter the cache after the forward
        return dataclasses.replace(self, new_k=k[0].astype(self.k.dtype), new_v=v[0].astype(self.v.dtype))

    def attend(self, q: jax.Array, chain) -> jax.Array:
        """q [1, N, H, D] -> [1, N, H, D]: each row's queries over its committed slots and its earlier
        candidates: the padded chain forward's attention (`layers.attention`), its keys in two parts."""
        del chain  # the two-part attention is XLA's
        rows_q = q[0][self.index]  # [S, T, H, D]; queries past a row's count are filler
        s, t, h, d = rows_q.shape
        kvh = self.k.shape[1]
        qg = rows_q.reshape(s, t, kvh, h // kvh, d)
        kb = jnp.swapaxes(self.new_k[self.index], 1, 2).astype(q.dtype)  # [S, KVH, T, D]
        vb = jnp.swapaxes(self.new_v[self.index], 1, 2).astype(q.dtype)
        committed = jnp.arange(self.k.shape[2], dtype=jnp.int32)[None, :] < self.lengths[:, None]  # [S, L]
        causal = jnp.tril(jnp.ones((t, t), bool))
        scale = 1.0 / np.sqrt(d)
        sc = float32_products("btkgd,bksd->bkgts", qg, self.k.astype(q.dtype)) * scale
        sb = float32_products("btkgd,bksd->bkgts", qg, kb) * scale
        sc = jnp.where(committed[:, None, None, None, :], sc, -jnp.inf)
        sb = jnp.where(causal[None, None, None], sb, -jnp.inf)
        probs = jax.nn.softmax(jnp.concatenate([sc, sb], axis=-1), axis=-1).astype(q.dtype)
        out = (float32_products("bkgts,bksd->btkgd", probs[..., : sc.shape[-1]], self.v.astype(q.dtype))
               + float32_products("bkgts,bksd->btkgd", probs[..., sc.shape[-1]:], vb))
        out = out.reshape(s, t, h, d).astype(q.dtype)
        return out[self.rows, self.offsets][None]


def check_packable(target) -> None:
    if type(target) is not dense.Target:
        raise NotImplementedError(f"batching.verify: packed verification runs dense targets; "
                                  f"{type(target).__module__}.{type(target).__name__} needs verify: padded")
    if target.mesh is not None:
        raise NotImplementedError("batching.verify: packed verification runs on one device; a sharded "
                                  "plan needs verify: padded")


def _stream_layers(target, params, block: jax.Array, counts: jax.Array, state: TargetState, n: int, view_of):
    """The packed forward's body: the stream's tokens through every layer, each layer's K/V seen through
    `view_of(kv, rows, offsets, slots, index)` -> (logits [S, T, V] float32, taps [S, T, n_taps*H], the
    layers' views after their layer)."""
    cfg = target.cfg
    t = block.shape[1]
    rows, offsets, valid, starts = packed_layout(counts, n)
    tokens = jnp.where(valid, block[rows, jnp.minimum(offsets, t - 1)], 0)  # [N]
    positions = state.lengths[rows] + offsets  # [N]
    slots = jnp.where(valid, positions, state.max_len)  # idle tokens write nowhere
    index = jnp.minimum(starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], n - 1)  # [S, T]
    cos, sin = rope_tables(positions[None], cfg.inv_freq())
    x = dense.embed(params, tokens[None])  # [1, N, H]
    views, taps = [], []
    for i, p in enumerate(params["layers"]):
        x, view = dense.decoder_layer(p, cfg, x, cos, sin, view_of(state.layers[i], rows, offsets, slots, index),
                                      None, None)
        views.append(view)
        if i in cfg.tap_layers:
            taps.append(x)
    taps = jnp.concatenate(taps, axis=-1) if taps else jnp.zeros((1, n, 0), x.dtype)
    logits = dense.lm_head(params, cfg, rms_norm(x, params["final_norm"], cfg.rms_norm_eps))  # [1, N, V]
    return logits[0][index], taps[0][index], views


def stream_forward(target, params, block: jax.Array, counts: jax.Array, state: TargetState, n: int):
    """block [S, T] (row b's first counts[b] tokens are its candidates), counts [S] (sum <= n) -> (logits
    [S, T, V] float32, taps [S, T, n_taps*H], the stream's new K/V per layer: ([N, KVH, D], [N, KVH, D])).
    The state is only read. At j < counts[b] the logits are the padded forward's."""
    def view_of(kv, rows, offsets, slots, index):
        return _StreamKV(kv.k, kv.v, rows, offsets, index, state.lengths)

    logits, taps, views = _stream_layers(target, params, block, counts, state, n, view_of)
    return logits, taps, [(v.new_k, v.new_v) for v in views]


def write_stream(state: TargetState, new, counts: jax.Array) -> TargetState:
    """The stream's new K/V (per layer [N, KVH, D], N >= sum(counts)) written at slots lengths[b] ..
    lengths[b]+counts[b]-1 of their rows (uncommitted); tokens past the counts write nowhere."""
    n = new[0][0].shape[0] if new else 0
    rows, offsets, valid, _ = packed_layout(counts, n)
    slots = jnp.where(valid, state.lengths[rows] + offsets, state.max_len)
    put = lambda buf, x: buf.at[rows, :, slots].set(x.astype(buf.dtype), mode="drop")  # noqa: E731
    layers = tuple(AttentionState(put(kv.k, k), put(kv.v, v)) for kv, (k, v) in zip(state.layers, new))
    return TargetState(layers, state.lengths)


def packed_forward(target, params, block: jax.Array, counts: jax.Array, state: TargetState, n: int):
    """block [S, T] (row b's first counts[b] tokens are its candidates), counts [S] (sum <= n) ->
    (logits [S, T, V] float32, taps [S, T, n_taps*H], state with K/V written at slots lengths[b] ..
    lengths[b]+counts[b]-1, uncommitted). At j < counts[b] the logits are the padded forward's. Each layer
    writes its K/V before attending (in place: `stream_forward` with `write_stream` after it would copy
    the cache, as nothing orders the writes after its reads)."""
    def view_of(kv, rows, offsets, slots, index):
        return _RowKV(kv.k, kv.v, rows, offsets, slots, index, state.lengths)

    logits, taps, views = _stream_layers(target, params, block, counts, state, n, view_of)
    return logits, taps, TargetState(tuple(AttentionState(v.k, v.v) for v in views), state.lengths)
