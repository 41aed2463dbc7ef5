"""The gate: what a candidate must pass to replace the incumbent, checked in the driver, never in a candidate.

On prompts drawn fresh each round from a held-out pool the proposers never see, a candidate's timed tokens
must be identical across runs, forcing-clean against stock, equal to the AR reference's, not faster than
the cost model's ceiling, and faster than the incumbent measured in the same session by the noise margin.
Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import dataclasses
import secrets

import numpy as np
from omegaconf import DictConfig, OmegaConf

from specpilot import forcing
from specpilot.agent import candidate_io
from specpilot.costmodel import roofline
from specpilot.harness import deploy, methods, shapes
from specpilot.harness.config_schema import build_plans, typed
from specpilot.plan import Plan


@dataclasses.dataclass
class Verdict:
    accepted: bool
    reasons: list[str]  # why not (empty if accepted)
    flagged: bool = False  # faster than the ceiling: something skipped work or faked its numbers
    mismatches: int | None = None
    near_ties: int | None = None
    reference_equal: bool | None = None
    speedup: float | None = None  # incumbent's time per token / the candidate's
    ceiling_s_per_token: float | None = None
    forcing_summary: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Gate:
    """Fresh prompts per round, the references' outputs on them, and the acceptance rule."""

    def __init__(self, cfg: DictConfig, *, heldout: int, prompts_per_round: int, noise_margin: float = 0.05,
                 tie_margin: float | None = None, secret: int | None = None):
        if prompts_per_round % int(cfg.bench.batch_size):
            raise ValueError(f"agent.prompts_per_round ({prompts_per_round}) must be a multiple of "
                             f"bench.batch_size ({cfg.bench.batch_size}): every prompt is decoded in a full batch")
        if prompts_per_round > heldout:
            raise ValueError(f"agent.prompts_per_round ({prompts_per_round}) is larger than the held-out set "
                             f"(agent.heldout = {heldout})")
        self.noise_margin = float(noise_margin)
        self.tie_margin = float(cfg.decoding.forcing_margin if tie_margin is None else tie_margin)
        self.prompts_per_round = int(prompts_per_round)
        self.secret = secrets.randbits(63) if secret is None else int(secret)
        gcfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        gcfg.decoding.profile_split = False
        gcfg.decoding.plans = {"stock": {"verify": "chain"}} if cfg.drafter.source != "none" else {}
        if cfg.bench.prompts != "random":
            gcfg.bench.num_prompts = int(heldout)
        self.cfg = typed(gcfg)
        plans = build_plans(self.cfg)
        self.reference: Plan = plans[0]
        self.stock: Plan = next((p for p in plans if p.name == "stock"), self.reference)
        self.dep = deploy.build(self.cfg, plans)
        if cfg.bench.prompts == "random":
            rng = np.random.default_rng(self.secret)
            self.pool = rng.integers(0, self.dep.cfg.vocab_size, size=(heldout, int(cfg.bench.prompt_len))).tolist()
        else:
            self.pool = [list(p) for p in self.dep.prompts]
        self._scorer = None
        self.round_prompts: list[list[int]] = []
        self.reference_tokens: list[list[int]] = []

    def draw(self, round_index: int) -> list[list[int]]:
        """This round's prompts: a fresh draw from the pool (seeded by the gate's secret and the round),
        and the AR reference's greedy output on them."""
        rng = np.random.default_rng([self.secret, int(round_index)])
        pick = rng.choice(len(self.pool), size=self.prompts_per_round, replace=False)
        self.round_prompts = [self.pool[int(i)] for i in pick]
        self._set_prompts(self.round_prompts)
        self.reference_tokens = methods.run_plan(self.dep, self.reference).tokens
        return self.round_prompts

    def _set_prompts(self, prompts):
        self.dep.prompts = prompts
        self.dep.reference_tokens = None
        longest = max(len(p) for p in prompts)
        block = max(self.reference.block_size, self.stock.block_size)
        self.dep.cache_len = shapes.cache_len(longest, self.dep.new_tokens, block)

    def forcing_report(self, tokens) -> forcing.ForcingReport:
        """Stock's choices with `tokens` (the candidate's) forced: a mismatch is a position where stock
        would not have chosen the candidate's token."""
        if self._scorer is None:
            self._scorer = methods.scorer(self.dep, self.stock)
        packed, lengths, forced = forcing._packed(self.round_prompts, tokens)
        logits = self._scorer(packed, lengths, forced)
        return forcing.compare(logits, logits, forced, self.tie_margin)

    def ceiling_s_per_token(self, plan: Plan) -> float:
        """The cost model's floor per output token for `plan`, at the most acceptance its block allows."""
        hw = roofline.Hardware.from_conf(self.cfg.gpu)
        dep = self.dep
        context = int(sum(len(p) for p in self.round_prompts) / len(self.round_prompts) + dep.new_tokens / 2)
        if not plan.uses_drafter:
            return roofline.ar_ceiling_s(hw, dep.cfg, dep.batch_size, context, plan.bits_per_weight)
        dcfg = getattr(dep.drafter[0], "inner", dep.drafter[0]).cfg
        return roofline.spec_ceiling_s(hw, dep.cfg, dep.batch_size, context, plan.block_size,
                                        float(plan.block_size), dcfg.num_layers, len(dcfg.tap_layers),
                                        plan.bits_per_weight)["per_token_s"]

    def check(self, result: dict, plan: Plan, incumbent: dict | None) -> Verdict:
        """The verdict on one evaluated candidate (`evaluator` result) against the incumbent's result of
        the same session (None: the incumbent itself, checked for cleanliness only)."""
        if result.get("status") != "ok":
            return Verdict(False, [f"{result.get('status')}: {result.get('reason')}"])
        reasons = []
        runs = [np.asarray(t) for t in result["tokens"]]
        if any(not np.array_equal(runs[0], r) for r in runs[1:]):
            reasons.append("its timed runs produced different tokens")
        try:
            report = self.forcing_report(runs[0])
        except Exception as e:  # the gate's own run (its device's memory, say): this candidate is not judged
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            hint = "; the workers may be pooling the GPU: set agent.worker_gpu_fraction" \
                if candidate_io.out_of_memory(str(e)) else ""
            return Verdict(False, [*reasons, f"not checked: the forcing run failed ({type(e).__name__}: {first}){hint}"])
        v = Verdict(False, reasons, mismatches=report.num_mismatches, near_ties=report.num_near_ties,
                    forcing_summary=report.summary().replace("reference self-mismatches", "stock disagrees"))
        if not report.passed:
            v.reasons.append(f"not forcing-clean: stock chooses another token at {report.num_mismatches} "
                             f"position(s) ({report.num_near_ties} near-ties, margin < {self.tie_margin:g})")
        v.reference_equal = runs[0].tolist() == self.reference_tokens
        if not v.reference_equal:
            differ = sum(a != b for a, b in zip(runs[0].tolist(), self.reference_tokens))
            v.reasons.append(f"not reference-clean: {differ} prompt(s) differ from the AR reference's output")
        v.ceiling_s_per_token = self.ceiling_s_per_token(plan)
        if result["s_per_token"] < v.ceiling_s_per_token:
            v.flagged = True
            v.reasons.append(f"faster than the cost model's ceiling ({1e3 * result['s_per_token']:.4f} < "
                             f"{1e3 * v.ceiling_s_per_token:.4f} ms/token): flagged")
        if incumbent is not None:
            if incumbent.get("status") != "ok":
                v.reasons.append("the incumbent was not measured in this session")
            else:
                v.speedup = incumbent["s_per_token"] / result["s_per_token"]
                if result["s_per_token"] >= incumbent["s_per_token"] * (1 - self.noise_margin):
                    v.reasons.append(f"not faster than the incumbent by the noise margin ({v.speedup:.3f}x, "
                                     f"needs > {1 / (1 - self.noise_margin):.3f}x)")
        v.accepted = not v.reasons
        return v
