"""What a serving engine can run, checked before anything is built or compiled: the plan (two_level plans
are refused), a tree engine's batching and drafter block, and the verification token budget of a
batching. Each refusal names the field and the fix.
"""

from __future__ import annotations

from specpilot.decoding.tree import check_depth
from specpilot.plan import Batching, TreeShape
from specpilot.serving.packed import check_packable

def check_plan(plan) -> None:
    """Plans the engine cannot run yet are refused, naming the plan and field."""
    if plan.verify == "two_level":
        raise NotImplementedError(f"decoding.plans.{plan.name}.verify: two_level plans do not run through the "
                                  f"engine yet; use an ar, chain or tree plan")


TREE_BATCHING = (("draft_budget", "fixed"), ("verify", "padded"), ("overlap", "none"))  # what a tree step runs


def check_tree_batching(b: Batching, where: str = "the engine's") -> None:
    """A tree engine verifies every row's whole tree each step: the chain-only mechanisms are refused
    (a tree plan's own batching cannot hold them, `Plan`; an engine's batching argument may)."""
    for field, plain in TREE_BATCHING:
        if getattr(b, field) != plain:
            raise NotImplementedError(f"{where}.batching.{field}: {getattr(b, field)!r} is not implemented for "
                                      f"tree plans (every row verifies its whole tree); use {field}: {plain}")


def token_budget(b: Batching, slots: int, bs: int, target) -> int:
    """The verification tokens one decode may check over the batch; a batching the engine cannot run
    raises ValueError (NotImplementedError for packed hybrid or sharded targets) naming the field."""
    if not isinstance(b, Batching):
        raise ValueError(f"batching must be a plan.Batching, got {type(b).__name__}")
    if bs == 1:
        for field, plain in (("draft_budget", "fixed"), ("verify", "padded")):
            if getattr(b, field) != plain:
                raise ValueError(f"batching.{field}: {getattr(b, field)!r} needs a drafter (block_size >= 2)")
        return slots
    full = slots * bs
    budget = full if b.token_budget is None else int(b.token_budget)
    if b.draft_budget == "fixed" and budget < full:
        raise ValueError(f"batching.token_budget: {budget} is less than the {slots} slots x block {bs} = {full} "
                         f"tokens fixed draft counts verify; give >= {full} or draft_budget: confidence")
    if budget < 2 * slots:
        raise ValueError(f"batching.token_budget: {budget} leaves some of the {slots} slots without a draft "
                         f"(each verifies its last token and >= 1 draft: >= {2 * slots})")
    if b.verify == "packed":
        check_packable(target)
    return min(budget, full)


def stream_sizes(b: Batching, budget: int) -> tuple[int, ...]:
    """Packed verification's stream sizes: `b.streams` sizes evenly spaced up to `budget` (each >= 2,
    duplicates dropped); () for padded verification."""
    if b.verify != "packed":
        return ()
    return tuple(sorted({max(2, -(-budget * i // b.streams)) for i in range(1, b.streams + 1)}))


def tree_block_size(tree: TreeShape, drafter, block_size: int | None) -> int:
    """A tree engine's drafter block, depth + 1; `block_size` may be left out or be the plan's (the tree's
    width max(nodes, depth + 1))."""
    if drafter is None:
        raise ValueError("a tree engine needs a drafter")
    if block_size not in (None, tree.width):
        raise ValueError(f"block_size {block_size}: a tree engine's is its width max(nodes, depth + 1) = "
                         f"{tree.width} (or leave it out)")
    check_depth(drafter, tree.depth)
    return tree.depth + 1
