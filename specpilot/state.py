"""Per-layer decoding state: attention K/V written by slot (`AttentionState`, or in pages of a shared pool
through a page table, `PagedAttentionState`), recurrent state with per-token snapshots (`RecurrentState`),
and `TargetState` with the committed lengths, where committing (`commit`, `gather_path`) is the only way
tokens become visible; plus the masks and capacity checks of chains, prompts and trees. Design notes:
docs/design/models.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


class CacheOverflowError(ValueError):
    """A write would run past the state's preallocated length."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionState:
    """One attention layer's K/V by slot, heads before slots."""

    k: jax.Array  # [B, KVH, S, D]
    v: jax.Array  # [B, KVH, S, D]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, k: jax.Array, v: jax.Array, start: jax.Array) -> "AttentionState":
        """k, v [B, T, KVH, D] (a forward's new tokens) written at slots start[b] .. start[b]+T-1."""
        return AttentionState(write_slots(self.k, k, start), write_slots(self.v, v, start))

    def gather_path(self, start: jax.Array, path: jax.Array, count: jax.Array) -> "AttentionState":
        """Row b's slots start[b] + path[b, i] (i < count[b]) moved to start[b] + i."""
        return AttentionState(_gather_slots(self.k, start, path, count),
                              _gather_slots(self.v, start, path, count))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentState:
    """One recurrent layer (e.g. Gated DeltaNet): short-convolution and matrix state, with the
    per-token snapshots a T-token forward writes (snapshot t = the state after token t)."""

    conv: jax.Array  # [B, W-1, C] the last W-1 inputs of the causal convolution
    matrix: jax.Array  # [B, NH, DK, DV]
    conv_snapshots: jax.Array  # [B, T, W-1, C]
    matrix_snapshots: jax.Array  # [B, T, NH, DK, DV]

    @property
    def max_snapshots(self) -> int:
        return self.conv_snapshots.shape[1]

    def write_snapshots(self, conv: jax.Array, matrix: jax.Array) -> "RecurrentState":
        """conv [B, T', W-1, C], matrix [B, T', NH, DK, DV] (T' <= max_snapshots) into snapshots 0..T'-1."""
        if conv.shape[1] > self.max_snapshots or matrix.shape[1] != conv.shape[1]:
            raise ValueError(f"{conv.shape[1]} conv / {matrix.shape[1]} matrix snapshots for a state "
                             f"holding {self.max_snapshots}")
        return dataclasses.replace(
            self,
            conv_snapshots=jax.lax.dynamic_update_slice_in_dim(
                self.conv_snapshots, conv.astype(self.conv_snapshots.dtype), 0, axis=1),
            matrix_snapshots=jax.lax.dynamic_update_slice_in_dim(
                self.matrix_snapshots, matrix.astype(self.matrix_snapshots.dtype), 0, axis=1))

    def select_snapshot(self, index: jax.Array | int) -> "RecurrentState":
        """Row b's state becomes its snapshot index[b] (scalar or [B]); index[b] < 0 keeps the state
        (a row that consumed no token)."""
        b = self.conv.shape[0]
        index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))
        keep = index < 0
        safe = jnp.clip(index, 0, self.max_snapshots - 1)

        def pick(current, snaps):
            chosen = jnp.take_along_axis(snaps, safe.reshape((b, 1) + (1,) * (snaps.ndim - 2)), axis=1)[:, 0]
            return jnp.where(keep.reshape((b,) + (1,) * (current.ndim - 1)), current, chosen)

        return dataclasses.replace(self, conv=pick(self.conv, self.conv_snapshots),
                                   matrix=pick(self.matrix, self.matrix_snapshots))


@dataclasses.dataclass(frozen=True)
class PagedAttentionState:
    """One attention layer's K/V in a pool of pages shared by the rows: row b's slot s lives in page
    pages[b, s // page_size] at offset s % page_size. A page index >= the pool's size means no page: a
    write there is dropped and a read gives zeros (the mask hides it). `pages` is None where the state is
    stored apart from its page table (`with_pages` puts it in for a forward)."""

    k: jax.Array  # [P, KVH, page_size, D]
    v: jax.Array  # [P, KVH, page_size, D]
    pages: jax.Array | None  # [B, pages_per_row] int32
    pages_per_row: int  # static

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def columns(self) -> int:
        """Pages per row the table in hand addresses: pages_per_row, or fewer where a step was given the
        first columns of the table (a window holding every row's pages: `serving.pages.PagedKV.window`)."""
        return self.pages_per_row if self.pages is None else int(self.pages.shape[1])

    @property
    def max_len(self) -> int:
        """Slots per row the page table can address."""
        return self.columns * self.page_size

    def _where(self, slots: jax.Array):
        """slots [B, T] -> (page [B, T], offset [B, T]) in the pool (page >= P: none)."""
        block = slots // self.page_size
        page = jnp.take_along_axis(self.pages, jnp.clip(block, 0, self.columns - 1), axis=1)
        page = jnp.where((block >= 0) & (block < self.columns), page, self.k.shape[0])
        return page, slots % self.page_size

    def write(self, k: jax.Array, v: jax.Array, start: jax.Array) -> "PagedAttentionState":
        """k, v [B, T, KVH, D] written at row b's slots start[b] .. start[b]+T-1 (into their pages)."""
        slots = start[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
        page, offset = self._where(slots)

        def put(pool, new):  # indexed as [B, T, KVH, D]: two advanced indices around a slice
            return pool.at[page, :, offset].set(new.astype(pool.dtype), mode="drop")
        return PagedAttentionState(put(self.k, k), put(self.v, v), self.pages, self.pages_per_row)

    def gather(self) -> AttentionState:
        """Every row's pages as one contiguous cache [B, KVH, max_len, D] (what attention reads)."""
        def view(pool):
            rows = jnp.take(pool, self.pages, axis=0, mode="fill", fill_value=0)  # [B, pages, KVH, ps, D]
            b, n, kvh, ps, d = rows.shape
            return jnp.swapaxes(rows, 1, 2).reshape(b, kvh, n * ps, d)
        return AttentionState(view(self.k), view(self.v))

    def gather_path(self, start, path, count):
        raise NotImplementedError("batching.kv: paged K/V does not commit tree paths; tree plans need "
                                  "kv: contiguous")


jax.tree_util.register_dataclass(PagedAttentionState, data_fields=["k", "v", "pages"],
                                 meta_fields=["pages_per_row"])

LayerState = AttentionState | PagedAttentionState | RecurrentState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetState:
    """Per-layer states and the committed length of each sequence. The drafter's context cache uses
    the same container (attention layers only)."""

    layers: tuple  # L x (AttentionState | RecurrentState)
    lengths: jax.Array  # [B] int32, committed tokens per sequence

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        """Slots per sequence (that of the attention layers)."""
        for layer in self.layers:
            if isinstance(layer, (AttentionState, PagedAttentionState)):
                return layer.max_len
        raise ValueError("this state has no attention layer, so no slot capacity")

    def commit(self, n: jax.Array | int) -> "TargetState":
        """Commit the first n (scalar or [B]) tokens of the last forward: lengths advance by n and each
        recurrent layer takes its snapshot n-1 (n = 0 keeps its state)."""
        n = jnp.asarray(n, jnp.int32)
        layers = tuple(layer.select_snapshot(n - 1) if isinstance(layer, RecurrentState) else layer
                       for layer in self.layers)
        return TargetState(layers, self.lengths + n)

    def gather_path(self, path: jax.Array, count: jax.Array) -> "TargetState":
        """Commit an accepted tree path. path [B, P] int32: the accepted nodes' slots relative to the
        committed length, root first; count [B]: how many of them (0..P) row b accepted.

        Attention layers move node path[b, i]'s K/V to slot lengths[b] + i; recurrent layers take the
        snapshot of node path[b, count[b]-1]; lengths advance by count. A chain is the path 0..n-1.
        """
        path = jnp.asarray(path, jnp.int32)
        count = jnp.asarray(count, jnp.int32)
        last = jnp.take_along_axis(path, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        last = jnp.where(count > 0, last, -1)
        layers = tuple(
            layer.select_snapshot(last) if isinstance(layer, RecurrentState)
            else layer.gather_path(self.lengths, path, count) for layer in self.layers)
        return TargetState(layers, self.lengths + count)

    def with_lengths(self, lengths: jax.Array) -> "TargetState":
        return dataclasses.replace(self, lengths=jnp.asarray(lengths, jnp.int32))


def init_attention_state(batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                         dtype) -> AttentionState:
    _check_sizes(batch_size, max_len)
    shape = (batch_size, num_kv_heads, max_len, head_dim)
    return AttentionState(jnp.zeros(shape, _required_dtype(dtype)), jnp.zeros(shape, _required_dtype(dtype)))


def init_paged_attention_state(num_pages: int, page_size: int, pages_per_row: int, num_kv_heads: int,
                               head_dim: int, dtype) -> PagedAttentionState:
    """An empty pool of num_pages pages, stored without a page table (`with_pages` adds one)."""
    _check_sizes(num_pages, page_size)
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    return PagedAttentionState(jnp.zeros(shape, _required_dtype(dtype)), jnp.zeros(shape, _required_dtype(dtype)),
                               None, pages_per_row)


def with_pages(state: TargetState, pages: jax.Array | None) -> TargetState:
    """The state with page table `pages` [B, pages_per_row] in each paged layer (None: unchanged)."""
    if pages is None:
        return state
    return TargetState(tuple(PagedAttentionState(layer.k, layer.v, pages, layer.pages_per_row)
                             if isinstance(layer, PagedAttentionState) else layer for layer in state.layers),
                       state.lengths)


def without_pages(state: TargetState) -> TargetState:
    """The state with its paged layers' page table taken out (as stored beside it)."""
    return TargetState(tuple(PagedAttentionState(layer.k, layer.v, None, layer.pages_per_row)
                             if isinstance(layer, PagedAttentionState) else layer for layer in state.layers),
                       state.lengths)


def init_recurrent_state(batch_size: int, conv_width: int, conv_channels: int, num_heads: int,
                         key_dim: int, value_dim: int, max_snapshots: int, dtype,
                         matrix_dtype=jnp.float32) -> RecurrentState:
    """Zero state; `max_snapshots` = the most tokens one forward feeds (a verification block)."""
    _check_sizes(batch_size, max_snapshots)
    if conv_width < 1:
        raise ValueError(f"conv_width must be >= 1, got {conv_width}")
    dtype = _required_dtype(dtype)
    conv = (batch_size, conv_width - 1, conv_channels)
    matrix = (batch_size, num_heads, key_dim, value_dim)
    return RecurrentState(
        conv=jnp.zeros(conv, dtype), matrix=jnp.zeros(matrix, matrix_dtype),
        conv_snapshots=jnp.zeros((batch_size, max_snapshots) + conv[1:], dtype),
        matrix_snapshots=jnp.zeros((batch_size, max_snapshots) + matrix[1:], matrix_dtype))


def _check_sizes(batch_size: int, length: int) -> None:
    if batch_size <= 0 or length <= 0:
        raise ValueError(f"state needs positive batch_size and length, got {batch_size}, {length}")


def _required_dtype(dtype):
    if dtype is None:
        raise ValueError("the state's dtype must be given (the params' activation dtype, e.g. "
                         "params['embed'].dtype): a bf16 default silently truncated float32 models")
    return jnp.dtype(dtype)


def check_capacity(max_len: int, needed: int, what: str = "sequence") -> None:
    """Raise a clear error on the host when `needed` slots exceed the state's length."""
    if needed > max_len:
        raise CacheOverflowError(
            f"{what} needs {needed} cache positions but the cache holds {max_len}; "
            f"use a larger cache (max_len) or a shorter prompt / fewer new tokens")


def write_positions(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new[b] ([T, ...]) into buf[b] at positions start[b] .. start[b]+T-1 (buf [B, S, ...])."""
    def one(b, n, s):
        return jax.lax.dynamic_update_slice(b, n.astype(b.dtype), (s,) + (0,) * (b.ndim - 1))
    return jax.vmap(one)(buf, new, start)


def write_slots(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """An attention cache buf [B, KVH, S, D] with new [B, T, KVH, D] written at slots start[b] ..
    start[b]+T-1 (only the T new rows change layout)."""
    def one(b, n, s):
        return jax.lax.dynamic_update_slice(b, jnp.swapaxes(n, 0, 1).astype(b.dtype), (0, s, 0))
    return jax.vmap(one)(buf, new, start)


def _gather_slots(buf: jax.Array, start: jax.Array, path: jax.Array, count: jax.Array) -> jax.Array:
    """An attention cache buf [B, KVH, S, D] with row b's slots start[b] + path[b, i] moved to start[b] + i
    for i < count[b] (path [B, P] relative slots; later ones are not written: a dropped scatter). Only the
    P moved slots change layout, never the whole cache."""
    b, p = path.shape
    s = buf.shape[2]
    src = jnp.clip(start[:, None] + path, 0, s - 1)  # [B, P]
    rows = jnp.take_along_axis(buf, src[:, None, :, None], axis=2)  # [B, KVH, P, D]
    i = jnp.arange(p, dtype=jnp.int32)[None, :]
    dst = jnp.where(i < count[:, None], start[:, None] + i, s)  # slot s is out of range: dropped
    batch = jnp.broadcast_to(jnp.arange(b)[:, None], (b, p))
    return buf.at[batch, :, dst].set(jnp.swapaxes(rows, 1, 2), mode="drop")  # indexed as [B, P, KVH, D]


# --------------------------------------------------------------------------------------------------
# Positions and masks


def chain_positions(state: TargetState, t: int) -> jax.Array:
    """[B, T] positions (= slots) of T chained tokens after the committed prefix."""
    return state.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def causal_mask(state: TargetState, positions: jax.Array) -> jax.Array:
    """[B, T, S] bool: query t sees every slot up to its own position (chains, slot = position)."""
    slots = jnp.arange(state.max_len, dtype=jnp.int32)
    return slots[None, None, :] <= positions[:, :, None]


def tree_mask(state: TargetState, ancestors: jax.Array) -> jax.Array:
    """[B, T, S] bool for T tree nodes at slots lengths[b] + j: node t sees the committed prefix and
    the nodes j with ancestors[b, t, j] (itself included). ancestors: [B, T, T] bool."""
    b, t, _ = ancestors.shape
    rel = jnp.arange(state.max_len, dtype=jnp.int32)[None, :] - state.lengths[:, None]  # [B, S]
    prefix = rel < 0
    node = jnp.take_along_axis(ancestors, jnp.clip(rel, 0, t - 1)[:, None, :].repeat(t, axis=1), axis=2)
    in_block = (rel >= 0) & (rel < t)
    return prefix[:, None, :] | (in_block[:, None, :] & node)


def prompt_mask(state: TargetState, positions: jax.Array, lengths: jax.Array) -> jax.Array:
    """[B, T, S] bool for right-padded prompts: the causal mask, with every slot at or past the
    committed length + lengths[b] hidden. A prompt token's row is its causal row; padding rows see the
    prompt only, so recurrent layers know each row's own length (the last query sees it)."""
    slots = jnp.arange(state.max_len, dtype=jnp.int32)
    return causal_mask(state, positions) & (slots[None, None, :] < (state.lengths + lengths)[:, None, None])


PREFILL_TOKENS = 4096  # prompt tokens one prefill pass feeds over the whole batch (longer prompts go in chunks)


def prefill_chunk(batch: int, padded_len: int, max_len: int, tokens_per_pass: int = PREFILL_TOKENS) -> int:
    """Prompt tokens a row is fed per prefill pass: the whole padded prompt, or a multiple of 64 near
    tokens_per_pass / batch where that is shorter. A pass's activations and attention scores scale with
    batch x chunk, so chunks bound a large batch of long prompts. A row whose prompt ended writes (never
    commits) a chunk past it, so a chunk also fits the cache's room after the padded prompts."""
    if batch * padded_len <= tokens_per_pass:
        return padded_len
    chunk = min(max(64, tokens_per_pass // batch // 64 * 64), (max_len - padded_len) // 64 * 64)
    return chunk if 64 <= chunk < padded_len else padded_len


def prompt_forward(target, params, tokens: jax.Array, lengths: jax.Array, state: TargetState,
                   tokens_per_pass: int = PREFILL_TOKENS):
    """Prefill: `target.forward` over right-padded prompts [B, T] (row b's first lengths[b] tokens are
    its prompt) -> (logits at each prompt's last token [B, V], taps [B, T, ...], state committed by
    lengths). Padding is written but never committed; the logits are those of `chain_forward` at that
    position. Fed in chunks of `prefill_chunk` tokens a row (one `lax.scan`) where the whole prompt is
    more than `tokens_per_pass` tokens over the batch."""
    b, t = tokens.shape
    has_slots = any(isinstance(x, (AttentionState, PagedAttentionState)) for x in state.layers)
    chunk = prefill_chunk(b, t, state.max_len, tokens_per_pass) if has_slots else t
    if chunk >= t:
        return fed_forward(target, params, tokens, lengths, state)
    n = -(-t // chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)))

    def step(carry, k):
        state, last = carry
        counts = jnp.clip(lengths - k * chunk, 0, chunk)
        logits, taps, state = fed_forward(target, params, jax.lax.dynamic_slice_in_dim(tokens, k * chunk, chunk, 1),
                                          counts, state)
        ends_here = (counts > 0) & (lengths <= (k + 1) * chunk)
        return (state, jnp.where(ends_here[:, None], logits, last)), taps

    last, first_taps, state = fed_forward(target, params, tokens[:, :chunk], jnp.minimum(lengths, chunk), state)
    (state, last), later = jax.lax.scan(step, (state, last), jnp.arange(1, n, dtype=jnp.int32))

    def joined(first, rest):  # [B, chunk, ...] and [n-1, B, chunk, ...] -> [B, T, ...]
        rest = jnp.moveaxis(rest, 0, 1).reshape(b, (n - 1) * chunk, *first.shape[2:])
        return jnp.concatenate([first, rest], axis=1)[:, :t]

    return last, jax.tree_util.tree_map(joined, first_taps, later), state


def fed_forward(target, params, tokens: jax.Array, counts: jax.Array, state: TargetState):
    """One prefill pass: row b feeds the first counts[b] of its tokens [B, C] (the rest is padding, written
    and never committed) -> (logits at each row's last fed token [B, V], taps, state committed by counts).
    A row feeding none (0) takes the causal mask, as its prompt mask would hide every slot of a row with
    nothing committed yet; its logits mean nothing (the serving engine's idle and decoding rows)."""
    positions = chain_positions(state, tokens.shape[1])
    mask = jnp.where((counts > 0)[:, None, None], prompt_mask(state, positions, counts), causal_mask(state, positions))
    logits, taps, state = target.forward(params, tokens, positions, state, mask, logits_at=jnp.maximum(counts - 1, 0))
    return logits[:, 0], taps, state.commit(counts)


def chain_forward(target, params, tokens: jax.Array, state: TargetState):
    """`target.forward` over T chained tokens after the committed prefix: -> (logits, taps, state)."""
    positions = chain_positions(state, tokens.shape[1])
    return target.forward(params, tokens, positions, state, causal_mask(state, positions))
