"""Token trees from a block drafter's one forward, and their acceptance against the target's scores.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specpilot.decoding.sampling import RequestSampling, as_request_sampling, draw, probabilities
from specpilot.plan import max_nodes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    tokens: jax.Array  # [B, N] int32; node 0 is the root (the last accepted token)
    parents: jax.Array  # [B, N] int32; -1 for the root, else < the node's index
    depths: jax.Array  # [B, N] int32; 0 for the root
    ancestors: jax.Array  # [B, N, N] bool: ancestors[b, i, j] = node j is on node i's root path (j == i too)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def check_shape(nodes: int, depth: int, branching: int) -> None:
    """A clear error for a tree shape no drafter output can fill."""
    for name, value in (("nodes", nodes), ("depth", depth), ("branching", branching)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"tree {name} must be a positive integer, got {value!r}")
    if nodes < 2:
        raise ValueError(f"tree nodes must be >= 2 (the root and one draft), got {nodes}")
    if nodes > max_nodes(depth, branching):
        raise ValueError(f"tree nodes {nodes} exceed the {max_nodes(depth, branching)} nodes of a full tree "
                         f"of depth {depth} and branching {branching}")


def build_tree(draft_logprobs: jax.Array, root: jax.Array, nodes: int, depth: int, branching: int) -> Tree:
    """draft_logprobs [B, P, V] (P >= depth: position d's log-probabilities at index d-1), root [B]
    -> the `nodes`-node tree of the best path scores (module docstring)."""
    check_shape(nodes, depth, branching)
    b, p, v = draft_logprobs.shape
    if p < depth:
        raise ValueError(f"a depth-{depth} tree needs {depth} drafted positions, the drafter gave {p}")
    if branching > v:
        raise ValueError(f"branching {branching} exceeds the vocabulary ({v})")
    width = nodes - 1
    vals, toks = top_k_by_argmax(draft_logprobs[:, :depth].astype(jnp.float32), branching)  # [B, D, k]
    scores, tokens, parent_flat = [], [], []
    offset = 0
    prev_score = None
    for d in range(depth):
        if prev_score is None:  # depth 1: the root's children
            cand = vals[:, 0]  # [B, k]
        else:
            cand = (prev_score[:, :, None] + vals[:, d, None, :]).reshape(b, -1)  # [B, W*k]
        w = min(width, cand.shape[1])
        score, idx = jax.lax.top_k(cand, w)  # ties: lower index (beam position, then rank) first
        rank = idx % branching
        tokens.append(jnp.take_along_axis(toks[:, d], rank, axis=1))
        if prev_score is None:
            parent_flat.append(jnp.full((b, w), -1, jnp.int32))
        else:
            parent_flat.append((offset - prev_score.shape[1] + idx // branching).astype(jnp.int32))
        scores.append(score)
        offset += w
        prev_score = score
    depth_of = jnp.concatenate([jnp.full((s.shape[1],), d + 1, jnp.int32) for d, s in enumerate(scores)])
    all_scores = jnp.concatenate(scores, axis=1)  # [B, M], depth-major
    all_tokens = jnp.concatenate(tokens, axis=1)
    all_parents = jnp.concatenate(parent_flat, axis=1)
    _, chosen = jax.lax.top_k(all_scores, width)  # ties: shallower first
    chosen = jnp.sort(chosen, axis=1)  # topological: by depth, then beam order
    m = all_scores.shape[1]
    batch = jnp.arange(b)[:, None]
    node_of = jnp.full((b, m), -1, jnp.int32).at[batch, chosen].set(
        jnp.arange(1, nodes, dtype=jnp.int32)[None, :])
    pf = jnp.take_along_axis(all_parents, chosen, axis=1)  # [B, N-1] flat parent, -1 = root
    parent = jnp.where(pf < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(pf, 0), axis=1))
    root_col = jnp.full((b, 1), -1, jnp.int32)
    parents = jnp.concatenate([root_col, parent], axis=1)
    tree_tokens = jnp.concatenate([root[:, None].astype(jnp.int32),
                                   jnp.take_along_axis(all_tokens, chosen, axis=1).astype(jnp.int32)], axis=1)
    depths = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), depth_of[chosen]], axis=1)
    return Tree(tree_tokens, parents, depths, ancestors_of(parents, depth))


def top_k_by_argmax(x: jax.Array, k: int):
    """`lax.top_k` over the last axis (same order: ties to the lower index) as k argmax passes: XLA's CPU
    top-k sorts the whole axis, which made a tree step over a 16k vocabulary 8x slower than a chain."""
    vals, idx = [], []
    taken = jnp.zeros(x.shape, bool)
    for _ in range(k):  # the first untaken index holding the largest untaken value (-inf entries too)
        best = jnp.max(jnp.where(taken, -jnp.inf, x), axis=-1, keepdims=True)
        i = jnp.argmax(~taken & (x == best), axis=-1)
        vals.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        idx.append(i.astype(jnp.int32))
        taken = taken | jax.nn.one_hot(i, x.shape[-1], dtype=bool)
    return jnp.stack(vals, axis=-1), jnp.stack(idx, axis=-1)


def ancestors_of(parents: jax.Array, depth: int) -> jax.Array:
    """[B, N] parents (-1 root, topological) -> [B, N, N] ancestor-or-self matrix, for trees of depth <= depth."""
    b, n = parents.shape
    up = jnp.maximum(parents, 0)  # the root is its own parent: walking past it stays there
    cur = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32)[None, :], (b, n))
    anc = jnp.zeros((b, n, n), bool)
    for _ in range(depth + 1):
        anc = anc | jax.nn.one_hot(cur, n, dtype=bool)
        cur = jnp.take_along_axis(up, cur, axis=1)
    return anc


def chain_tree(tokens: jax.Array) -> Tree:
    """The chain [B, T] as a tree (node i's parent is i-1): a reference for tree code."""
    b, t = tokens.shape
    parents = jnp.broadcast_to(jnp.arange(-1, t - 1, dtype=jnp.int32)[None, :], (b, t))
    depths = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    return Tree(tokens.astype(jnp.int32), parents, depths, ancestors_of(parents, t - 1))


def root_path(tree: Tree, last: jax.Array, length: int) -> jax.Array:
    """[B, length] node indices of the root path to node last[b] (root first); entries past its depth
    repeat the root (never committed: `TargetState.gather_path` takes count = depth + 1)."""
    anc = jnp.take_along_axis(tree.ancestors, last[:, None, None], axis=1)[:, 0]  # [B, N]
    at = anc[:, None, :] & (tree.depths[:, None, :] == jnp.arange(length, dtype=jnp.int32)[None, :, None])
    return jnp.argmax(at, axis=-1).astype(jnp.int32)  # [B, length]


def accept_tree_greedy(tree: Tree, target_logits: jax.Array, depth: int):
    """target_logits [B, N, V] -> (last accepted node [B], accepted drafts [B] = its depth, next token [B])."""
    n = tree.num_nodes
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    up = jnp.maximum(tree.parents, 0)
    is_root = (jnp.arange(n) == 0)[None, :]
    match = (tree.tokens == jnp.take_along_axis(choice, up, axis=1)) & ~is_root
    accepted = jnp.broadcast_to(is_root, match.shape)
    for _ in range(depth):
        accepted = is_root | (match & jnp.take_along_axis(accepted, up, axis=1))
    last = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1).astype(jnp.int32)
    n_acc = jnp.take_along_axis(tree.depths, last[:, None], axis=1)[:, 0]
    return last, n_acc, jnp.take_along_axis(choice, last[:, None], axis=1)[:, 0]


def sibling_ranks(tree: Tree) -> jax.Array:
    """[B, N] int32: how many earlier nodes share each node's parent (0 for the best child)."""
    same = tree.parents[:, :, None] == tree.parents[:, None, :]  # [B, N, N]
    earlier = jnp.tril(jnp.ones(same.shape[1:], bool), -1)[None]
    return jnp.sum(same & earlier, axis=-1).astype(jnp.int32)


def tree_uniforms(key: jax.Array, b: int, depth: int, branching: int) -> tuple[jax.Array, jax.Array]:
    """The uniforms one tree acceptance consumes: [B, depth, branching] for the sibling tests and
    [B, depth + 1] for the draw at each level."""
    def u(i):
        return jax.random.uniform(jax.random.fold_in(key, i), (b,), jnp.float32)

    tests = [[u(2 * (level * branching + r)) for r in range(branching)] for level in range(depth)]
    draws = [u(2 * (level * branching + branching) + 1) for level in range(depth + 1)]
    tests = jnp.stack([jnp.stack(t, -1) for t in tests], 1) if depth else jnp.zeros((b, 0, branching))
    return tests, jnp.stack(draws, -1)


def recursive_rejection(key: jax.Array, tree: Tree, p: jax.Array, depth: int, branching: int):
    """Lossless tree acceptance on explicit target distributions p [B, N, V] (p[:, i] = the target's
    next-token distribution after node i) -> (last node [B], accepted drafts [B], next token [B])."""
    u_tests, u_draws = tree_uniforms(key, p.shape[0], depth, branching)
    return recursive_rejection_uniform(u_tests, u_draws, tree, p, depth, branching)


def recursive_rejection_uniform(u_tests: jax.Array, u_draws: jax.Array, tree: Tree, p: jax.Array, depth: int,
                                branching: int):
    """`recursive_rejection` given its uniforms (`tree_uniforms`)."""
    b, n, v = p.shape
    p = p.astype(jnp.float32)
    ranks = sibling_ranks(tree)
    rows = jnp.arange(b)
    cur = jnp.zeros((b,), jnp.int32)
    walking = jnp.ones((b,), bool)
    next_token = jnp.zeros((b,), jnp.int32)
    for level in range(depth + 1):  # the last level only draws the bonus token at a depth-D node
        residual = p[rows, cur]  # [B, V]
        moved = jnp.zeros((b,), bool)
        new_cur = cur
        for r in range(branching if level < depth else 0):
            is_child = (tree.parents == cur[:, None]) & (ranks == r)  # [B, N]
            exists = is_child.any(axis=1) & walking & ~moved
            child = jnp.argmax(is_child, axis=1).astype(jnp.int32)
            tok = tree.tokens[rows, child]
            mass = residual[rows, tok]
            accept = exists & (u_tests[:, level, r] * residual.sum(axis=-1) < mass)
            moved = moved | accept
            new_cur = jnp.where(accept, child, new_cur)
            residual = jnp.where((exists & ~accept)[:, None], residual.at[rows, tok].set(0.0), residual)
        stop = walking & ~moved
        total = residual.sum(axis=-1, keepdims=True)
        # total == 0 only if the rejected siblings held all of p's mass, when a rejection cannot happen
        draw_token = draw(u_draws[:, level], jnp.where(total > 0, residual, p[rows, cur]))
        next_token = jnp.where(stop, draw_token, next_token)
        walking = walking & moved
        cur = new_cur
    n_acc = jnp.take_along_axis(tree.depths, cur[:, None], axis=1)[:, 0]
    return cur, n_acc, next_token


def accept_tree_sampled(u_tests: jax.Array, u_draws: jax.Array, tree: Tree, target_logits: jax.Array,
                        sampling: RequestSampling, depth: int, branching: int):
    """Recursive rejection sampling on the target's logits under the sampling transform, given its
    uniforms (the serving engine draws them row by row from each row's key)."""
    return recursive_rejection_uniform(u_tests, u_draws, tree, probabilities(target_logits, sampling), depth,
                                       branching)


def verify_tree(key: jax.Array, tree: Tree, target_logits: jax.Array, sampling: RequestSampling,
                depth: int, branching: int):
    """The one entry the tree loop calls: greedy path matching or recursive rejection sampling."""
    if as_request_sampling(sampling).greedy:
        return accept_tree_greedy(tree, target_logits, depth)
    u_tests, u_draws = tree_uniforms(key, target_logits.shape[0], depth, branching)
    return accept_tree_sampled(u_tests, u_draws, tree, target_logits, sampling, depth, branching)
