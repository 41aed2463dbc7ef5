"""The optimization loop: rounds of propose -> evaluate in isolation -> gate -> remember, for one deployment.

Each round the proposers read the cost model's attribution of the incumbent's measured run and memory's
mechanisms, the candidates run in parallel next to the incumbent re-measured in the same session, and the
gate's fastest accepted candidate becomes the incumbent; everything is recorded as it happens, so the same
command resumes after an interrupt. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import logging
import platform as platform_mod
from pathlib import Path
from typing import Any, Callable

import jax
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pallas_kernels.dispatch import is_variant

from specpilot import atomic_io
from specpilot.agent import cluster_security
from specpilot.agent import evaluator as ev
from specpilot.agent import memory as mem
from specpilot.agent import predicted  # registers "predicted"
from specpilot.agent import proposers as props
from specpilot.agent import report
from specpilot.agent import space as sp
from specpilot.harness import kernel_variants as va
from specpilot.agent.gate import Gate
from specpilot.agent.kernel_proposers import LLMConf, LLMProposer  # registers "template", "llm"
from specpilot.costmodel import counts, prediction, roofline
from specpilot.costmodel.rates import Rates
from specpilot.sharding import MeshShape

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AgentConf:
    rounds: int = 2
    workers: int = 2
    timeout_s: float = 300.0  # per candidate process
    memory_mb: int = 8192  # address-space limit per candidate process
    proposers: list = dataclasses.field(
        default_factory=lambda: ["memory", "integrate", "predicted", "guided", "optuna"])
    per_proposer: int = 2  # proposals per proposer per round
    memory_url: str | None = None  # default: sqlite:///<cache_dir>/agent_memory.db
    heldout: int = 16  # the gate's held-out prompt pool
    prompts_per_round: int = 2
    repeats: int = 3  # timed runs per candidate (median)
    noise_margin: float = 0.05  # a candidate must be this much faster than the incumbent
    cheap_fraction: float = 0.25  # the cheap stage's share of bench.new_tokens
    name: str = ""  # part of the run key: another name starts another run at the same deployment
    plan_name: str = "found"  # the winning plan's name in its decoding file
    seed: int = 0
    # an existing Dask scheduler (dask-scheduler; SPECPILOT_DEVICE_GROUP=gpu:0 dask-worker --resources device_group=1)
    scheduler: str | None = None
    timing_slots: int = 1  # timing jobs a local worker runs at once (workers without a device group)
    check_workers: int = 0  # CPU-only workers for kernel variants' reference checks (0: in the candidate only)
    llm: LLMConf | None = None  # an OpenAI-compatible endpoint for the "llm" proposer (off: null)
    # candidates given by hand, evaluated in the first round: {name, fields, program (a script run in
    # place of the candidate module, e.g. for tests)}
    candidates: list = dataclasses.field(default_factory=list)
    # how candidates are timed: "harness" (the run harness's fixed batch) or "engine" (the prompts as
    # requests through the serving engine, bench.batch_size slots: the plans' batching fields join the space)
    workload: str = "harness"
    prefill_chunk: int = 64  # workload=engine: prompt tokens a prefilling row is fed per engine step
    dask_log_level: str = "WARNING"  # Dask's own log lines (driver and workers); INFO brings them back
    sandbox: str = "bwrap"  # how proposed code is isolated (agent.sandbox: bwrap | none; evaluator, sandbox)
    # plan-only candidates in a warm worker that keeps the deployment and its compiles, timed in turn with
    # the incumbent (warm_pool); false: every candidate in a fresh process
    warm: bool = True
    tls: cluster_security.TLSConf | None = None  # Dask over TLS, required for a scheduler not on 127.0.0.1
    # the share of a GPU each process the driver starts (workers, candidates) may pool; the rest is the
    # driver's (the gate's deployment, references and scorer). None: jax's default (75%)
    worker_gpu_fraction: float | None = None


def features(cfg: DictConfig, plan_fields: dict, workload: str = "harness") -> dict:
    """The deployment features memory keys mechanisms by (the workload only where it is the engine's)."""
    model = OmegaConf.to_container(cfg.target.model, resolve=True) if cfg.target.get("model") else {}
    return {"target": {"name": cfg.target.name, "source": cfg.target.source, "dtype": cfg.target.dtype,
                       "hidden_size": model.get("hidden_size"), "num_layers": model.get("num_hidden_layers"),
                       "intermediate_size": model.get("intermediate_size"), "vocab_size": model.get("vocab_size")},
            "drafter": {"name": cfg.drafter.name, "source": cfg.drafter.source,
                        "block_size": int(cfg.drafter.block_size), "num_layers": int(cfg.drafter.num_layers)},
            "gpu": cfg.gpu.name, "batch": int(cfg.bench.batch_size), "plan": plan_fields,
            **({"workload": workload} if workload != "harness" else {})}


def versions() -> dict:
    out = {"python": platform_mod.python_version()}
    for pkg in ("jax", "jaxlib", "optuna", "dask", "sqlalchemy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def initial_plan(cfg: DictConfig, space: sp.Space) -> dict:
    """The incumbent to start from: the run's first chain plan (stock), else its first plan, else AR."""
    plans = OmegaConf.to_container(cfg.decoding.plans, resolve=True) or {}
    chain = [f for f in plans.values() if (f or {}).get("verify", "chain") == "chain"]
    fields = chain[0] if chain else (next(iter(plans.values())) if plans else {"verify": "ar"})
    plan = space.check("incumbent", fields)
    if isinstance(plan, str):
        raise ValueError(f"the starting plan is impossible: {plan}")
    return sp.plan_fields(plan)


class Loop:
    def __init__(self, cfg: DictConfig, agent: AgentConf, out_dir: str | Path,
                 progress: Callable[[str], None] = log.info):
        self.cfg, self.agent, self.progress = cfg, agent, progress
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        dev = jax.devices()
        self.space = sp.build_space(cfg, platform=dev[0].platform, devices=len(dev), workload=agent.workload)
        self.incumbent = initial_plan(cfg, self.space)
        self.avoid: dict[str, str] = {}  # plans memory saw lose clearly nearby (`Memory.losses`)
        self.predictor = None  # the cost model's time per token of a plan here (`_attribution` sets it)
        self.groups = None  # one timing worker per device group of the incumbent's mesh
        if dev[0].platform == "gpu" or len(dev) > 1:
            mesh = MeshShape(**(self.incumbent.get("mesh") or {}))
            self.groups = ev.device_group_labels(mesh, dev)
            self.space = sp.build_space(cfg, platform=dev[0].platform, devices=mesh.size, workload=agent.workload)
            progress(f"device groups: {', '.join(self.groups)} (one timing job per group at a time)")
        self.space, removed = self.space.feasible(self.incumbent)
        for d in removed:
            progress(f"rewrite space: {json.dumps(d.rewrite)} left out ({d.reason})")
        self.features = features(cfg, self.incumbent, agent.workload)
        self.memory = mem.Memory(agent.memory_url or mem.default_url(str(cfg.cache_dir)))
        self.key = mem.run_key({k: v for k, v in self.features.items() if k != "plan"}, self.incumbent, agent.name)
        self.versions = versions()
        self.compile_cache = str(Path(cfg.cache_dir).expanduser() / "xla")
        self.sandbox = self.out / "sandbox"  # kernel variants' modules, per round and candidate
        self.variants = recover_variants(self.sandbox)  # name -> Variant (a resumed incumbent may name one)
        self.model_cfg = None  # the target's model config (the gate's deployment): variant check shapes

    def spec(self, name: str, fields: dict, prompts, stage: str = "full", program: str | None = None,
             profile: bool = False) -> dict:
        """One evaluation's spec; `profile`: also the stage split (its programs compile: the incumbent's and a
        winner's, which the attribution reads, never every candidate's)."""
        new = int(self.cfg.bench.new_tokens)
        if stage == "cheap":
            new = max(2, int(round(new * self.agent.cheap_fraction)))
        out = {"name": name, "fields": fields, "config": OmegaConf.to_container(self.cfg, resolve=True),
               "prompts": prompts, "new_tokens": new, "repeats": int(self.agent.repeats), "stage": stage,
               "compile_cache": self.compile_cache, "workload": self.agent.workload,
               "prefill_chunk": int(self.agent.prefill_chunk), "profile": bool(profile)}
        if program:
            out["program"] = str(program)
        named = variant_names(fields)
        if named:
            out["variants"] = [self.variants[n].spec_entry(self.sandbox / name) for n in named]
            block = 1 if fields.get("verify") == "ar" else int(fields.get("block_size") or 1)
            out["variant_check"] = {"shapes": va.check_shapes(self.model_cfg, int(self.cfg.bench.batch_size), block,
                                                              str(fields.get("weights") or "bf16"))}
        return out

    def run(self) -> dict:
        a, memory = self.agent, self.memory
        resumed = memory.start_run(self.key, self.features, self.versions)
        last = memory.last_round(self.key)
        start = 0 if last is None else last.index + 1
        if last is not None:
            self.incumbent = last.incumbent
            self.progress(f"resuming run {self.key} at round {start} (memory: {memory.url})")
        elif resumed:
            self.progress(f"run {self.key}: no round finished before; starting at round 0")
        gate = Gate(self.cfg, heldout=a.heldout, prompts_per_round=a.prompts_per_round,
                    noise_margin=a.noise_margin)
        self.model_cfg = gate.dep.cfg
        names = list(a.proposers) + (["llm"] if a.llm is not None and "llm" not in a.proposers else [])
        proposers = props.make(names, seed=a.seed + start, llm=a.llm)
        seeds = [m.rewrite for m in memory.retrieve(self.features)]
        self.avoid = memory.losses(self.features)
        for why in self.avoid.values():
            self.progress(f"memory: not proposed here, it lost clearly nearby: {why}")
        inc_result, att, survivors = None, None, []
        with ev.Evaluator(a.workers, timeout_s=a.timeout_s, memory_mb=a.memory_mb, workdir=str(self.out / "candidates"),
                          timing_slots=a.timing_slots, address=a.scheduler, groups=self.groups,
                          check_workers=a.check_workers, dask_log_level=a.dask_log_level, sandbox=a.sandbox,
                          tls=a.tls) as evaluator:
            for r in range(start, a.rounds):
                prompts = gate.draw(r)
                self.progress(f"round {r}: {len(prompts)} fresh prompts; incumbent {json.dumps(self.incumbent)}")
                if att is None:
                    inc_spec = self.spec(f"r{r}-incumbent", self.incumbent, prompts, profile=True)
                    inc_result = evaluator.evaluate([inc_spec], warm=a.warm)[0]
                    if inc_result["status"] != "ok":
                        raise RuntimeError(f"the incumbent failed: {inc_result['reason']}")
                    att = self._attribution(gate, self.incumbent, inc_result)
                rows = self._round(r, gate, evaluator, proposers, prompts, att, seeds, survivors)
                inc_now = rows["incumbent"]
                accepted = [row for row in rows["candidates"] if row["status"] == "accepted"]
                best = min(accepted, key=lambda row: row["s_per_token"]) if accepted else None
                old = self.incumbent
                survivors = [row["rewrite"] for row in accepted if row is not best and row["proposer"] != "given"]
                if best is not None:
                    self.incumbent = best["fields"]
                    att = self._attribution(gate, self.incumbent, self._profiled(evaluator, r, best, prompts))
                    memory.record_mechanism(features(self.cfg, old, a.workload), best["rewrite"], best["fields"],
                                            best["gain"], [self.key, best["folder"]], self.versions)
                    self.progress(f"round {r}: accepted {best['name']} ({best['gain']:.3f}x): "
                                  f"{json.dumps(best['rewrite'])}")
                else:
                    att = self._attribution(gate, self.incumbent, inc_now) if inc_now["status"] == "ok" else att
                    self.progress(f"round {r}: no candidate passed the gate; the incumbent stays")
                inc_s = inc_now.get("s_per_token")
                best_s = best["s_per_token"] if best else inc_s
                report.write_round(self.out, r, old, self.incumbent, inc_now, rows["candidates"])
                memory.finish_round(self.key, r, self.incumbent, inc_s, best_s)
                report.plot_best(self.out, memory.rounds(self.key))
                self.progress(f"round {r} done: best {1e3 * best_s:.3f} ms/token" if best_s else f"round {r} done")
        named = [self.variants[n] for n in variant_names(self.incumbent)]
        path = report.write_plan(self.out, a.plan_name, self.incumbent, self.key, named)
        for v in named:
            self.progress(f"the winning plan runs kernel variant {v.name}: its source is in {path}")
        summary = {"run": self.key, "memory": memory.url, "incumbent": self.incumbent, "plan_file": str(path),
                   "rounds": [{"index": x.index, "incumbent_s_per_token": x.incumbent_s_per_token,
                               "best_s_per_token": x.best_s_per_token} for x in memory.rounds(self.key)]}
        atomic_io.write_json(self.out / "summary.json", summary, indent=2)
        return summary

    def _profiled(self, evaluator: ev.Evaluator, r: int, best: dict, prompts) -> dict:
        """The winner's result with its stage split: one profiled evaluation (candidates are timed without
        it); the timed result when that evaluation fails."""
        spec = {**self.spec(f"r{r}-winner", best["fields"], prompts, profile=True), "repeats": 1}
        res = evaluator.evaluate([spec], warm=self.agent.warm)[0]
        return res if res["status"] == "ok" else best["result"]

    def _attribution(self, gate: Gate, fields: dict, result: dict) -> dict | None:
        """The cost model's attribution of the incumbent's measured run; sets `predictor` (the `predicted`
        proposer's) at the same deployment and measured τ."""
        self.predictor = None
        plan = self.space.check("incumbent", fields)
        if isinstance(plan, str):
            return None
        context = int(sum(map(len, gate.round_prompts)) / len(gate.round_prompts) + gate.dep.new_tokens / 2)
        setting = prediction.Setting(counts.Shape.from_deployment(gate.dep, context), Rates.for_gpu(self.cfg.gpu),
                                     roofline.Hardware.from_conf(self.cfg.gpu))
        stats = result.get("stats") or {}
        tau = min(float(stats.get("tau") or 1.0), float(plan.block_size))
        self.predictor = predicted.Predictor(setting, gate.dep.drafter[0] if gate.dep.drafter else None, plan,
                                             max(1.0, tau))
        try:
            return prediction.attribute(plan, setting, prediction.Measurement(result["s_per_token"], max(1.0, tau),
                                                                              stats.get("time_split")))
        except (NotImplementedError, ValueError) as e:
            log.warning("no attribution for %s: %s", fields, e)
            return None

    def _round(self, r: int, gate: Gate, evaluator: ev.Evaluator, proposers, prompts, att, seeds,
               survivors) -> dict:
        a, memory = self.agent, self.memory
        ctx = props.Context(self.space, self.incumbent, att, tried_before(memory, self.key, r), seeds, survivors,
                            self.avoid, self.predictor)
        proposals: list[props.Proposal] = []
        for p in proposers:
            if isinstance(p, LLMProposer):  # its transcript: every ask of this round, and what became of it
                p.record_dir = self.out / "llm" / f"round_{r}"
            got = p.propose(ctx, a.per_proposer)
            ctx.tried |= {sp.rewrite_key(x.rewrite) for x in got}
            proposals += [(p, x) for x in got]
        rows, runnable = [], []
        for i, (proposer, prop) in enumerate(proposals):
            name = f"r{r}-c{i}-{prop.proposer}"
            why = self._unusable(prop)
            out = sp.Dropped(prop.rewrite, why) if why else self.space.rewrite(name, self.incumbent, prop.rewrite)
            if not isinstance(out, sp.Dropped):
                missing = [n for n in variant_names(out[0]) if n not in self.variants]
                if missing:
                    out = sp.Dropped(prop.rewrite, f"the source of {', '.join(missing)} is not at hand")
            if isinstance(out, sp.Dropped):
                rows.append(self._record(r, name, prop, None, "dropped", out.reason))
                self.progress(f"  {name}: dropped {json.dumps(prop.rewrite)} ({out.reason})")
                proposer.observe(prop, None, "dropped")
                continue
            runnable.append((proposer, prop, name, out[0], out[1], None))
        if r == 0:  # round 0 runs again only when it never finished: its given candidates too
            for i, given in enumerate(a.candidates):
                fields = dict(given.get("fields") or {})
                name = f"r{r}-given{i}-{given.get('name', 'candidate')}"
                prop = props.Proposal(fields, "given", f"given by hand ({given.get('name', i)})")
                plan = self.space.check(name, sp.apply(self.incumbent, fields))
                if isinstance(plan, str):
                    rows.append(self._record(r, name, prop, None, "dropped", plan))
                    continue
                runnable.append((None, prop, name, sp.plan_fields(plan), plan, given.get("program")))
        runnable, repeats = distinct_plans(runnable)
        for x, first in repeats:  # e.g. an AR rewrite that also sets block_size: the same plan twice
            rows.append(self._record(r, x[2], x[1], x[3], "dropped", f"the same plan as {first}"))
            self.progress(f"  {x[2]}: dropped {json.dumps(x[1].rewrite)} (the same plan as {first})")
            if x[0] is not None:
                x[0].observe(x[1], None, "dropped")
        checks = [x for x in runnable if x[1].variant is not None] if evaluator.checks else []
        if checks:  # kernel variants against their references on the CPU workers, before any device time
            self.progress(f"round {r}: reference checks of {len(checks)} kernel variant(s) on CPU workers")
            results = evaluator.evaluate([self.spec(x[2], x[3], prompts, "check") for x in checks])
            for x, res in zip(checks, results):
                if res["status"] != "ok":
                    rows.append(self._record(r, x[2], x[1], x[3], "failed", f"{res['status']}: {res['reason']}",
                                             folder=res.get("folder")))
                    self.progress(f"  {x[2]}: {res['status']} ({res['reason']})")
                    if x[0] is not None:
                        x[0].observe(x[1], None, "failed")
                    runnable.remove(x)
        cheap = [x for x in runnable if x[1].cheap]
        if cheap:
            self.progress(f"round {r}: cheap stage for {len(cheap)} candidate(s)")
            results = evaluator.evaluate([self.spec(x[2], x[3], prompts, "cheap", x[5]) for x in cheap], warm=a.warm)
            for x, res in zip(cheap, results):
                # ranked by decode time per token: the cheap stage's few tokens make its wall time mostly prefill
                rank = res.get("decode_s_per_token") or res.get("s_per_token")
                if res["status"] == "ok" and x[0].should_prune(x[1], rank):
                    rows.append(self._record(r, x[2], x[1], x[3], "pruned", "pruned after the cheap stage",
                                             s=res["s_per_token"], folder=res.get("folder")))
                    self.progress(f"  {x[2]}: pruned after the cheap stage")
                    x[0].observe(x[1], None, "pruned")
                    runnable.remove(x)
        self.progress(f"round {r}: evaluating {len(runnable)} candidate(s) and the incumbent on "
                      f"{a.workers} worker(s)")
        specs = [self.spec(f"r{r}-incumbent", self.incumbent, prompts, profile=True)]
        specs += [self.spec(x[2], x[3], prompts, "full", x[5]) for x in runnable]
        results = evaluator.evaluate(specs, progress=lambda res: self.progress(
            f"  {res['name']}: {res['status']}" + (f" {1e3 * res['s_per_token']:.3f} ms/token"
                                                   if res.get("s_per_token") else f" ({res.get('reason')})")),
                                     warm=a.warm)
        inc_res = results[0]
        inc_plan = self.space.check("incumbent", self.incumbent)
        inc_verdict = gate.check(inc_res, inc_plan, None)
        self._record(r, specs[0]["name"], props.Proposal({}, "incumbent", ""), self.incumbent, "incumbent",
                     "; ".join(inc_verdict.reasons), s=inc_res.get("s_per_token"), verdict=inc_verdict.to_dict(),
                     folder=inc_res.get("folder"))
        if not inc_verdict.accepted and inc_res["status"] == "ok":
            self.progress(f"round {r}: warning: the incumbent itself fails the gate: {inc_verdict.reasons}")
        for x, res in zip(runnable, results[1:]):
            proposer, prop, name, fields, plan, _ = x
            verdict = gate.check(res, plan, inc_res)
            status = "accepted" if verdict.accepted else ("failed" if res["status"] != "ok" else "rejected")
            row = self._record(r, name, prop, fields, status, "; ".join(verdict.reasons), s=res.get("s_per_token"),
                               gain=verdict.speedup, verdict=verdict.to_dict(), folder=res.get("folder"))
            row["result"] = res
            rows.append(row)
            if proposer is not None:
                proposer.observe(prop, res.get("s_per_token") if res["status"] == "ok" else None, status,
                                 inc_res.get("s_per_token") if inc_res["status"] == "ok" else None)
            self.progress(f"  {name}: {status}" + (f" ({row['reason']})" if row["reason"] else ""))
        return {"incumbent": inc_res, "candidates": rows}

    def _unusable(self, prop: props.Proposal) -> str | None:
        """Why a proposal cannot run before any process starts (an unusable reply, a variant's source),
        else None; a usable variant joins the variants at hand."""
        if prop.dropped:
            return prop.dropped
        if prop.variant is not None:
            try:
                va.static_check(prop.variant.op, prop.variant.source)
            except va.VariantRejected as e:
                return f"variant rejected: {e}"
            self.variants[prop.variant.name] = prop.variant
        return None

    def _record(self, r, name, prop, fields, status, reason, s=None, gain=None, verdict=None, folder=None) -> dict:
        row = {"name": name, "proposer": prop.proposer, "rewrite": prop.rewrite, "why": prop.why, "fields": fields,
               "status": status, "reason": reason[:3900], "s_per_token": s, "gain": gain, "verdict": verdict,
               "folder": folder}
        self.memory.record_candidate(self.key, r, name=name, proposer=prop.proposer,
                                     rewrite_key=sp.rewrite_key(prop.rewrite), rewrite=prop.rewrite, fields=fields,
                                     status=status, reason=row["reason"], s_per_token=s, gain=gain,
                                     verdict=verdict, folder=folder, versions=self.versions)
        return row


def tried_before(memory: mem.Memory, key: str, round_index: int) -> set[str]:
    """Rewrite keys judged in the rounds before `round_index` (all finished): candidates an interrupted run
    of this round recorded are proposed again, not counted as tried."""
    return {c.rewrite_key for c in memory.candidates(key) if c.status != "incumbent" and c.round < round_index}


def distinct_plans(runnable: list) -> tuple[list, list]:
    """Runnable candidates (proposer, proposal, name, fields, plan, program) with one per distinct plan
    (fields, program), first come first kept; and the repeats, each with the name of the one it repeats."""
    seen: dict[tuple, str] = {}
    kept, repeats = [], []
    for x in runnable:
        key = (sp.rewrite_key(x[3]), x[5])
        if key in seen:
            repeats.append((x, seen[key]))
        else:
            seen[key] = x[2]
            kept.append(x)
    return kept, repeats


def variant_names(fields: dict) -> list[str]:
    """The kernel variants a plan's fields name (`variant:<hash>` implementations)."""
    kernels = fields.get("kernels") or {}
    return [i for op in sorted(kernels) for i in ((kernels[op] or {}).get("implementation") or []) if is_variant(i)]


def recover_variants(sandbox: Path) -> dict[str, va.Variant]:
    """Every variant module written under `sandbox` by an earlier run (its file name is its digest)."""
    out = {}
    for path in sorted(sandbox.rglob("*.py")) if sandbox.is_dir() else []:
        text = path.read_text(errors="replace")
        for op in va.OPS:
            v = va.Variant(op, text)
            if v.digest == path.stem:
                out[v.name] = v
    return out


def agent_conf(node: Any) -> AgentConf:
    """The `agent` block of a composed config, typed (an unknown key or a wrong type fails naming it)."""
    try:
        given = node if isinstance(node, dict) else OmegaConf.to_container(node or OmegaConf.create({}), resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(AgentConf), given)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ValueError(f"agent{'.' + key if key else ''}: {str(e).splitlines()[0]}") from None
    a = AgentConf(**OmegaConf.to_container(merged, resolve=True))
    if isinstance(a.llm, dict):
        a.llm = LLMConf(**a.llm)
    if "llm" in a.proposers and (a.llm is None or not a.llm.url):
        raise ValueError("agent.proposers names 'llm' but agent.llm.url is not set (an OpenAI-compatible endpoint)")
    unknown = [n for n in a.proposers if n not in props.REGISTRY]
    if unknown:
        raise ValueError(f"agent.proposers: unknown {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(props.REGISTRY)}")
    for key in ("rounds", "workers", "repeats", "heldout", "prompts_per_round", "per_proposer"):
        if getattr(a, key) < 1:
            raise ValueError(f"agent.{key}: must be >= 1, got {getattr(a, key)}")
    if a.workload not in sp.WORKLOADS:
        raise ValueError(f"agent.workload: {a.workload!r} is not one of {', '.join(sp.WORKLOADS)}")
    ev.log_level(a.dask_log_level)  # a name logging knows, or ValueError naming agent.dask_log_level
    if a.prefill_chunk < 1:
        raise ValueError(f"agent.prefill_chunk: must be >= 1, got {a.prefill_chunk}")
    if not 0 <= a.noise_margin < 1:
        raise ValueError(f"agent.noise_margin: must be in [0, 1), got {a.noise_margin}")
    if a.worker_gpu_fraction is not None and not 0 < a.worker_gpu_fraction < 1:
        raise ValueError(f"agent.worker_gpu_fraction: must be in (0, 1), got {a.worker_gpu_fraction}")
    return a
