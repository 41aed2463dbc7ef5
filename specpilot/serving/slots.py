"""The engine's device side: S request slots over one preallocated target state and drafter context.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from specpilot.decoding.aot import CompileCache
from specpilot.decoding.rejection import accept_greedy, accept_sampled_uniform, accept_uniforms
from specpilot.decoding.sampling import RequestSampling, sample_uniform
from specpilot.serving import budget as bd
from specpilot.serving.packed import packed_forward, stream_forward, write_stream
from specpilot.serving.pages import PageLayout, init_paged_state
from specpilot.state import RecurrentState, TargetState, chain_forward, fed_forward, with_pages, without_pages


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """What is static about an engine (a jit static argument; hashable)."""

    target: Any
    drafter: Any  # None for AR (block_size 1)
    block_size: int  # 1: AR; >= 2: a drafted chain verified per step
    context_len: int  # the most positions (prompt + new tokens) one request may use
    prefill_chunk: int  # the most prompt tokens one row feeds per engine step
    top_k: int = 0  # static sampling filter (0: off)
    draft_budget: str = "fixed"  # fixed: block_size - 1 drafts per row; confidence: chosen per row and step
    verify: str = "padded"  # padded: every row's full block; packed: kept candidates only, one stream
    token_budget: int = 0  # verification tokens per step over the batch (the packed stream's size)
    cost: bd.StepCost = bd.StepCost()  # step time of a token count (the confidence chooser's denominator)
    overlap: str = "none"  # none: draft and verify every row per step; halves: `serving.overlap`
    stream_sizes: tuple[int, ...] = ()  # packed: the stream sizes a step may run (ascending, the last = budget)

    @property
    def max_len(self) -> int:
        """Slots per row: the context plus the widest forward's writes (see Capacity)."""
        return self.context_len + max(self.prefill_chunk, self.block_size)

    @property
    def uses_drafter(self) -> bool:
        return self.block_size > 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    target_state: TargetState
    draft_state: Any  # the drafter's context rows (None for AR)
    last: jax.Array  # [S] int32 newest emitted token, at position target_state.lengths, not cached yet
    n_out: jax.Array  # [S] int32 tokens emitted so far (AR's key index)
    key: jax.Array  # [S, 2] uint32 key data: AR's base key, the chain loop's running key
    pages: jax.Array | None = None  # [S, pages_per_row] int32 page table of paged K/V (None: contiguous)

    def target_view(self) -> TargetState:
        """The target state as a forward reads it (paged layers with the page table in)."""
        return with_pages(self.target_state, self.pages)


def init_slots(setup: EngineSetup, draft_params, slots: int, layout: PageLayout | None = None) -> SlotState:
    """Empty slots; `layout`: the target's K/V in a pool of pages (`serving.pages`), no page allocated."""
    target = setup.target
    if layout is None:
        ts, pages = target.init_state(slots, setup.max_len, target.dtype), None
    else:
        ts = init_paged_state(target, slots, layout)
        pages = jnp.full((slots, layout.pages_per_row), layout.num_pages, jnp.int32)
    ds = (setup.drafter.init_state(draft_params, slots, setup.max_len, target.dtype)
          if setup.uses_drafter else None)
    # separate buffers: the state is donated, and one buffer may not be donated twice
    return SlotState(ts, ds, jnp.zeros((slots,), jnp.int32),
                     jnp.zeros((slots,), jnp.int32), jnp.zeros((slots, 2), jnp.uint32), pages)


def reset_rows(x, mask: jax.Array):
    """Rows where mask [S] holds start empty: a TargetState's length 0 and zero recurrent state (K/V
    stay, hidden by the length); any other state's leaves (a replaying drafter's lengths) zeroed."""
    def where(a):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), jnp.zeros_like(a), a)

    if isinstance(x, TargetState):
        layers = tuple(dataclasses.replace(layer, conv=where(layer.conv), matrix=where(layer.matrix))
                       if isinstance(layer, RecurrentState) else layer for layer in x.layers)
        return TargetState(layers, where(x.lengths))
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(reset_rows(i, mask) for i in x)
    return jax.tree.map(where, x)


def reset_slots(setup: EngineSetup, state: SlotState, mask: jax.Array, seeds: jax.Array) -> SlotState:
    """mask [S] bool: the slots taking a new request; seeds [S] int32 their PRNG seeds."""
    keys = jax.random.key_data(jax.vmap(jax.random.key)(seeds))
    ds = None if state.draft_state is None else reset_rows(state.draft_state, mask)
    return SlotState(reset_rows(state.target_state, mask), ds, jnp.where(mask, 0, state.last),
                     jnp.where(mask, 0, state.n_out), jnp.where(mask[:, None], keys, state.key), state.pages)


# --------------------------------------------------------------------------------------------------
# Per-row sampling: row b draws as a batch of one with its own key


def sample_rows(keys: jax.Array, logits: jax.Array, sampling: RequestSampling) -> jax.Array:
    """keys [S] (typed), logits [S, ..., V] -> tokens [S, ...] int32. Row b's uniforms are those of a
    batch of one with its own key; the draw itself is batched (no per-row branches under vmap)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    u = jax.vmap(lambda k: jax.random.uniform(k, (1,) + logits.shape[1:-1], jnp.float32)[0])(keys)
    return sample_uniform(u, logits, sampling)


def verify_rows(keys, drafts, draft_logits, target_logits, sampling: RequestSampling, kept):
    """Chain verification row by row of each row's first kept [S] drafts -> (n_accepted [S], next_token [S]).
    Row b's uniforms are those of a batch of one with its own key; the accept itself is batched."""
    if sampling.greedy:
        return accept_greedy(drafts, target_logits, kept)
    u, u_next = jax.vmap(lambda k: accept_uniforms(k, 1, drafts.shape[1]))(keys)  # [S, 1, K], [S, 1]
    return accept_sampled_uniform(u[:, 0], u_next[:, 0], drafts, draft_logits, target_logits, sampling, kept)


def split_rows(key_data: jax.Array, sampling: RequestSampling):
    """-> (carried key data [S, 2], subkeys [S] typed); greedy splits nothing (as `spec._split`)."""
    keys = jax.random.wrap_key_data(key_data)
    if sampling.greedy:
        return key_data, keys
    pairs = jax.vmap(jax.random.split)(keys)  # [S, 2]
    return jax.random.key_data(pairs[:, 0]), pairs[:, 1]


def _ar_keys(setup: EngineSetup, key_data: jax.Array, n: jax.Array) -> jax.Array:
    """[S] typed keys of AR token n[b]: split(key, N)[n] for any N > n (partitionable threefry)."""
    cap = setup.context_len
    return jax.vmap(lambda k, i: jax.random.split(k, cap)[jnp.minimum(i, cap - 1)])(
        jax.random.wrap_key_data(key_data), n)


# --------------------------------------------------------------------------------------------------
# Steps


def prefill_chunk(setup: EngineSetup, target_params, draft_params, state: SlotState, tokens: jax.Array,
                  counts: jax.Array, final: jax.Array, sampling: RequestSampling):
    """tokens [S, C] (row b's next counts[b] prompt tokens, right-padded), final [S] bool (its prompt
    ends here) -> (state, first tokens [S]: meaningful where final)."""
    last_logits, taps, ts = fed_forward(setup.target, target_params, tokens, counts, state.target_view())
    ds = state.draft_state
    if setup.uses_drafter:
        ds = setup.drafter.extend(draft_params, target_params, ds, taps, counts)
    if setup.uses_drafter:  # spec.generate: key, key_first = split(key)
        key, first_keys = split_rows(state.key, sampling)
    else:  # ar.generate: token 0 takes split(key, N)[0]
        key, first_keys = state.key, _ar_keys(setup, state.key, jnp.zeros_like(counts))
    first = sample_rows(first_keys, last_logits, sampling)
    state = SlotState(without_pages(ts), ds, jnp.where(final, first, state.last), jnp.where(final, 1, state.n_out),
                      jnp.where(final[:, None], key, state.key), state.pages)
    return state, first


def decode_ar(setup: EngineSetup, target_params, draft_params, state: SlotState, active: jax.Array,
              sampling: RequestSampling):
    """One token for every active row -> (state, tokens [S, 1], emitted [S], verified [S])."""
    del draft_params
    logits, _, ts = chain_forward(setup.target, target_params, state.last[:, None], state.target_view())
    tok = sample_rows(_ar_keys(setup, state.key, state.n_out), logits[:, 0], sampling)
    n_new = active.astype(jnp.int32)
    state = SlotState(without_pages(ts.commit(n_new)), state.draft_state, jnp.where(active, tok, state.last),
                      state.n_out + n_new, state.key, state.pages)
    return state, tok[:, None], n_new, n_new


def draft_counts(setup: EngineSetup, draft_logits: jax.Array, active: jax.Array) -> jax.Array:
    """[S] drafts each row verifies this step: block_size - 1, or chosen from the drafter's confidence."""
    if setup.draft_budget == "confidence":
        return bd.choose_draft_lengths(bd.confidence_of(draft_logits), active, setup.token_budget, setup.cost,
                                       setup.stream_sizes)
    return jnp.where(active, setup.block_size - 1, 0).astype(jnp.int32)


def draft_rows(setup: EngineSetup, target_params, draft_params, state: SlotState, active: jax.Array,
               sampling: RequestSampling):
    """Draft Bs-1 tokens for every row from its committed state -> (state with the drafter's scratch
    written and the active rows' keys advanced, drafts [S, Bs-1], draft logits [S, Bs-1, V])."""
    key, draft_keys = split_rows(state.key, sampling)
    draft_logits, ds = setup.drafter.propose(draft_params, target_params, state.draft_state, state.last,
                                             setup.block_size)
    drafts = sample_rows(draft_keys, draft_logits, sampling)  # [S, Bs-1]
    state = dataclasses.replace(state, draft_state=ds, key=jnp.where(active[:, None], key, state.key))
    return state, drafts, draft_logits


def packed_verify(setup: EngineSetup, target_params, block: jax.Array, verified: jax.Array, ts):
    """The packed verify forward on the smallest stream size holding the verified tokens: one branch of a
    switch runs, so the products see that many tokens, not the whole budget. The branches only read the
    cache; its K/V are written after the switch (a branch that wrote would copy the cache)."""
    sizes = setup.stream_sizes or (setup.token_budget,)
    if len(sizes) == 1:
        return packed_forward(setup.target, target_params, block, verified, ts, sizes[0])

    def branch(n):
        def run(tp, b, c, state):
            logits, taps, new = stream_forward(setup.target, tp, b, c, state, n)
            pad = lambda x: jnp.pad(x, ((0, sizes[-1] - n),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
            return logits, taps, [(pad(k), pad(v)) for k, v in new]
        return run

    logits, taps, new = jax.lax.switch(bd.stream_index(jnp.sum(verified), sizes), [branch(n) for n in sizes],
                                       target_params, block, verified, ts)
    return logits, taps, write_stream(ts, new, verified)


def verify_drafts(setup: EngineSetup, target_params, draft_params, state: SlotState, drafts: jax.Array,
                  draft_logits: jax.Array, active: jax.Array, sampling: RequestSampling):
    """Verify [last, first kept[b] drafts] in one forward, accept a prefix + one token, for every active
    row -> (state, emitted tokens [S, Bs] (the first emitted[b] are new), emitted [S], verified [S]:
    tokens each row sent to verification)."""
    bs = setup.block_size
    block = jnp.concatenate([state.last[:, None], drafts], axis=1)  # [S, Bs]
    kept = draft_counts(setup, draft_logits, active)  # [S]
    verified = jnp.where(active, kept + 1, 0)
    if setup.verify == "packed":
        target_logits, taps, ts = packed_verify(setup, target_params, block, verified, state.target_state)
    else:
        target_logits, taps, ts = chain_forward(setup.target, target_params, block, state.target_view())
    key, verify_keys = split_rows(state.key, sampling)
    n_acc, next_token = verify_rows(verify_keys, drafts, draft_logits, target_logits, sampling, kept)
    n_new = jnp.where(active, n_acc + 1, 0)
    idx = jnp.arange(bs, dtype=jnp.int32)[None, :]
    emit = jnp.where(idx < n_acc[:, None], jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                     next_token[:, None])  # [S, Bs]: accepted drafts, then the next token
    ds = setup.drafter.extend(draft_params, target_params, state.draft_state, taps, n_new)
    state = SlotState(without_pages(ts.commit(n_new)), ds, jnp.where(active, next_token, state.last),
                      state.n_out + n_new, jnp.where(active[:, None], key, state.key), state.pages)
    return state, emit, n_new, verified


def decode_chain(setup: EngineSetup, target_params, draft_params, state: SlotState, active: jax.Array,
                 sampling: RequestSampling):
    """Draft, then verify and accept, every active row (`draft_rows`, `verify_drafts`) -> (state, emitted
    tokens [S, Bs], emitted [S], verified [S])."""
    state, drafts, draft_logits = draft_rows(setup, target_params, draft_params, state, active, sampling)
    return verify_drafts(setup, target_params, draft_params, state, drafts, draft_logits, active, sampling)


_jit = functools.partial(jax.jit, static_argnums=0, donate_argnames=("state",))
reset_jit = _jit(reset_slots)
prefill_jit = _jit(prefill_chunk)
decode_ar_jit = _jit(decode_ar)
decode_chain_jit = _jit(decode_chain)
set_rows_jit = jax.jit(lambda table, mask, rows: jnp.where(mask[:, None], rows, table), donate_argnums=0)

CACHE = CompileCache(max_size=512)


def compiled(fn, static, *args):
    """The ahead-of-time executable of `fn` for these argument shapes (shared by engines alike)."""
    if static is None:
        return CACHE.get(fn, None, args, lambda *a: fn.lower(*a))
    return CACHE.get(fn, static, args, lambda *a: fn.lower(static, *a))
