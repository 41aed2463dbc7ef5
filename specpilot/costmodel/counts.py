"""Bytes and FLOPs of every kernel one decoding step of a plan runs, per stage, for dense and hybrid
targets: `step_counts(plan, shape)` (AR and chain here, tree and two-level plans through `tree_counts`)
and `forward_counts` for a lone target forward. The prediction and the floors are computed from these
counts; docs/design/costmodel.md explains what is counted and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specpilot.costmodel import tree_counts
# the records stay importable from here (`counts.Shape`, `counts.StepCounts`, `counts.STAGES`)
from specpilot.costmodel.kernel_counts import (CLASSES, F32, STAGES, Kernel, Shape, StepCounter,  # noqa: F401
                                               StepCounts, accept, drafter_extend, drafter_propose,
                                               target_forward)
from specpilot.plan import Kernels, Plan


@dataclasses.dataclass(frozen=True)
class _Forward:
    """The plan fields a lone target forward needs."""

    weights: str = "bf16"
    kernels: Any = None
    name: str = "forward"

    def w12_params(self) -> tuple[tuple[str, ...], bool, bool]:
        """A lone forward's W12 encodes every matrix class (`Plan.w12_params`)."""
        return Plan("forward", verify="ar", weights=self.weights).w12_params()


def forward_counts(shape: Shape, tokens: int, weights: str = "bf16") -> StepCounts:
    """One target forward of `tokens` positions per sequence (stage "verify"), XLA's matmuls."""
    st = StepCounter(_Forward(weights, Kernels()), shape)
    target_forward(st, "verify", tokens)
    return StepCounts(tuple(st.kernels))


def step_counts(plan, shape: Shape) -> StepCounts:
    """Every kernel of one decoding step of `plan` (a `specpilot.plan.Plan`) at `shape`."""
    st = StepCounter(plan, shape)
    if plan.verify == "ar":
        target_forward(st, "verify", 1)
        accept(st, 1)
    elif plan.verify == "chain":
        if shape.drafter is None:
            raise ValueError(f"plan {plan.name!r} verifies drafted blocks; the shape has no drafter config")
        if shape.hybrid and plan.block_size > shape.max_block:
            raise ValueError(f"block size {plan.block_size} exceeds the hybrid target's {shape.max_block} "
                             "per-token snapshots (Shape.max_block)")
        drafter_propose(st, plan.block_size)
        target_forward(st, "verify", plan.block_size)
        accept(st, plan.block_size)
        drafter_extend(st, plan.block_size)
    elif plan.verify in ("tree", "two_level"):
        tree_counts.tree_step(st, plan, shape)
    else:
        raise NotImplementedError(f"plan {plan.name!r}: no cost counts for {plan.verify!r} verification")
    return StepCounts(tuple(st.kernels))
