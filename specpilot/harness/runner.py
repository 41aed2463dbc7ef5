"""Run one deployment with every plan of its run and write its results.

Every plan is measured in one process, the device's AR baselines first ("AR" is the fastest of them here),
and each plan but the reference is checked against the reference's tokens by token forcing. The run
folder gets `results.jsonl`, `results.csv`, `summary.md` (the printed table) and `run.log`. Design notes:
docs/design/harness.md.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import json
import logging
import platform
from pathlib import Path

import jax
import numpy as np
from omegaconf import DictConfig, OmegaConf

from specpilot.costmodel import counts, prediction, roofline
from specpilot.costmodel.rates import Rates
from specpilot.forcing import force
from specpilot.harness import deploy, plan_variants, progress
from specpilot.harness.config_schema import build_plans, validate
from specpilot.harness.methods import MethodRun, median_run, run_plan, scorer
from specpilot.harness.spread import noise_warning, timing_spread
from specpilot.harness.summary import format_markdown, format_responses, format_table
from specpilot.models.oracle import OracleDrafter, expected_tau
from specpilot.plan import Plan, is_ar_baseline_candidate

__all__ = ["run", "format_table", "format_responses", "check_by_forcing", "write"]

log = logging.getLogger(__name__)
# the run's table, notes and replies: written to run.log only (the console gets them from the caller's print)
summary_log = logging.getLogger("specpilot.run_summary")
summary_log.propagate = False
LOG_NAME = "run.log"  # Hydra's job log of experiments/run.py has this name in its output folder

CSV_FIELDS = ("target", "drafter", "gpu", "batch_size", "prompts", "new_tokens", "method", "verify", "weights",
              "dtype", "matmul", "block_size", "decode_ms_per_token", "tokens_per_s", "prefill_ms", "speedup_vs_ar",
              "baseline", "speedup_vs_stock", "tau", "acceptance_length_upstream", "ceiling_ms_per_token",
              "pct_of_ceiling", "predicted_ms_per_token", "mismatches", "spread_pct", "notes")


def environment() -> dict:
    dev = jax.devices()[0]
    return {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def choose_baselines(plans: list[Plan], runs: dict) -> dict[str, str | None]:
    """AR: the fastest bf16 `ar` plan measured in this run; stock: the chain plan with bf16 weights and the
    first plan's (the reference's) default kernels, if the run has one."""
    candidates = [p for p in plans if is_ar_baseline_candidate(p)]
    ar_name = min(candidates, key=lambda p: runs[p.name].decode_time_per_token).name
    stock = [p for p in plans if p.verify == "chain" and p.weights == "bf16"
             and p.kernels == plans[0].kernels]
    return {"ar": ar_name, "stock": stock[0].name if stock else None}


def run(cfg: DictConfig, out_dir: str | Path) -> list[dict]:
    """Measure every plan of `cfg` on its deployment; the records, also written to `out_dir` with the
    table (`summary.md`) and the run's log (`run.log`)."""
    writer = jax.process_index() == 0  # multi-host runs: every process has the same records; one writes them
    with run_log(out_dir if writer else None):
        records = measure(cfg)
        if writer:
            write(records, out_dir)
            shown = format_responses(records)
            summary_log.info("%s%s", format_table(records), f"\n{shown}" if shown else "")
    return records


def timed_runs(dep, plan: Plan, repeats: int) -> MethodRun:
    """`plan`'s median run of `repeats`, with a progress bar over its batches (the first one compiles)."""
    batches = len(dep.batches())
    runs_of = f"{repeats} timed run{'s' if repeats > 1 else ''} of {batches} batch{'es' if batches > 1 else ''}"
    with progress.phase(f"{plan.name}: {runs_of}", total=repeats * batches, logger=log) as ph:
        ph.advance(0, "the first batch compiles")
        def on_batch(decode_s: float, decode_tokens: int) -> None:
            ph.advance(1, f"{1e3 * decode_s / decode_tokens:.2f} ms/token" if decode_tokens else None)

        return median_run(lambda: run_plan(dep, plan, on_batch), repeats, plan.name, progress=log.info)


def measure(cfg: DictConfig) -> list[dict]:
    validate(cfg)
    variants = plan_variants.load(cfg)  # registered before any plan's kernels are traced
    plans = build_plans(cfg)
    with progress.phase(f"building the deployment: target {cfg.target.name}, drafter {cfg.drafter.name}",
                        logger=log):
        dep = deploy.build(cfg, plans)
    for note in plan_variants.check(variants, plans, dep.cfg, int(cfg.bench.batch_size)):
        log.info(note)
    env = environment()
    reference = plans[0]  # the first AR baseline candidate: its tokens are the reference (oracle, forcing)
    runs = {}
    for plan in plans:  # AR baselines first: an oracle drafter replays the reference's tokens
        runs[plan.name] = timed_runs(dep, plan, int(cfg.bench.repeats))
        if plan is reference:
            dep.reference_tokens = runs[plan.name].tokens
    forcing = {}
    for plan in plans:
        if plan is not reference and not cfg.decoding.forcing:
            forcing[plan.name] = {"mismatches": None, "summary": "not checked by token forcing "
                                  "(decoding.forcing=false: timing only, not a lossless result)"}
        elif plan is not reference:
            with progress.phase(f"{plan.name}: token forcing", logger=log):
                forcing[plan.name] = check_by_forcing(dep, reference, plan, runs[reference.name], runs[plan.name],
                                                      float(cfg.decoding.forcing_margin))
    baselines = choose_baselines(plans, runs)
    responses = decoded_responses(dep, runs[reference.name], int(cfg.bench.show_responses))
    ar_tpot = runs[baselines["ar"]].decode_time_per_token
    stock_tpot = runs[baselines["stock"]].decode_time_per_token if baselines["stock"] else None
    hw = roofline.Hardware.from_conf(cfg.gpu)
    mean_context = sum(len(p) for p in dep.prompts) / len(dep.prompts) + dep.new_tokens / 2
    ar_floor = roofline.ar_ceiling_s(hw, dep.cfg, dep.batch_size, int(mean_context))
    setting = prediction.Setting(counts.Shape.from_deployment(dep, int(mean_context)), Rates.for_gpu(cfg.gpu), hw)
    spreads = {p.name: timing_spread(runs[p.name].repeat_times, runs[p.name].batch_times) for p in plans}
    noisy = noise_warning(spreads[baselines["ar"]])
    if noisy:
        log.warning(noisy)
    records = []
    for plan in plans:
        r = runs[plan.name]
        ceiling = plan_ceiling_s(plan, r, dep, hw, int(mean_context))
        att = attribution(plan, setting, r)
        rec = dict(dep.labels)
        rec.update(
            method=plan.name,
            verify=plan.verify,
            weights=plan.weights,
            dtype=str(dep.params["embed"].dtype),  # the dense plans' weights are in this dtype, not bf16
            matmul="+".join(plan.kernels.matmul.implementation),
            gated_delta_rule="+".join(plan.kernels.gated_delta_rule.implementation),
            mesh=plan.mesh.describe(),
            block_size=plan.block_size,
            plan=plan.describe(),
            baseline=baselines["ar"],
            stock_baseline=baselines["stock"],
            decode_ms_per_token=1e3 * r.decode_time_per_token,
            tokens_per_s=dep.batch_size / r.decode_time_per_token,
            prefill_ms=1e3 * r.prefill_s / max(1, len(dep.batches())),
            speedup_vs_ar=ar_tpot / r.decode_time_per_token,
            speedup_vs_stock=None if stock_tpot is None else stock_tpot / r.decode_time_per_token,
            ar_ceiling_ms_per_token=1e3 * ar_floor,
            **oracle_fields(dep, r, ar_tpot, plan.block_size),
            ceiling_ms_per_token=None if ceiling is None else 1e3 * ceiling,
            pct_of_ceiling=None if ceiling is None else 100 * ceiling / r.decode_time_per_token,
            predicted_ms_per_token=None if att is None else att["prediction"]["ms_per_token"],
            prediction=None if att is None else att["prediction"],
            attribution=att,
            tau=r.stats.get("tau"),
            acceptance_length_upstream=r.stats.get("acceptance_length_upstream"),
            spread=spreads[plan.name],
            spread_pct=None if spreads[plan.name] is None else 100 * spreads[plan.name]["range"],
            mismatches=forcing[plan.name]["mismatches"] if plan.name in forcing else None,
            forcing=forcing.get(plan.name),
            notes="; ".join(dep.notes + r.stats.get("notes", []) + ([noisy] if noisy else [])),
            stats={k: v for k, v in r.stats.items()
                   if k not in ("tau", "acceptance_length_upstream", "mismatches", "notes")},
            config=OmegaConf.to_container(cfg, resolve=True),
            **env,
        )
        if plan is reference and responses:
            rec["responses"] = responses
        records.append(rec)
    return records


def decoded_responses(dep, run, n: int) -> list[dict]:
    """The first n prompts and the reference's replies as text (targets with a tokenizer); every plan
    that passed token forcing produced the same tokens."""
    if dep.tokenizer is None or n <= 0:
        return []
    out = []
    for prompt, tokens in zip(dep.prompts[:n], run.tokens[:n]):
        reply = [int(t) for t in tokens if t >= 0]
        out.append({"prompt": dep.tokenizer.decode(prompt),
                    "response": dep.tokenizer.decode(reply, skip_special_tokens=True),
                    "tokens": len(reply)})
    return out


def oracle_fields(dep, r, ar_tpot: float, block_size: int) -> dict:
    """With oracle acceptance, tau is a sampled quantity (one draw per verification step), so a run's tau
    scatters around the profile's; the measured time per step does not depend on it. Records carry the
    time per step and the speedup that time gives at the profile's expected tau (its first
    block_size - 1 drafts: what the plan's block verifies), next to the measured speedup."""
    tau = r.stats.get("tau")
    if dep.drafter is None or tau is None or not isinstance(dep.drafter[0], OracleDrafter):
        return {}
    step_s = r.decode_time_per_token * tau
    profile_tau = expected_tau(np.asarray(dep.drafter[0].conditional[: block_size - 1]))
    return {"ms_per_step": 1e3 * step_s, "step_vs_ar_step": step_s / ar_tpot,
            "profile_tau": profile_tau, "speedup_at_profile_tau": profile_tau * ar_tpot / step_s}


def attribution(plan: Plan, setting, r) -> dict | None:
    """The cost model's prediction for this plan at the run's tau and the measured run's gaps (None for a
    plan the cost model cannot count, or a run with no decode step)."""
    if not r.decode_tokens:
        return None
    try:
        return prediction.attribute(plan, setting, prediction.Measurement.from_run(r))
    except NotImplementedError as e:
        log.warning("%s: no prediction: %s", plan.name, e)
        return None


def plan_ceiling_s(plan: Plan, r, dep, hw, context: int) -> float | None:
    """The cost model's floor per output token for this plan: AR's step floor, or for speculative plans
    (draft + verify floors) / measured tau, at the plan's bits per weight."""
    bits = plan.bits_per_weight
    if not plan.uses_drafter or r.stats.get("tau") is None:
        return roofline.ar_ceiling_s(hw, dep.cfg, dep.batch_size, context, bits)
    dcfg = getattr(dep.drafter[0], "inner", dep.drafter[0]).cfg
    c = roofline.spec_ceiling_s(hw, dep.cfg, dep.batch_size, context, plan.block_size, float(r.stats["tau"]),
                                 dcfg.num_layers, len(dcfg.tap_layers), bits)
    return c["per_token_s"]


def check_by_forcing(dep, reference: Plan, plan: Plan, ar_run, run, tie_margin: float) -> dict:
    """Token forcing against the reference AR plan: its output tokens forced into both its and the plan's
    numerics.

    Also counts prompts whose raw output differs from AR's. Greedy only: sampled outputs are checked
    statistically (tests), not token by token.
    """
    outputs_differ = sum(a != b for a, b in zip(ar_run.tokens, run.tokens))
    if not dep.sampling.greedy:
        return {"mismatches": None, "outputs_differ": outputs_differ,
                "summary": "not checked by token forcing (sampling: checked statistically, in tests)"}
    n = len(ar_run.tokens)
    report = force(scorer(dep, reference), scorer(dep, plan), dep.prompts[:n],
                   np.asarray(ar_run.tokens), tie_margin)
    return {"mismatches": report.num_mismatches, "hard": report.num_hard_mismatches,
            "near_ties": report.num_near_ties, "positions": report.num_positions,
            "tie_margin": tie_margin, "reference_self_mismatches": report.reference_self_mismatches,
            "first_mismatch": [p.first_mismatch for p in report.prompts],
            "margins": [p.margins for p in report.prompts], "summary": report.summary(),
            "outputs_differ": outputs_differ}


def write(records: list[dict], out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        for rec in records:
            f.write(json.dumps(rec, default=str) + "\n")
    csv_path = out / "results.csv"
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(records)
    if records:
        r = records[0]
        title = (f"{r['target']} + drafter {r['drafter']} on {r['gpu']}: batch {r['batch_size']}, "
                 f"{r['prompts']} prompts, {r['new_tokens']} new tokens")
        (out / "summary.md").write_text(format_markdown(records, title))


@contextlib.contextmanager
def run_log(out_dir: str | Path | None):
    """While a run measures: every log record into `<out_dir>/run.log` (unless a handler writes there
    already: Hydra's job log when the output folder is Hydra's), and `summary_log` there too."""
    if out_dir is None:
        yield
        return
    path = (Path(out_dir) / LOG_NAME).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    added = []
    if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename).resolve() == path for h in root.handlers):
        records = logging.FileHandler(path)
        records.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(records)
        added.append((root, records))
    plain = logging.FileHandler(path)
    plain.setFormatter(logging.Formatter("%(message)s"))
    summary_log.addHandler(plain)
    summary_log.setLevel(logging.INFO)
    added.append((summary_log, plain))
    try:
        yield
    finally:
        for logger, handler in added:
            logger.removeHandler(handler)
            handler.close()
