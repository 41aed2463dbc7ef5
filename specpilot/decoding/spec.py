"""Stock speculative decoding: draft a block, verify it in one target forward, accept, commit, repeat.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import TraceAnnotation

from specpilot.decoding.aot import CompileCache
from specpilot.sharding import host_array
from specpilot.decoding.ar import (GenerationResult, check_position_limit, check_stop_token, default_cache_len,
                                   pack_prompts, request_budgets)
from specpilot.decoding.rejection import choose_drafts, verify_chain
from specpilot.decoding.sampling import GREEDY, RequestSampling, SamplingConfig, resolve_key, sample
from specpilot.decoding.stats import SpecStats
from specpilot.state import TargetState, chain_forward, check_capacity, prompt_forward

LOOPS = ("while", "host")
DEFAULT_LOOP = "while"


@dataclasses.dataclass(frozen=True)
class ChainSetup:
    """Everything static about a chain run (hashable: a jit static argument; changing it recompiles)."""

    target: Any  # dense.Target, or any value with the target protocol
    drafter: Any  # BlockDrafter, ReplayDrafter, ... (None only for block_size == 1)
    block_size: int
    max_new_tokens: int  # capacity: the most tokens any request may generate
    stop_token: int | None = None  # a sequence ends right after emitting it (None: budgets only)

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.drafter is None and self.block_size > 1:
            raise ValueError("block_size > 1 needs a drafter")

    @property
    def uses_drafter(self) -> bool:
        return self.block_size > 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
    target_state: TargetState
    draft_state: Any  # the drafter's context state (lengths kept equal to target_state.lengths)
    last: jax.Array  # [B] int32: newest emitted token, at position target_state.lengths, not yet cached
    out: jax.Array  # [B, N + Bs] int32 generated tokens; Bs slack so a step's write never clamps
    n_out: jax.Array  # [B] int32 tokens generated so far (prefill's first token included)
    key: jax.Array
    steps: jax.Array  # [B] int32 verification steps while generating
    emitted: jax.Array  # [B] int32 tokens emitted by verification steps (truncated at the budget)
    accepted: jax.Array  # [B] int32 accepted drafts + 1 per verification step, untruncated
    accept_hist: jax.Array  # [Bs] int32 (sequence, step) pairs with k accepted drafts
    budget: jax.Array  # [B] int32 new tokens per request (<= max_new_tokens)
    sampling: RequestSampling  # per-request temperature / top-p [B]
    stopped: jax.Array  # [B] bool: emitted the stop token (always False without one)


def _active(setup: ChainSetup, state: SpecState) -> jax.Array:
    """[B] bool: still generating (within the budget, no stop token yet), and the next verification's
    Bs writes fit the state."""
    fits = state.target_state.lengths + setup.block_size <= state.target_state.max_len
    return (state.n_out < state.budget) & fits & ~state.stopped


def all_done(setup: ChainSetup, state: SpecState) -> jax.Array:
    return ~jnp.any(_active(setup, state))


def prefill_phase(setup: ChainSetup, target_params, draft_params, tokens: jax.Array, lengths: jax.Array,
                  target_state: TargetState, draft_state, key: jax.Array, budget: jax.Array,
                  sampling: RequestSampling) -> SpecState:
    """Prompt pass: first token from the prompt's last logits, target state and draft context filled."""
    first, target_state, draft_state, key = _prefill_core(
        _prefill_key(setup), target_params, draft_params, tokens, lengths, target_state, draft_state, key,
        sampling)
    return _initial_state(setup, first, target_state, draft_state, key, budget, sampling)


def _split(key: jax.Array, sampling: RequestSampling):
    # Greedy decoding draws nothing: skipping the split keeps PRNG code (slow to compile) out of the step.
    return (key, key) if sampling.greedy else tuple(jax.random.split(key))


def _prefill_key(setup: ChainSetup):
    # What prefill depends on: not the block size or token budget, so a sweep over those shares it.
    return setup.target, setup.drafter if setup.uses_drafter else None


def _prefill_core(static, target_params, draft_params, tokens, lengths, target_state, draft_state, key,
                  sampling):
    target, drafter = static
    key, key_first = _split(key, sampling)
    last_logits, taps, target_state = prompt_forward(target, target_params, tokens, lengths, target_state)
    first = sample(key_first, last_logits, sampling)  # [B]
    if drafter is not None:
        draft_state = drafter.extend(draft_params, target_params, draft_state, taps, lengths)
    return first, target_state, draft_state, key


def _initial_state(setup: ChainSetup, first, target_state, draft_state, key, budget,
                   sampling) -> SpecState:
    b = first.shape[0]
    out = jnp.zeros((b, setup.max_new_tokens + setup.block_size), jnp.int32).at[:, 0].set(first)
    zeros = jnp.zeros((b,), jnp.int32)
    stopped = (jnp.zeros((b,), bool) if setup.stop_token is None
               else first == setup.stop_token)  # prefill's token may already be the stop token
    return SpecState(target_state=target_state, draft_state=draft_state, last=first, out=out,
                     n_out=jnp.ones((b,), jnp.int32), key=key, steps=zeros, emitted=zeros,
                     accepted=zeros, accept_hist=jnp.zeros((setup.block_size,), jnp.int32),
                     budget=budget, sampling=sampling, stopped=stopped)


def draft_phase(setup: ChainSetup, target_params, draft_params, state: SpecState):
    """-> (state with draft context/key advanced, block [B, Bs], draft logits [B, Bs-1, V])."""
    b = state.last.shape[0]
    if not setup.uses_drafter:
        empty = jnp.zeros((b, 0, setup.target.vocab_size), jnp.float32)
        return state, state.last[:, None], empty
    key, key_draft = _split(state.key, state.sampling)
    draft_logits, draft_state = setup.drafter.propose(draft_params, target_params, state.draft_state,
                                                      state.last, setup.block_size)
    drafts = choose_drafts(key_draft, draft_logits, state.sampling)  # [B, Bs-1]
    block = jnp.concatenate([state.last[:, None], drafts], axis=1)  # [B, Bs]
    return dataclasses.replace(state, draft_state=draft_state, key=key), block, draft_logits


def verify_phase(setup: ChainSetup, target_params, state: SpecState, block: jax.Array):
    """One target forward over the block -> (state with K/V written, logits [B, Bs, V], taps)."""
    logits, taps, target_state = chain_forward(setup.target, target_params, block, state.target_state)
    return dataclasses.replace(state, target_state=target_state), logits, taps


def accept_phase(setup: ChainSetup, target_params, draft_params, state: SpecState, block: jax.Array,
                 draft_logits: jax.Array, target_logits: jax.Array, taps: jax.Array) -> SpecState:
    """Accept a prefix + one token per sequence, write outputs, commit target state and draft context."""
    bs = setup.block_size
    active = _active(setup, state)  # uses lengths before this step's commit
    key, key_verify = _split(state.key, state.sampling)
    n_acc, next_token = verify_chain(key_verify, block[:, 1:], draft_logits, target_logits,
                                     state.sampling)
    n_acc = jnp.where(active, n_acc, 0)
    n_new = jnp.where(active, n_acc + 1, 0)  # tokens that enter the caches: last + accepted drafts
    # Emitted this step: drafts 1..n_acc then next_token; later slots are overwritten next step.
    idx = jnp.arange(bs, dtype=jnp.int32)[None, :]
    shifted = jnp.concatenate([block[:, 1:], block[:, :1]], axis=1)  # [B, Bs] drafts at slots 0..Bs-2
    emit = jnp.where(idx < n_acc[:, None], shifted, next_token[:, None])  # [B, Bs]
    out = jax.vmap(lambda row, e, s: jax.lax.dynamic_update_slice(row, e, (s,)))(
        state.out, emit, state.n_out)
    take = jnp.minimum(n_new, state.budget - state.n_out)  # the last step may overshoot the budget
    stopped = state.stopped
    if setup.stop_token is not None:  # emitted slots past the first stop token within take are cut
        hit = (emit == setup.stop_token) & (idx < take[:, None])
        take = jnp.where(hit.any(axis=1), jnp.argmax(hit, axis=1).astype(jnp.int32) + 1, take)
        stopped = stopped | hit.any(axis=1)
    draft_state = state.draft_state
    if setup.uses_drafter:
        draft_state = setup.drafter.extend(draft_params, target_params, draft_state, taps, n_new)
    hist = state.accept_hist.at[n_acc].add(active.astype(jnp.int32))
    return dataclasses.replace(
        state, target_state=state.target_state.commit(n_new), draft_state=draft_state,
        last=jnp.where(active, next_token, state.last), out=out, n_out=state.n_out + take, key=key,
        steps=state.steps + active.astype(jnp.int32), emitted=state.emitted + take,
        accepted=state.accepted + n_new, accept_hist=hist, stopped=stopped)


def spec_step(setup: ChainSetup, target_params, draft_params, state: SpecState):
    """One draft -> verify -> accept step -> (state, all_done scalar bool)."""
    state, block, draft_logits = draft_phase(setup, target_params, draft_params, state)
    state, target_logits, taps = verify_phase(setup, target_params, state, block)
    state = accept_phase(setup, target_params, draft_params, state, block, draft_logits, target_logits,
                         taps)
    return state, all_done(setup, state)


def decode_while(setup: ChainSetup, target_params, draft_params, state: SpecState) -> SpecState:
    """The whole decode as one `lax.while_loop` (no host sync until it returns)."""
    return jax.lax.while_loop(lambda s: ~all_done(setup, s),
                              lambda s: spec_step(setup, target_params, draft_params, s)[0], state)


_prefill_jit = jax.jit(_prefill_core, static_argnums=0, donate_argnames=("target_state", "draft_state"))
_initial_jit = jax.jit(_initial_state, static_argnums=0)
_step_jit = jax.jit(spec_step, static_argnums=0, donate_argnames=("state",))
_while_jit = jax.jit(decode_while, static_argnums=0, donate_argnames=("state",))
_draft_jit = jax.jit(draft_phase, static_argnums=0, donate_argnames=("state",))
_verify_jit = jax.jit(verify_phase, static_argnums=0, donate_argnames=("state",))
_accept_jit = jax.jit(accept_phase, static_argnums=0, donate_argnames=("state",))

_CACHE = CompileCache()


def _compiled(fn, static, *args):
    """Ahead-of-time compiled `fn` for these argument shapes, so no timed call ever compiles."""
    return _CACHE.get(fn, static, args, lambda *a: fn.lower(static, *a))


# --------------------------------------------------------------------------------------------------
# Loop drivers: each is built (and compiled) from the post-prefill state's shapes before the clock
# starts, then maps that state to (final state, phase timings or None).


def _while_driver(setup, tp, dp, state_shape, budgets):
    run = _compiled(_while_jit, setup, tp, dp, state_shape)
    return lambda state: (run(tp, dp, state), None)


def _host_driver(setup, tp, dp, state_shape, budgets):
    step = _compiled(_step_jit, setup, tp, dp, state_shape)
    # Every sequence needs at least this many steps (each emits <= Bs tokens): dispatch them blind.
    # With a stop token any sequence may end at any step: one blind step only.
    n_blind = max(1, math.ceil((int(budgets.min()) - 1) / setup.block_size))
    if setup.stop_token is not None:
        n_blind = 1

    def run(state):
        done = None
        for _ in range(n_blind):
            state, done = step(tp, dp, state)
        for _ in range(int(budgets.max())):  # each active sequence emits >= 1 token per step
            nxt, nxt_done = step(tp, dp, state)  # queued before the read-back below blocks
            if bool(done):  # deliberate host sync, one step behind the dispatch front
                return nxt, None  # that extra step was a no-op for every sequence
            state, done = nxt, nxt_done
        return state, None

    return run


def _profiled_driver(setup, tp, dp, state_shape, budgets):
    """Host loop with each phase jitted apart and synced, to split time draft/verify/bookkeeping."""
    s1, block, draft_logits = jax.eval_shape(functools.partial(draft_phase, setup), tp, dp, state_shape)
    s2, target_logits, taps = jax.eval_shape(functools.partial(verify_phase, setup), tp, s1, block)
    draft = _compiled(_draft_jit, setup, tp, dp, state_shape)
    verify = _compiled(_verify_jit, setup, tp, s1, block)
    accept = _compiled(_accept_jit, setup, tp, dp, s2, block, draft_logits, target_logits, taps)
    done = jax.jit(all_done, static_argnums=0)

    def run(state):
        times = {"draft": 0.0, "verify": 0.0, "bookkeeping": 0.0}
        for _ in range(int(budgets.max())):
            if bool(done(setup, state)):
                break
            t0 = time.perf_counter()
            with TraceAnnotation("specpilot.draft"):
                state, block, draft_logits = draft(tp, dp, state)
                jax.block_until_ready(block)
            t1 = time.perf_counter()
            with TraceAnnotation("specpilot.verify"):
                state, target_logits, taps = verify(tp, state, block)
                jax.block_until_ready(target_logits)
            t2 = time.perf_counter()
            with TraceAnnotation("specpilot.accept"):
                state = accept(tp, dp, state, block, draft_logits, target_logits, taps)
                jax.block_until_ready(state.n_out)
            t3 = time.perf_counter()
            times["draft"] += t1 - t0
            times["verify"] += t2 - t1
            times["bookkeeping"] += t3 - t2
        return state, times

    return run


@dataclasses.dataclass
class SpecResult(GenerationResult):
    """AR's result (num_generated < budget only where stop_at_capacity or the stop token cut a sequence
    short) plus the speculative statistics."""

    stats: SpecStats = None


def generate(target, target_params, drafter, draft_params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, block_size: int | None = None, sampling: SamplingConfig = GREEDY,
             key: jax.Array | None = None, cache_len: int | None = None, cache_dtype=None,
             loop: str = DEFAULT_LOOP, profile: bool = False, stop_at_capacity: bool = False,
             budgets=None, temperature=None, top_p=None, stop_token: int | None = None) -> SpecResult:
    """Speculatively generate up to `max_new_tokens` tokens after each prompt (token-id lists).

    `budgets` [B]: new tokens per request (default max_new_tokens each); `temperature` / `top_p` [B]:
    per-request values in place of `sampling`'s; changing them reuses the compiled steps. Tokens past
    `num_generated[b]` are -1. `profile=True` uses the host loop with separately synced phases and
    fills the draft/verify/bookkeeping times. `stop_token`: a sequence ends right after emitting this
    id (kept as its last token), the decode when every sequence has.
    """
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    b = len(prompts)
    bs = block_size or drafter.block_size
    limit = getattr(target, "max_block_size", None)  # targets with recurrent state keep <= limit states
    if limit is not None and bs > limit:
        raise ValueError(f"block size {bs} exceeds the target's max_block_size {limit} (the per-token "
                         f"recurrent states one verification keeps); build the target with a larger one")
    stop_token = check_stop_token(stop_token, target.vocab_size)
    setup = ChainSetup(target, drafter if bs > 1 else None, bs, max_new_tokens, stop_token)
    budgets = request_budgets(budgets, max_new_tokens, b)
    requests = sampling.for_requests(b, temperature, top_p)
    key = resolve_key(key, requests)
    target.check_params(target_params)
    check_position_limit(prompts, budgets, target.max_positions)
    cache_len = cache_len or default_cache_len(prompts, max_new_tokens, extra=bs)
    longest = max(len(p) for p in prompts)
    if not stop_at_capacity:
        check_capacity(cache_len, longest + max_new_tokens + bs - 2,
                       f"the longest prompt ({longest} tokens) plus {max_new_tokens} new tokens with "
                       f"block size {bs} (a verification writes {bs} positions)")
    tokens, lengths = pack_prompts(prompts, cache_len, max_positions=target.max_positions)
    dtype = cache_dtype or target.dtype

    def fresh():
        draft_state = (drafter.init_state(draft_params, b, cache_len, dtype) if setup.uses_drafter
                       else None)
        return target.init_state(b, cache_len, dtype), draft_state

    args = (jnp.asarray(tokens), jnp.asarray(lengths))
    budget = jnp.asarray(budgets)
    state_shapes = jax.eval_shape(fresh)
    prefill_args = (target_params, draft_params, *args, *state_shapes, key, requests)
    prefill = _compiled(_prefill_jit, _prefill_key(setup), *prefill_args)
    first, tstate, dstate, key_shape = _CACHE.out_shapes(_prefill_core, _prefill_key(setup), prefill_args)
    initial = _compiled(_initial_jit, setup, first, tstate, dstate, key_shape, budget, requests)
    state_shape = _CACHE.out_shapes(_initial_state, setup, (first, tstate, dstate, key_shape, budget, requests))
    driver = _profiled_driver if profile else {"while": _while_driver, "host": _host_driver}[loop]
    run = driver(setup, target_params, draft_params, state_shape, budgets)
    states = fresh()

    t0 = time.perf_counter()
    with TraceAnnotation("specpilot.prefill"):
        state = initial(*prefill(target_params, draft_params, *args, *states, key, requests), budget, requests)
        state.last.block_until_ready()
    t1 = time.perf_counter()
    with TraceAnnotation("specpilot.decode"):
        state, times = run(state)
        out, n_out = host_array(state.out), host_array(state.n_out)  # the decode's only read-back
    t2 = time.perf_counter()

    generated = out[:, :max_new_tokens].copy()
    generated[np.arange(max_new_tokens)[None, :] >= n_out[:, None]] = -1
    stats = SpecStats(block_size=bs, steps=host_array(state.steps), emitted=host_array(state.emitted),
                      accept_hist=host_array(state.accept_hist), prefill_s=t1 - t0, decode_s=t2 - t1,
                      new_tokens=int(budgets.max() if stop_token is None else n_out.max()),
                      accepted=host_array(state.accepted))
    if times is not None:
        stats.draft_s, stats.verify_s, stats.bookkeeping_s = (
            times["draft"], times["verify"], times["bookkeeping"])
    return SpecResult(tokens=generated, prompt_lengths=lengths, prefill_s=t1 - t0, decode_s=t2 - t1,
                      budgets=budgets, num_generated=n_out, stop_token=stop_token, stats=stats)
