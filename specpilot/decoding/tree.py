"""Tree speculative decoding: draft a token tree from one block-drafter forward, verify it in one target forward,
accept a root path, commit it, repeat.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.decoding import spec
from specpilot.decoding.ar import (check_position_limit, check_stop_token, default_cache_len, pack_prompts,
                                   request_budgets)
from specpilot.decoding.sampling import GREEDY, SamplingConfig, resolve_key
from specpilot.decoding.stats import SpecStats
from specpilot.decoding.token_tree import build_tree, check_shape, root_path, verify_tree
from specpilot.sharding import host_array
from specpilot.state import check_capacity, tree_mask


@dataclasses.dataclass(frozen=True)
class TreeSetup:
    """Everything static about a tree run (hashable: a jit static argument)."""

    target: Any
    drafter: Any
    nodes: int  # tokens one verification checks: the root (last token) + nodes - 1 drafted nodes
    depth: int  # deepest drafted node (<= the drafter's block size - 1)
    branching: int  # candidates per block position (top-k)
    max_new_tokens: int
    stop_token: int | None = None

    def __post_init__(self):
        check_shape(self.nodes, self.depth, self.branching)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.drafter is None:
            raise ValueError("tree decoding needs a drafter")

    @property
    def block_size(self) -> int:
        return self.depth + 1

    @property
    def width(self) -> int:
        return max(self.nodes, self.depth + 1)

    uses_drafter = True

    def step(self, target_params, draft_params, state: spec.SpecState) -> spec.SpecState:
        """One draft-verify-accept step (`decoding.two_level` overrides it with a first level)."""
        return tree_step(self, target_params, draft_params, state)


def _active(setup: TreeSetup, state: spec.SpecState) -> jax.Array:
    fits = state.target_state.lengths + setup.width <= state.target_state.max_len
    return (state.n_out < state.budget) & fits & ~state.stopped


def all_done(setup: TreeSetup, state: spec.SpecState) -> jax.Array:
    return ~jnp.any(_active(setup, state))


def propose_tree(setup, target_params, draft_params, draft_state, last: jax.Array):
    """The drafter's one forward at block depth + 1 after `last` [B], and the tree built from its own
    log-probabilities whatever the sampling: which tree is verified never changes the output
    distribution (`token_tree`) -> (tree, draft state). `setup`: any value with target, drafter, nodes,
    depth, branching and block_size (`TreeSetup`, the serving engine's `TreeEngineSetup`)."""
    draft_logits, draft_state = setup.drafter.propose(draft_params, target_params, draft_state, last,
                                                      setup.block_size)
    tree = build_tree(jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1), last,
                      setup.nodes, setup.depth, setup.branching)
    return tree, draft_state


def tree_forward(target, target_params, target_state, tree):
    """One target forward over the tree's nodes (positions lengths + depths, `tree_mask`, parents)
    -> (logits [B, N, V], taps, state with the nodes' K/V and per-node recurrent states written)."""
    positions = target_state.lengths[:, None] + tree.depths
    return target.forward(target_params, tree.tokens, positions, target_state,
                          tree_mask(target_state, tree.ancestors), parents=tree.parents)


def path_tokens(tree, last: jax.Array, n_acc: jax.Array, next_token: jax.Array, length: int):
    """-> (path [B, length]: node indices of the root path to `last`, root first; emit [B, length]: the
    accepted drafts along it, then the next token; entries past n_acc + 1 are filler)."""
    path = root_path(tree, last, length)
    idx = jnp.arange(length, dtype=jnp.int32)[None, :]
    tokens = jnp.take_along_axis(tree.tokens, path, axis=1)  # [B, length], the root first
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    return path, jnp.where(idx < n_acc[:, None], shifted, next_token[:, None])


def commit_path(setup, target_params, draft_params, target_state, draft_state, taps, path: jax.Array,
                n_new: jax.Array):
    """Commit each row's first n_new [B] path nodes: the target state gathers them to consecutive slots
    (`TargetState.gather_path`), the drafter's context extends by the taps gathered along the same path
    -> (target state, draft state), at equal lengths."""
    path_taps = jnp.take_along_axis(taps, path[:, :, None], axis=1)  # [B, P, F]
    draft_state = setup.drafter.extend(draft_params, target_params, draft_state, path_taps, n_new)
    return target_state.gather_path(path, n_new), draft_state


def draft_phase(setup: TreeSetup, target_params, draft_params, state: spec.SpecState):
    """-> (state with the draft context advanced, tree) (`propose_tree`)."""
    tree, draft_state = propose_tree(setup, target_params, draft_params, state.draft_state, state.last)
    return dataclasses.replace(state, draft_state=draft_state), tree


def verify_phase(setup: TreeSetup, target_params, state: spec.SpecState, tree):
    """One target forward over the tree's nodes -> (state with K/V written, logits [B, N, V], taps)."""
    logits, taps, ts = tree_forward(setup.target, target_params, state.target_state, tree)
    return dataclasses.replace(state, target_state=ts), logits, taps


def accept_phase(setup: TreeSetup, target_params, draft_params, state: spec.SpecState, tree,
                 target_logits, taps) -> spec.SpecState:
    """Accept a root path + one token per sequence, write outputs, commit the path in both states."""
    length = setup.block_size
    active = _active(setup, state)
    key, key_verify = spec._split(state.key, state.sampling)
    last, n_acc, next_token = verify_tree(key_verify, tree, target_logits, state.sampling, setup.depth,
                                          setup.branching)
    n_acc = jnp.where(active, n_acc, 0)
    n_new = jnp.where(active, n_acc + 1, 0)
    path, emit = path_tokens(tree, last, n_acc, next_token, length)  # [B, D+1] each
    idx = jnp.arange(length, dtype=jnp.int32)[None, :]
    out = jax.vmap(lambda row, e, s: jax.lax.dynamic_update_slice(row, e, (s,)))(state.out, emit, state.n_out)
    take = jnp.minimum(n_new, state.budget - state.n_out)
    stopped = state.stopped
    if setup.stop_token is not None:
        hit = (emit == setup.stop_token) & (idx < take[:, None])
        take = jnp.where(hit.any(axis=1), jnp.argmax(hit, axis=1).astype(jnp.int32) + 1, take)
        stopped = stopped | hit.any(axis=1)
    target_state, draft_state = commit_path(setup, target_params, draft_params, state.target_state,
                                            state.draft_state, taps, path, n_new)
    hist = state.accept_hist.at[n_acc].add(active.astype(jnp.int32))
    return dataclasses.replace(
        state, target_state=target_state, draft_state=draft_state,
        last=jnp.where(active, next_token, state.last), out=out, n_out=state.n_out + take, key=key,
        steps=state.steps + active.astype(jnp.int32), emitted=state.emitted + take,
        accepted=state.accepted + n_new, accept_hist=hist, stopped=stopped)


def tree_step(setup: TreeSetup, target_params, draft_params, state: spec.SpecState):
    state, tree = draft_phase(setup, target_params, draft_params, state)
    state, logits, taps = verify_phase(setup, target_params, state, tree)
    return accept_phase(setup, target_params, draft_params, state, tree, logits, taps)


def decode_while(setup: TreeSetup, target_params, draft_params, state: spec.SpecState) -> spec.SpecState:
    return jax.lax.while_loop(lambda s: ~all_done(setup, s),
                              lambda s: setup.step(target_params, draft_params, s), state)


_while_jit = jax.jit(decode_while, static_argnums=0, donate_argnames=("state",))


def draft_top1(setup: TreeSetup, target_params, draft_params, state: spec.SpecState) -> jax.Array:
    """[B, depth] float32: the drafter's top-1 probability at block positions 1..depth this step."""
    logits, _ = setup.drafter.propose(draft_params, target_params, state.draft_state, state.last,
                                      setup.block_size)
    probs = jax.nn.softmax(logits[:, :setup.depth].astype(jnp.float32), axis=-1)
    return jnp.max(probs, axis=-1)


_record_jit = jax.jit(lambda setup, tp, dp, state: (setup.step(tp, dp, state), draft_top1(setup, tp, dp, state)),
                      static_argnums=0)
_done_jit = jax.jit(all_done, static_argnums=0)


def generate(target, target_params, drafter, draft_params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, nodes: int, depth: int, branching: int,
             sampling: SamplingConfig = GREEDY, key: jax.Array | None = None, cache_len: int | None = None,
             cache_dtype=None, budgets=None, temperature=None, top_p=None,
             stop_token: int | None = None, record_steps: bool = False) -> spec.SpecResult:
    """Tree-speculatively generate up to `max_new_tokens` tokens after each prompt (as `spec.generate`:
    tokens past `num_generated[b]` are -1; `stats` gives tau and steps, block_size = depth + 1;
    record_steps: `run`'s)."""
    check_depth(drafter, depth)
    setup = TreeSetup(target, drafter, nodes, depth, branching, max_new_tokens,
                      check_stop_token(stop_token, target.vocab_size))
    return run(setup, target_params, draft_params, prompts, sampling=sampling, key=key, cache_len=cache_len,
               cache_dtype=cache_dtype, budgets=budgets, temperature=temperature, top_p=top_p,
               record_steps=record_steps)


def check_depth(drafter, depth: int) -> None:
    if depth + 1 > drafter.block_size:
        raise ValueError(f"tree depth {depth} needs a drafter block of {depth + 1}; the drafter's is "
                         f"{drafter.block_size}")


def run(setup: TreeSetup, target_params, draft_params, prompts: Sequence[Sequence[int]], *,
        sampling: SamplingConfig = GREEDY, key: jax.Array | None = None, cache_len: int | None = None,
        cache_dtype=None, budgets=None, temperature=None, top_p=None,
        record_steps: bool = False) -> spec.SpecResult:
    """Prefill, then `setup.step` in one compiled while loop (`generate`; `decoding.two_level` too).
    record_steps: run the steps one call each from the host instead and keep every step's accepted
    drafts per row (`stats.accepted_per_step`, -1 where a row did not step): an acceptance trace; and
    the drafter's top-1 probabilities per step, row and block position (`stats.draft_top1_per_step`)."""
    target, drafter, nodes = setup.target, setup.drafter, setup.nodes
    max_new_tokens, stop_token = setup.max_new_tokens, setup.stop_token
    b = len(prompts)
    limit = getattr(target, "max_block_size", None)
    if limit is not None and setup.width > limit:
        raise ValueError(f"a tree of {nodes} nodes exceeds the target's max_block_size {limit} (the per-node "
                         f"recurrent states one verification keeps); build the target with a larger one")
    budgets = request_budgets(budgets, max_new_tokens, b)
    requests = sampling.for_requests(b, temperature, top_p)
    key = resolve_key(key, requests)
    target.check_params(target_params)
    check_position_limit(prompts, budgets, target.max_positions)
    cache_len = cache_len or default_cache_len(prompts, max_new_tokens, extra=setup.width)
    longest = max(len(p) for p in prompts)
    check_capacity(cache_len, longest + max_new_tokens + setup.width - 2,
                   f"the longest prompt ({longest} tokens) plus {max_new_tokens} new tokens with a "
                   f"{nodes}-node tree (a verification writes {setup.width} positions)")
    tokens, lengths = pack_prompts(prompts, cache_len, max_positions=target.max_positions)
    dtype = cache_dtype or target.dtype

    def fresh():
        return target.init_state(b, cache_len, dtype), drafter.init_state(draft_params, b, cache_len, dtype)

    args = (jnp.asarray(tokens), jnp.asarray(lengths))
    budget = jnp.asarray(budgets)
    static = (target, drafter)
    prefill_args = (target_params, draft_params, *args, *jax.eval_shape(fresh), key, requests)
    prefill = spec._compiled(spec._prefill_jit, static, *prefill_args)
    first, tstate, dstate, key_shape = spec._CACHE.out_shapes(spec._prefill_core, static, prefill_args)
    initial = spec._compiled(spec._initial_jit, setup, first, tstate, dstate, key_shape, budget, requests)
    state_shape = spec._CACHE.out_shapes(spec._initial_state, setup,
                                         (first, tstate, dstate, key_shape, budget, requests))
    run = spec._compiled(_while_jit, setup, target_params, draft_params, state_shape)
    states = fresh()

    t0 = time.perf_counter()
    state = initial(*prefill(target_params, draft_params, *args, *states, key, requests), budget, requests)
    state.last.block_until_ready()
    t1 = time.perf_counter()
    per_step = top1 = None
    if record_steps:
        per_step, top1 = [], []
        while not bool(_done_jit(setup, state)):
            accepted, steps = state.accepted, state.steps
            state, step_top1 = _record_jit(setup, target_params, draft_params, state)
            stepped = host_array(state.steps - steps) > 0
            per_step.append(np.where(stepped, host_array(state.accepted - accepted) - 1, -1))
            top1.append(host_array(step_top1))
        per_step = np.asarray(per_step, np.int32).reshape(-1, b)
        top1 = np.asarray(top1, np.float32).reshape(-1, b, setup.depth)
    else:
        state = run(target_params, draft_params, state)
    out, n_out = host_array(state.out), host_array(state.n_out)
    t2 = time.perf_counter()

    generated = out[:, :max_new_tokens].copy()
    generated[np.arange(max_new_tokens)[None, :] >= n_out[:, None]] = -1
    stats = SpecStats(block_size=setup.block_size, steps=host_array(state.steps),
                      emitted=host_array(state.emitted), accept_hist=host_array(state.accept_hist),
                      prefill_s=t1 - t0, decode_s=t2 - t1,
                      new_tokens=int(budgets.max() if stop_token is None else n_out.max()),
                      accepted=host_array(state.accepted), accepted_per_step=per_step,
                      draft_top1_per_step=top1)
    return spec.SpecResult(tokens=generated, prompt_lengths=lengths, prefill_s=t1 - t0, decode_s=t2 - t1,
                           budgets=budgets, num_generated=n_out, stop_token=stop_token, stats=stats)
