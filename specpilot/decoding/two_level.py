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
from specpilot.models import exit_head as exit_head_model
from specpilot.plan import check_first_level
from specpilot.state import tree_mask

EXIT_HEAD = "exit_head"  # where target params carry a trained exit head's arrays (`with_exit_head`)


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


def with_exit_head(target_params: dict, head: dict) -> dict:
    """Target params carrying a trained exit head (`exit_head.for_target`'s arrays): they travel with the
    params through the compiled loop, where a static setup cannot hold arrays."""
    return {**target_params, EXIT_HEAD: head}


def check_exit_head(head, target) -> None:
    """A clear error for exit head arrays that do not score for `target`."""
    if not isinstance(head, dict) or not {"rows", "ids", "norm", "down", "up", "bias"} <= set(head):
        raise ValueError("exit_head must be a head's arrays from exit_head.for_target (rows, ids, norm, down, "
                         "up, bias)")
    k, h = head["rows"].shape
    if h != target.cfg.hidden_size or head["ids"].shape != (k,):
        raise ValueError(f"the exit head's rows are [{k}, {h}] for {head['ids'].shape} ids; the target's hidden "
                         f"size is {target.cfg.hidden_size}")


def exit_head_node_logprob(target, target_params, target_state, tree: Tree, exit_layer: int) -> jax.Array:
    """[B, N]: log p(token | parent) under the trained exit head `target_params` carries, on the output of
    the target's first `exit_layer` layers, over the whole tree in one forward (its state is dropped)."""
    positions = target_state.lengths[:, None] + tree.depths
    hidden, _ = target.exit_hidden(target_params, tree.tokens, positions, target_state,
                                   tree_mask(target_state, tree.ancestors), parents=tree.parents,
                                   exit_layer=exit_layer)
    return exit_head_model.token_logprob(target_params[EXIT_HEAD], hidden, tree.parents, tree.tokens,
                                         target.cfg.rms_norm_eps)


def first_level_scores(first: str, exit_layer, depth: int, target, target_params, target_state, tree: Tree,
                       draft_logprobs, exit_head: bool = False) -> jax.Array:
    """[B, N] the path scores of first level `first` over a tree of depth <= depth (`exit_head`: an
    early exit through the trained head `target_params` carries)."""
    if first == "drafter_confidence":
        return path_scores(tree, drafter_node_logprob(tree, draft_logprobs), depth)
    exit_logprob = exit_head_node_logprob if exit_head else early_exit_node_logprob
    return path_scores(tree, exit_logprob(target, target_params, target_state, tree, exit_layer), depth)


@dataclasses.dataclass(frozen=True)
class TwoLevelSetup(tree_loop.TreeSetup):
    """A tree run whose drafted `nodes`-node tree is cut to `keep` nodes by `first` before verification
    (`exit_head`: the early exit scores through a trained head that the target params carry)."""

    first: str = "drafter_confidence"
    keep: int = 2
    exit_layer: int | None = None
    exit_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_first_level(self.first, self.keep, self.exit_layer, self.nodes,
                          getattr(self.target.cfg, "num_layers", None))
        if self.exit_head and self.first != "early_exit":
            raise ValueError(f"a trained exit head scores for the early_exit first level, not {self.first!r}")

    def step(self, target_params, draft_params, state: spec.SpecState) -> spec.SpecState:
        return two_level_step(self, target_params, draft_params, state)


def two_level_step(setup: TwoLevelSetup, target_params, draft_params, state: spec.SpecState):
    draft_logits, draft_state = setup.drafter.propose(draft_params, target_params, state.draft_state,
                                                      state.last, setup.block_size)
    logprobs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    full = build_tree(logprobs, state.last, setup.nodes, setup.depth, setup.branching)
    state = dataclasses.replace(state, draft_state=draft_state)
    scores = first_level_scores(setup.first, setup.exit_layer, setup.depth, setup.target, target_params,
                                state.target_state, full, logprobs, setup.exit_head)
    kept, _ = select_subtree(full, scores, setup.keep)
    state, logits, taps = tree_loop.verify_phase(setup, target_params, state, kept)
    return tree_loop.accept_phase(setup, target_params, draft_params, state, kept, logits, taps)


def generate(target, target_params, drafter, draft_params, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, *, nodes: int, depth: int, branching: int, first: str, keep: int,
             exit_layer: int | None = None, exit_head: dict | None = None, sampling: SamplingConfig = GREEDY,
             key=None, cache_len: int | None = None, cache_dtype=None, budgets=None, temperature=None,
             top_p=None, stop_token: int | None = None, record_steps: bool = False) -> spec.SpecResult:
    """Two-level tree-speculative generation (`tree.generate`'s arguments, plus the first level;
    `exit_head`: a trained head's arrays, `exit_head.for_target`, for the early exit)."""
    tree_loop.check_depth(drafter, depth)
    setup = TwoLevelSetup(target, drafter, nodes, depth, branching, max_new_tokens,
                          check_stop_token(stop_token, target.vocab_size), first=first, keep=keep,
                          exit_layer=exit_layer, exit_head=exit_head is not None)
    if exit_head is not None:
        check_exit_head(exit_head, target)
        target_params = with_exit_head(target_params, exit_head)
    return tree_loop.run(setup, target_params, draft_params, prompts, sampling=sampling, key=key,
                         cache_len=cache_len, cache_dtype=cache_dtype, budgets=budgets,
                         temperature=temperature, top_p=top_p, record_steps=record_steps)
