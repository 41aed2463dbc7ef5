"""The engine's tree step: draft a token tree for every slot, verify its nodes in one target forward, accept a
root path, commit it for the active rows.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specpilot.decoding import tree as tree_loop
from specpilot.decoding.sampling import RequestSampling
from specpilot.decoding.token_tree import Tree, accept_tree_greedy, accept_tree_sampled, check_shape, tree_uniforms
from specpilot.serving import slots as sl


@dataclasses.dataclass(frozen=True)
class TreeEngineSetup(sl.EngineSetup):
    """An engine's static setup for tree verification (block_size = depth + 1)."""

    nodes: int = 2  # tokens one verification checks per row: the last token + nodes - 1 drafted nodes
    depth: int = 1  # deepest drafted node
    branching: int = 1  # candidates per block position (top-k)

    def __post_init__(self):
        check_shape(self.nodes, self.depth, self.branching)
        if self.drafter is None:
            raise ValueError("a tree step needs a drafter")
        if self.block_size != self.depth + 1:
            raise ValueError(f"a tree setup's block_size is depth + 1 = {self.depth + 1}, got {self.block_size}")

    @property
    def width(self) -> int:
        """Slots one tree step writes past the committed length."""
        return max(self.nodes, self.depth + 1)

    @property
    def max_len(self) -> int:
        return self.context_len + max(self.prefill_chunk, self.width)


def verify_tree_rows(keys: jax.Array, tree: Tree, target_logits: jax.Array, sampling: RequestSampling,
                     depth: int, branching: int):
    """Tree acceptance row by row -> (last accepted node [S], accepted drafts [S], next token [S]).
    keys [S] (typed); target_logits [S, N, V]. Row b's uniforms are those of a batch of one with its own
    key; the acceptance itself is batched."""
    if sampling.greedy:
        return accept_tree_greedy(tree, target_logits, depth)
    u_tests, u_draws = jax.vmap(lambda k: tree_uniforms(k, 1, depth, branching))(keys)
    return accept_tree_sampled(u_tests[:, 0], u_draws[:, 0], tree, target_logits, sampling, depth, branching)


def decode_tree(setup: TreeEngineSetup, target_params, draft_params, state: sl.SlotState, active: jax.Array,
                sampling: RequestSampling):
    """Draft a tree, verify it, accept a path + one token, for every active row -> (state, emitted tokens
    [S, depth + 1] (the first emitted[b] are new), emitted [S], verified [S]: nodes each row checked)."""
    tree, ds = tree_loop.propose_tree(setup, target_params, draft_params, state.draft_state, state.last)
    logits, taps, ts = tree_loop.tree_forward(setup.target, target_params, state.target_state, tree)
    key, verify_keys = sl.split_rows(state.key, sampling)
    last, n_acc, next_token = verify_tree_rows(verify_keys, tree, logits, sampling, setup.depth, setup.branching)
    n_acc = jnp.where(active, n_acc, 0)
    n_new = jnp.where(active, n_acc + 1, 0)
    path, emit = tree_loop.path_tokens(tree, last, n_acc, next_token, setup.block_size)  # [S, D+1] each
    ts, ds = tree_loop.commit_path(setup, target_params, draft_params, ts, ds, taps, path, n_new)
    state = sl.SlotState(ts, ds, jnp.where(active, next_token, state.last), state.n_out + n_new,
                         jnp.where(active[:, None], key, state.key))
    return state, emit, n_new, jnp.where(active, setup.nodes, 0).astype(jnp.int32)


decode_tree_jit = functools.partial(jax.jit, static_argnums=0, donate_argnames=("state",))(decode_tree)
