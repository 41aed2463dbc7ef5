"""Bytes and FLOPs of one tree step (`decoding.tree`) and one two-level step (`decoding.two_level`), per stage.
Design notes: docs/design/costmodel.md.
"""

from __future__ import annotations

from specpilot.costmodel.kernel_counts import (F32, StepCounter, commit_snapshots, drafter_extend,
                                               drafter_propose, target_forward)
from specpilot.plan import check_first_level


def check_tree_plan(plan, shape) -> None:
    """Clear errors for a tree or two_level plan that cannot run at `shape` (a `counts.Shape`)."""
    t = plan.tree
    if t is None:
        raise ValueError(f"plan {plan.name!r}: {plan.verify} verification needs tree: {{nodes, depth, branching}}")
    if shape.drafter is None:
        raise ValueError(f"plan {plan.name!r} drafts a tree; the shape has no drafter config")
    block = getattr(shape.drafter, "block_size", None)
    if block is not None and t.depth + 1 > block:
        raise ValueError(f"plan {plan.name!r}: tree.depth {t.depth} needs a drafter block of {t.depth + 1}; "
                         f"the drafter's is {block}")
    if shape.hybrid and t.width > shape.max_block:
        raise ValueError(f"plan {plan.name!r}: tree.nodes {t.nodes} (width {t.width}) exceeds the hybrid "
                         f"target's {shape.max_block} per-node snapshots (Shape.max_block)")
    if plan.verify == "two_level":
        lv = plan.two_level
        try:
            check_first_level(lv.first, lv.keep, lv.exit_layer, t.nodes, shape.target.num_layers)
        except ValueError as e:
            raise ValueError(f"plan {plan.name!r}: {e}") from None


def build_tree(st: StepCounter, nodes: int, depth: int, branching: int):
    """The builder beyond its top-k: the beam's scores and indices per depth, the final top-k, the
    ancestor matrix (depth + 1 one-hot passes over [B, N, N])."""
    b = st.s.batch
    beam = depth * (nodes - 1) * branching * 2 * (F32 + 4)
    st.add(stage="draft", cls="bookkeeping", name="draft.build_tree",
           bytes=b * (beam + depth * (nodes - 1) * 2 * 4 + (depth + 1) * 2 * nodes * nodes))


def accept_tree(st: StepCounter, nodes: int, depth: int, branching: int):
    """Acceptance over a tree's logits [B, N, V] and the path commit (module docstring)."""
    b, cfg = st.s.batch, st.s.target
    if st.s.greedy:
        st.logits_pass("accept", "accept.verify_logits", 1, b * nodes)
    else:  # probabilities of p, then per level a residual row and each sibling's read, zeroing and sum
        st.logits_pass("accept", "accept.verify_logits", 6, b * nodes)
        st.logits_pass("accept", "accept.recursive_rejection", 3 * branching * depth + 7 * (depth + 1), b)
    n_attn = cfg.num_layers - (sum(cfg.is_linear(i) for i in range(cfg.num_layers)) if st.s.hybrid else 0)
    rows = b * (depth + 1) * cfg.num_kv_heads * cfg.head_dim * st.e
    if n_attn:  # K and V: gathered (read, write), scattered back (read, write)
        st.add(stage="accept", cls="cache_write", name="target.path_commit", count=n_attn,
               bytes=n_attn * 2 * 4 * rows)
    commit_snapshots(st)
    drafter_extend(st, depth + 1)


def first_level(st: StepCounter, plan, nodes: int, depth: int):
    """The two-level plan's first level over the drafted `nodes`-node tree (stage verify)."""
    b = st.s.batch
    lv = plan.two_level
    if lv.first == "early_exit":
        st.tree = True
        target_forward(st, "verify", nodes, layers=lv.exit_layer, who="first_level")
        st.tree = False
        st.logits_pass("verify", "first_level.log_softmax", 3, b * nodes)
    scores = depth * nodes * 3 * F32  # path_scores: a gather and an add per depth
    select = nodes * nodes * (2 * F32 + 8)  # ancestors' minimum, the ranking comparisons
    st.add(stage="verify", cls="bookkeeping", name="first_level.select_subtree", bytes=b * (scores + select))


def tree_step(st: StepCounter, plan, shape) -> None:
    """Every kernel of one tree or two-level step into `st` (`counts.step_counts` calls it)."""
    check_tree_plan(plan, shape)
    t = plan.tree
    nodes, depth, k = t.nodes, t.depth, t.branching
    drafter_propose(st, depth + 1, choose_passes=3 + 3 * k)  # log-softmax, then k argmax passes
    build_tree(st, nodes, depth, k)
    verified = nodes
    if plan.verify == "two_level":
        first_level(st, plan, nodes, depth)
        verified = plan.two_level.keep
    st.tree = True
    target_forward(st, "verify", verified)
    st.tree = False
    accept_tree(st, verified, depth, k)
