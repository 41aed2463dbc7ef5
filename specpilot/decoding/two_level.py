"""Two-level tree verification: a cheap first level shrinks the drafted tree to `keep` nodes, then the full
target verifies the kept nodes (`decoding.tree`'s verify and accept phases).
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from specpilot.decoding import spec, tree as tree_loop
from specpilot.decoding.ar import check_stop_token
from specpilot.decoding.sampling import GREEDY, SamplingConfig
from specpilot.decoding.token_tree import Tree, build_tree
from specpilot.plan import check_first_level
from specpilot.state import tree_mask


def path_scores(tree: Tree, node_logprob: jax.Array, depth: int) -> jax.Array:
    """node_logprob [B, N] (log-probability of node i's token given its parent; the root's is ignored)
    -> [B, N] path log-probabilities of a tree of depth <= depth, each a parent's score plus a term
    clamped to <= 0."""
    is_root = (jnp.arange(tree.num_nodes) == 0)[None, :]
    term = jnp.where(is_root, 0.0, jnp.minimum(node_logprob.astype(jnp.float32), 0.0))
    up = jnp.maximum(tree.parents, 0)
    score = jnp.zeros_like(term)
    for _ in range(depth):  # after k rounds every node of depth <= k holds its path's sum
        score = jnp.where(is_root, 0.0, jnp.take_along_axis(score, up, axis=1) + term)
    return score


def select_subtree(tree: Tree, scores: jax.Array, keep: int) -> tuple[Tree, jax.Array]:
    """The `keep` best nodes (scores [B, N], higher is better) as a rooted subtree -> (the compacted
    tree, kept [B, keep]: the original index of each new node, ascending)."""
    b, n = tree.tokens.shape
    if not 1 <= keep <= n:
        raise ValueError(f"keep must be in 1..{n} (the tree's nodes), got {keep}")
    s = jnp.where(jnp.isnan(scores), -jnp.inf, scores.astype(jnp.float32))
    s = jnp.where(jnp.arange(n)[None, :] == 0, jnp.inf, s)  # the root is always kept
    s = jnp.min(jnp.where(tree.ancestors, s[:, None, :], jnp.inf), axis=-1)  # never above an ancestor
    d = tree.depths
    idx = jnp.arange(n)
    si, sj = s[:, :, None], s[:, None, :]
    di, dj = d[:, :, None], d[:, None, :]
    before = (sj > si) | ((sj == si) & ((dj < di) | ((dj == di) & (idx[None, None, :] < idx[None, :, None]))))
    rank = jnp.sum(before, axis=-1)  # [B, N] a total order: distinct ranks 0..N-1
    chosen = rank < keep
    kept = jnp.sort(jnp.where(chosen, idx[None, :], n + idx[None, :]), axis=1)[:, :keep].astype(jnp.int32)
    batch = jnp.arange(b)[:, None]
    new_of = jnp.full((b, n), -1, jnp.int32).at[batch, kept].set(jnp.arange(keep, dtype=jnp.int32)[None, :])
    old_parent = jnp.take_along_axis(tree.parents, kept, axis=1)
    parents = jnp.where(old_parent < 0, -1, jnp.take_along_axis(new_of, jnp.maximum(old_parent, 0), axis=1))
    anc = jnp.take_along_axis(tree.ancestors, kept[:, :, None], axis=1)
    anc = jnp.take_along_axis(anc, kept[:, None, :], axis=2)
    return Tree(jnp.take_along_axis(tree.tokens, kept, axis=1), parents,
                jnp.take_along_axis(tree.depths, kept, axis=1), anc), kept


def drafter_node_logprob(tree: Tree, draft_logprobs: jax.Array) -> jax.Array:
    """[B, N]: log q_depth(token) of each node under the drafter's block distributions [B, P, V]."""
    pos = jnp.maximum(tree.depths - 1, 0)  # position d's log-probabilities sit at index d - 1
    return draft_logprobs[jnp.arange(tree.tokens.shape[0])[:, None], pos, tree.tokens]


def early_exit_node_logprob(target, target_params, target_state, tree: Tree, exit_layer: int) -> jax.Array:
    """[B, N]: log p(token | parent) under the final norm + head applied after the target's first
    `exit_layer` layers, over the whole tree in one forward (its state is dropped)."""
    positions = target_state.lengths[:, None] + tree.depths
    logits, _, _ = target.forward(target_params, tree.tokens, positions, target_state,
                                  tree_mask(target_state, tree.ancestors), parents=tree.parents,
                                  exit_layer=exit_layer)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, N, V]
    up = jnp.maximum(tree.parents, 0)
    return logp[jnp.arange(tree.tokens.shape[0])[:, None], up, tree.tokens]


def first_level_scores(first: str, exit_layer, depth: int, target, target_params, target_state, tree: Tree,
                       draft_logprobs) -> jax.Array:
    """[B, N] the path scores of first level `first` over a tree of depth <= depth."""
    if first == "drafter_confidence":
        return path_scores(tree, drafter_node_logprob(tree, draft_logprobs), depth)
    return path_scores(tree, early_exit_node_logprob(target, target_params, target_state, tree, exit_layer),
                       depth)


@dataclasses.dataclass(frozen=True)
class TwoLevelSetup(tree_loop.TreeSetup):
    """A tree run whose drafted `nodes`-node tree is cut to `keep` nodes by `first` before verification."""

    first: str = "drafter_confidence"
    keep: int = 2
    exit_layer: int | None = None

    def __post_init__(self):
        super().__post_init__()
        check_first_level(self.first, self.keep, self.exit_layer, self.nodes,
                          getattr(self.target.cfg, "num_layers", None))

    def step(self, target_params, draft_params, state: spec.SpecState) -> spec.SpecState:
        return two_level_step(self, target_params, draft_params, state)


def two_level_step(setup: TwoLevelSetup, target_params, draft_params, state: spec.SpecState):
    draft_logits, draft_state = setup.drafter.propose(draft_params, target_params, state.draft_state,
                                                      state.last, setup.block_size)
    logprobs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    full = build_tree(logprobs, state.last, setup.nodes, setup.depth, setup.branching)
    state = dataclasses.replace(state, draft_state=draft_state)
    scores = first_level_scores(setup.first, setup.exit_layer, setup.depth, setup.target, target_params,
                                state.target_state, full, logprobs)
    kept, _ = select_subtree(full, scores, setup.keep)
    state, logits, taps = tree_loop.verify_phase(setup, target_params, state, kept)
    return tree_loop.accept_phase(setup, target_params, draft_params, state, kept, logits, taps)


def generate(target, target_params, drafter, draft_params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, nodes: int, depth: int, branching: int, first: str, keep: int,
             exit_layer: int | None = None, sampling: SamplingConfig = GREEDY, key=None,
             cache_len: int | None = None, cache_dtype=None, budgets=None, temperature=None, top_p=None,
             stop_token: int | None = None, record_steps: bool = False) -> spec.SpecResult:
    """Two-level tree-speculative generation (`tree.generate`'s arguments, plus the first level)."""
    tree_loop.check_depth(drafter, depth)
    setup = TwoLevelSetup(target, drafter, nodes, depth, branching, max_new_tokens,
                          check_stop_token(stop_token, target.vocab_size), first=first, keep=keep,
                          exit_layer=exit_layer)
    return tree_loop.run(setup, target_params, draft_params, prompts, sampling=sampling, key=key,
                         cache_len=cache_len, cache_dtype=cache_dtype, budgets=budgets,
                         temperature=temperature, top_p=top_p, record_steps=record_steps)
