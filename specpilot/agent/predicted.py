"""The `predicted` proposer: plans the cost model predicts faster than the incumbent, best first.

A plan's time per token is its predicted step time over its τ. The step time comes from the cost model at
the deployment's shape and the device's calibrated rates. τ comes from what the deployment knows:
- an oracle_trace drafter with an acceptance model samples a trace for any shape, as a run of the plan would;
- a constant-profile oracle gives a chain's τ at any block size from its profile;
- any other drafter gives τ only for the incumbent's own drafting shape (its measured τ). That covers
  weight-format and kernel rewrites; other shapes are not predicted and not proposed.
The proposer enumerates the structural fields jointly (verification kind, block size, tree shape, two-level
cut, weight format and W12 classes, the chain attention's kernel), so multi-field plans such as W12 with a
32-node tree are reached, which single-field rewrites from a chain never are.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, Mapping

from specpilot import plan as plan_mod
from specpilot.agent import space as sp
from specpilot.agent.proposers import Context, Proposal, Proposer, _fresh, register
from specpilot.costmodel import prediction
from specpilot.models import oracle
from specpilot.models.oracle import OracleDrafter
from specpilot.models.oracle_trace import OracleTraceDrafter, sample_for_plan, trace_tau

log = logging.getLogger(__name__)

# the fields enumerated jointly, in an order where each field's condition (`Choice.when`) is set before it
STRUCTURAL = ("verify", "block_size", "tree.nodes", "tree.depth", "tree.branching", "two_level.first",
              "two_level.keep", "weights", "w12_matrices", "kernels.attention.implementation")
MAX_PLANS = 20000  # enumeration cap: beyond it the rest are left out (logged)
MIN_GAIN = 1.02  # predicted gain a plan needs over the incumbent's prediction to be proposed


def plan_kind(plan: plan_mod.Plan) -> tuple:
    """The mechanism a plan stands for (verification, weight format, a chain attention kernel): a round's
    proposals spread over kinds, and a measured plan corrects the predictions of its kind."""
    return plan.verify, plan.weights, plan.kernels.attention.implementation[0] != "xla"


def _attention_pays(ctx, base: plan_mod.Plan, plan: plan_mod.Plan, s: float) -> bool:
    """Whether a plan's chain attention kernel, where it differs from the incumbent's, is itself predicted
    MIN_GAIN faster than the same plan on the incumbent's (near-ties would double a round's proposals)."""
    if plan.kernels.attention == base.kernels.attention:
        return True
    same = dataclasses.replace(plan, kernels=dataclasses.replace(plan.kernels, attention=base.kernels.attention))
    other = ctx.predict(same)
    return other is None or other / s >= MIN_GAIN


def drafting_shape(plan: plan_mod.Plan) -> tuple:
    """What a plan's acceptance depends on: how it drafts and verifies (not its weights or kernels)."""
    return plan.verify, plan.block_size, plan.tree, plan.two_level


@dataclasses.dataclass
class Predictor:
    """Predicted seconds per output token of a plan at this deployment, or None where its τ is unknown."""

    setting: prediction.Setting
    drafter: object  # the deployment's drafter (dep.drafter[0]), or None
    incumbent: plan_mod.Plan
    incumbent_tau: float  # the incumbent's measured τ

    def tau(self, plan: plan_mod.Plan) -> float | None:
        if plan.verify == "ar":
            return 1.0
        d = self.drafter
        if isinstance(d, OracleTraceDrafter) and d.model is not None:
            try:  # the trace a run of the plan replays (sampled once per shape)
                return trace_tau(sample_for_plan(d.model, plan))
            except ValueError:  # a shape the model cannot sample (an early-exit first level, too deep)
                return None
        if isinstance(d, OracleDrafter) and plan.verify == "chain":
            conditional = d.conditional[: plan.block_size - 1]
            return oracle.expected_tau(conditional) if len(conditional) == plan.block_size - 1 else None
        if drafting_shape(plan) == drafting_shape(self.incumbent):
            return self.incumbent_tau
        return None

    def __call__(self, plan: plan_mod.Plan) -> float | None:
        tau = self.tau(plan)
        if tau is None:
            return None
        try:
            return prediction.predict(plan, self.setting, None if plan.verify == "ar" else tau).per_token_s
        except (NotImplementedError, ValueError) as e:
            log.debug("no prediction for %s: %s", plan.name, e)
            return None


def structural_rewrites(space: sp.Space, incumbent: Mapping) -> Iterator[dict]:
    """Every joint assignment of the space's structural fields that differs from the incumbent, each as the
    rewrite of the fields it changes (a field whose condition does not hold is left out)."""
    choices = [space.choice(f) for f in STRUCTURAL if space.choice(f) is not None]

    def walk(i: int, fields: dict, rewrite: dict) -> Iterator[dict]:
        if i == len(choices):
            yield rewrite
            return
        c = choices[i]
        if not c.applies(fields):
            yield from walk(i + 1, fields, rewrite)
            return
        current = sp.current_value(fields, c.field)
        for v in c.values:
            value = list(v) if isinstance(v, tuple) else v
            if c.field == "two_level.keep" and value >= (sp.current_value(fields, "tree.nodes") or 0):
                continue  # a first level keeps fewer nodes than the tree it cuts
            step = {} if value == current else {c.field: value}
            yield from walk(i + 1, sp.apply(fields, step) if step else fields, {**rewrite, **step})

    seen = set()
    for i, rw in enumerate(walk(0, dict(incumbent), {})):
        if i == MAX_PLANS:
            log.warning("predicted: the structural space has more than %d plans; the rest are left out", MAX_PLANS)
            return
        key = sp.rewrite_key(rw)
        if rw and key not in seen:
            seen.add(key)
            yield rw


@register("predicted")
class PredictedProposer(Proposer):
    """The plans the cost model predicts fastest (`Context.predict`), best first, while predicted at least
    MIN_GAIN faster than the incumbent; nothing where the loop has no prediction for the incumbent. Each
    measured proposal corrects the predictions of its kind (`plan_kind`) for the rest of
    the run by measured gain over predicted gain, so a kind the model overrates stops being proposed."""

    name = "predicted"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.correction: dict[tuple, float] = {}  # kind -> measured gain / predicted gain, last measured

    def observe(self, proposal: Proposal, s_per_token: float | None, status: str,
                incumbent_s_per_token: float | None = None) -> None:
        if not isinstance(proposal.handle, tuple) or not s_per_token or not incumbent_s_per_token:
            return
        kind, predicted_gain = proposal.handle
        self.correction[kind] = (incumbent_s_per_token / s_per_token) / predicted_gain

    def propose(self, ctx: Context, n: int) -> list[Proposal]:
        if ctx.predict is None:
            return []
        base = ctx.space.quick_plan("incumbent", ctx.incumbent)
        base_s = ctx.predict(base) if base is not None else None
        if base_s is None:
            return []
        ranked, plans = [], set()
        for rw in structural_rewrites(ctx.space, ctx.incumbent):
            plan = ctx.space.quick_plan("candidate", sp.apply(ctx.incumbent, rw))
            if plan is None or plan in plans:  # the same plan by another rewrite (a default set explicitly)
                continue
            plans.add(plan)
            s = ctx.predict(plan)
            if s is None or not _attention_pays(ctx, base, plan, s):
                continue
            kind = plan_kind(plan)
            s /= self.correction.get(kind, 1.0)
            if base_s / s >= MIN_GAIN:
                ranked.append((s, sp.rewrite_key(rw), rw, kind))
        ranked.sort(key=lambda x: (x[0], x[1]))
        # the best plan of each kind (`plan_kind`) first, then the rest by prediction: a
        # round's few proposals spread over the mechanisms instead of near-copies of one
        firsts, seen = [], set()
        for x in ranked:
            if x[3] not in seen:
                seen.add(x[3])
                firsts.append(x)
        setting = getattr(ctx.predict, "setting", None)
        rates = "" if setting is None or setting.rates.calibrated else \
            f"; from the gpu config's datasheet numbers: no rates measured on {setting.rates.device}"
        out, taken = [], set()
        for s, _, rw, kind in firsts + [x for x in ranked if x not in firsts]:
            if len(out) == n:
                break
            if _fresh(ctx, rw, taken):
                taken.add(sp.rewrite_key(rw))
                corrected = f", corrected by {self.correction[kind]:.2f} from a measured {' '.join(kind)} plan" \
                    if kind in self.correction else ""
                out.append(Proposal(rw, self.name, f"the cost model predicts {1e3 * s:.3f} ms/token of decoding "
                                                   f"(prefill not counted) against the incumbent's {1e3 * base_s:.3f} "
                                                   f"({base_s / s:.2f}x{corrected}){rates}",
                                    handle=(kind, base_s / s)))
        return out
