"""Proposers: where a round's rewrites come from (`guided` by the cost model, `optuna` search, `memory`,
`integrate`), and a registry for more. A proposer sees the space, the incumbent, the cost model's
attribution and memory, never the gate's prompts. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from typing import Any, Callable

import optuna

from specpilot import plan as plan_mod
from specpilot.agent import space as sp

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Proposal:
    rewrite: dict
    proposer: str
    why: str
    cheap: bool = False  # run a short stage first, for the proposer's pruner
    handle: Any = None  # the proposer's own bookkeeping (an Optuna trial)
    variant: Any = None  # a kernel variant (`variants.Variant`) the rewrite names, written to a sandbox
    dropped: str | None = None  # why this proposal cannot run at all (an unusable reply), recorded as such


@dataclasses.dataclass
class Context:
    space: sp.Space
    incumbent: dict  # the incumbent plan's fields
    attribution: dict | None  # `prediction.attribute` of the incumbent's measured run
    tried: set[str]  # `space.rewrite_key` of every rewrite already evaluated or dropped here
    seeds: list[dict] = dataclasses.field(default_factory=list)  # memory's rewrites, nearest first
    # rewrites the gate accepted last round that did not become the incumbent (integration)
    survivors: list[dict] = dataclasses.field(default_factory=list)
    # {plan key: why}: plans memory saw lose clearly at a near deployment (`Memory.losses`), not proposed
    avoid: dict[str, str] = dataclasses.field(default_factory=dict)
    # a plan's predicted seconds per output token at this deployment, None where unknown (`predicted`)
    predict: Callable[[plan_mod.Plan], float | None] | None = None

    def avoided(self, rewrite: dict) -> str | None:
        """Why the plan `rewrite` makes of the incumbent is in `avoid`, or None."""
        if not self.avoid:
            return None
        out = self.space.rewrite("probe", self.incumbent, rewrite)
        return None if isinstance(out, sp.Dropped) else self.avoid.get(sp.rewrite_key(out[0]))


class Proposer:
    name = "base"

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        raise NotImplementedError

    def observe(self, proposal: Proposal, s_per_token: float | None, status: str,
                incumbent_s_per_token: float | None = None) -> None:
        """The outcome of one proposal: the full run's time per token (None if it failed or was pruned), and
        the incumbent's, timed beside it (None where the proposal did not run)."""

    def should_prune(self, proposal: Proposal, cheap_s_per_token: float) -> bool:
        return False


REGISTRY: dict[str, Callable[..., Proposer]] = {}


def register(name: str):
    def deco(factory):
        REGISTRY[name] = factory
        return factory
    return deco


def make(names, seed: int = 0, **options) -> list[Proposer]:
    """The named proposers; each factory gets the `options` its signature names (`llm=`: agent.llm)."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"agent.proposers: unknown {', '.join(map(repr, unknown))}; known: {', '.join(REGISTRY)}")
    out = []
    for n in names:
        params = inspect.signature(REGISTRY[n]).parameters
        out.append(REGISTRY[n](seed=seed, **{k: v for k, v in options.items() if k in params}))
    return out


def _fresh(ctx: Context, rewrite: dict, taken: set[str]) -> bool:
    key = sp.rewrite_key(rewrite)
    return key not in ctx.tried and key not in taken and ctx.avoided(rewrite) is None


@register("guided")
class GuidedProposer(Proposer):
    """The largest gap of the incumbent's attribution first, the rewrites that target it."""

    name = "guided"

    def __init__(self, seed: int = 0):
        self.seed = seed

    @staticmethod
    def targets(attribution: dict | None) -> list[tuple[str, float]]:
        """(stage or kernel class, lost ms) by lost time, largest first (no attribution: every stage)."""
        if not attribution:
            return [("verify", 0.0), ("matmul", 0.0), ("draft", 0.0), ("accept", 0.0)]
        rows = [(r["stage"], r["lost_ms"]) for r in attribution.get("stages", [])]
        rows += [(r["class"], r["lost_ms"]) for r in attribution.get("classes", [])]
        seen, out = set(), []
        for name, lost in sorted(rows, key=lambda r: -r[1]):
            if name not in seen:
                seen.add(name)
                out.append((name, lost))
        return out

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        out, taken = [], set()
        for target, lost in self.targets(ctx.attribution):
            for choice in ctx.space.targeting(target):
                for rw in sp.single_field_rewrites(ctx.space, ctx.incumbent, choice):
                    if len(out) < n and _fresh(ctx, rw, taken):
                        taken.add(sp.rewrite_key(rw))
                        out.append(Proposal(rw, self.name, f"{target} loses {lost:.3f} ms per step to its floor; "
                                                           f"{choice.field} acts on it"))
        return out


@register("memory")
class MemoryProposer(Proposer):
    """Mechanisms memory validated at the nearest deployments first."""

    name = "memory"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        out, taken = [], set()
        for rw in ctx.seeds:
            if len(out) < n and _fresh(ctx, rw, taken):
                taken.add(sp.rewrite_key(rw))
                out.append(Proposal(dict(rw), self.name, "validated at a similar deployment (memory)"))
        return out


@register("integrate")
class IntegrateProposer(Proposer):
    """Last round's other survivors on top of the new incumbent: all of them combined first (a plan per
    field, compatible when they set different fields), then each alone."""

    name = "integrate"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        out, taken, combined = [], set(), {}
        fields = [set(rw) for rw in ctx.survivors]
        compatible = all(not (a & b) for i, a in enumerate(fields) for b in fields[i + 1:])
        if len(ctx.survivors) > 1 and compatible:
            for rw in ctx.survivors:
                combined.update(rw)
        for rw in ([combined] if combined else []) + list(ctx.survivors):
            if len(out) < n and _fresh(ctx, rw, taken):
                taken.add(sp.rewrite_key(rw))
                out.append(Proposal(dict(rw), self.name, "accepted last round next to the incumbent's rewrite"))
        return out


@register("optuna")
class OptunaProposer(Proposer):
    """Ask/tell over the space: TPE sampler, successive-halving pruning on the cheap stage."""

    name = "optuna"

    def __init__(self, seed: int = 0, min_resource: int = 1, reduction_factor: int = 2):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.study = optuna.create_study(
            direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=4),
            pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource,
                                                          reduction_factor=reduction_factor))

    @staticmethod
    def _encode(v):
        return json.dumps(list(v) if isinstance(v, tuple) else v, sort_keys=True)

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        out, taken = [], set()
        for _ in range(4 * n):
            if len(out) >= n:
                break
            trial = self.study.ask()
            rw = {}
            for c in ctx.space.choices:
                if not c.applies(sp.apply(ctx.incumbent, rw)):
                    continue  # e.g. a config field of an implementation not run, a block size of a tree
                value = json.loads(trial.suggest_categorical(c.field, [self._encode(v) for v in c.values]))
                current = sp.current_value(ctx.incumbent, c.field)
                if c.field == "mesh" and current is None:
                    current = {"data": 1, "tensor": 1}
                if value != current:
                    rw[c.field] = value
            view = sp.apply(ctx.incumbent, rw)
            tree = view.get("tree") or {}
            if rw and all(tree.get(k) for k in ("nodes", "depth", "branching")):
                full = plan_mod.max_nodes(tree["depth"], tree["branching"])
                if tree["nodes"] > full:  # more nodes than the tree has: its largest budget that fits
                    rw["tree.nodes"] = nodes = max([n for n in sp.TREE_NODES if n <= full] or [full])
                    tree = {**tree, "nodes": nodes}
                keep = (view.get("two_level") or {}).get("keep")
                if keep is not None and keep >= tree["nodes"]:  # a first level keeps fewer than the tree has
                    rw["two_level.keep"] = max([k for k in sp.TWO_LEVEL_KEEP if k < tree["nodes"]] or [2])
            if not rw or not _fresh(ctx, rw, taken):
                self.study.tell(trial, state=self.optuna.trial.TrialState.PRUNED)
                continue
            checked = ctx.space.rewrite("probe", ctx.incumbent, rw)
            if isinstance(checked, sp.Dropped):  # an impossible combination (e.g. of batching fields): the
                self.study.tell(trial, state=self.optuna.trial.TrialState.FAIL)  # sampler learns, asks again
                continue
            taken.add(sp.rewrite_key(rw))
            out.append(Proposal(rw, self.name, f"TPE trial {trial.number}", cheap=True, handle=trial))
        return out

    def should_prune(self, proposal: Proposal, cheap_s_per_token: float) -> bool:
        proposal.handle.report(cheap_s_per_token, step=1)
        return proposal.handle.should_prune()

    def observe(self, proposal: Proposal, s_per_token: float | None, status: str,
                incumbent_s_per_token: float | None = None) -> None:
        trial = proposal.handle
        if trial is None:
            return
        states = self.optuna.trial.TrialState
        if status == "pruned":
            self.study.tell(trial, state=states.PRUNED)
        elif s_per_token is None:
            self.study.tell(trial, state=states.FAIL)
        else:
            self.study.tell(trial, s_per_token)
