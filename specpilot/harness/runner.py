"""Run one deployment with every plan of its run and write its results.

Design choices:
- Every plan of the run is measured in one process. The device's AR baseline candidates (bf16 `ar` plans:
  XLA's step everywhere, bf16 through the Mosaic kernel's twin on the H200) always run, first; "AR" is
  the fastest of them as measured here, "stock" the chain plan with bf16 weights and default kernels.
  Records name both, and carry the plan itself.
- The reference for token forcing (and the tokens an oracle drafter replays) is the first AR candidate,
  XLA's bf16 step: numerics we did not write a kernel for.
- Each result record is self-describing: the deployment labels, the plan, the device, jax's version,
  the date, and notes such as "random weights" or "oracle acceptance", which the report repeats.
- Records go to `results.jsonl` (one per plan; `method` is the plan's name) and `results.csv` in the output directory.
"""

from __future__ import annotations

import csv
import datetime
import json
import logging
import platform
import time
from pathlib import Path

import jax
import numpy as np
from omegaconf import DictConfig, OmegaConf

from specpilot.costmodel import roofline, counts, prediction
from specpilot.harness import deploy, plan_variants
from specpilot.harness.config_schema import build_plans, validate
from specpilot.harness.methods import median_run, run_plan, scorer
from specpilot.costmodel.rates import Rates
from specpilot.plan import Plan, is_ar_baseline_candidate

log = logging.getLogger(__name__)

CSV_FIELDS = ("target", "drafter", "gpu", "batch_size", "prompts", "new_tokens", "method", "verify", "weights",
              "matmul", "block_size", "decode_ms_per_token", "tokens_per_s", "prefill_ms", "speedup_vs_ar",
              "baseline", "speedup_vs_stock", "tau", "acceptance_length_upstream", "ceiling_ms_per_token",
              "pct_of_ceiling", "predicted_ms_per_token", "mismatches", "notes")


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
    validate(cfg)
    variants = plan_variants.load(cfg)  # registered before any plan's kernels are traced
    plans = build_plans(cfg)
    t0 = time.perf_counter()
    dep = deploy.build(cfg, plans)
    log.info("deployment %s built in %.1f s", dep.labels, time.perf_counter() - t0)
    for note in plan_variants.check(variants, plans, dep.cfg, int(cfg.bench.batch_size)):
        log.info(note)
    env = environment()
    reference = plans[0]  # the first AR baseline candidate: its tokens are the reference (oracle, forcing)
    runs = {}
    for plan in plans:  # AR baselines first: an oracle drafter replays the reference's tokens
        runs[plan.name] = median_run(lambda: run_plan(dep, plan), int(cfg.bench.repeats), plan.name,
                                     progress=log.info)
        if plan is reference:
            dep.reference_tokens = runs[plan.name].tokens
    forcing = {}
    for plan in plans:
        if plan is not reference and not cfg.decoding.forcing:
            forcing[plan.name] = {"mismatches": None, "summary": "not checked by token forcing "
                                  "(decoding.forcing=false: timing only, not a lossless result)"}
        elif plan is not reference:
            t0 = time.perf_counter()
            forcing[plan.name] = check_by_forcing(dep, reference, plan, runs[reference.name], runs[plan.name],
                                                  float(cfg.decoding.forcing_margin))
            log.info("%s: token forcing in %.1f s", plan.name, time.perf_counter() - t0)
    baselines = choose_baselines(plans, runs)
    responses = decoded_responses(dep, runs[reference.name], int(cfg.bench.show_responses))
    ar_tpot = runs[baselines["ar"]].decode_time_per_token
    stock_tpot = runs[baselines["stock"]].decode_time_per_token if baselines["stock"] else None
    hw = roofline.Hardware.from_conf(cfg.gpu)
    mean_context = sum(len(p) for p in dep.prompts) / len(dep.prompts) + dep.new_tokens / 2
    ar_floor = roofline.ar_ceiling_s(hw, dep.cfg, dep.batch_size, int(mean_context))
    setting = prediction.Setting(counts.Shape.from_deployment(dep, int(mean_context)), Rates.for_gpu(cfg.gpu), hw)
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
            **oracle_fields(dep, r, ar_tpot),
            ceiling_ms_per_token=None if ceiling is None else 1e3 * ceiling,
            pct_of_ceiling=None if ceiling is None else 100 * ceiling / r.decode_time_per_token,
            predicted_ms_per_token=None if att is None else att["prediction"]["ms_per_token"],
            prediction=None if att is None else att["prediction"],
            attribution=att,
            tau=r.stats.get("tau"),
            acceptance_length_upstream=r.stats.get("acceptance_length_upstream"),
            mismatches=forcing[plan.name]["mismatches"] if plan.name in forcing else None,
            forcing=forcing.get(plan.name),
            notes="; ".join(dep.notes + r.stats.get("notes", [])),
            stats={k: v for k, v in r.stats.items()
                   if k not in ("tau", "acceptance_length_upstream", "mismatches", "notes")},
            config=OmegaConf.to_container(cfg, resolve=True),
            **env,
        )
        if plan is reference and responses:
            rec["responses"] = responses
        records.append(rec)
    if jax.process_index() == 0:  # multi-host runs: every process has the same records; one writes them
        write(records, out_dir)
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


def format_responses(records: list[dict], width: int = 600) -> str:
    """The decoded replies a run recorded, for the console: each prompt's last line(s), then its reply."""
    lines = []
    for rec in records:
        for i, r in enumerate(rec.get("responses", ())):
            prompt = r["prompt"].replace("<|im_start|>", "").replace("<|im_end|>", "").strip()
            prompt = prompt[-300:] if len(prompt) > 300 else prompt
            reply = r["response"] if len(r["response"]) <= width else r["response"][:width] + " ..."
            lines += [f"--- prompt {i} (...{len(r['prompt'])} chars) ---", prompt,
                      f"--- reply ({r['tokens']} tokens) ---", reply.strip(), ""]
    return "\n".join(lines)


def oracle_fields(dep, r, ar_tpot: float) -> dict:
    """With oracle acceptance, tau is a sampled quantity (one draw per verification step), so a run's tau
    scatters around the profile's; the measured time per step does not depend on it. Records carry the
    time per step and the speedup that time gives at the profile's expected tau, next to the measured
    speedup."""
    from specpilot.models.oracle import OracleDrafter, expected_tau

    tau = r.stats.get("tau")
    if dep.drafter is None or tau is None or not isinstance(dep.drafter[0], OracleDrafter):
        return {}
    step_s = r.decode_time_per_token * tau
    profile_tau = expected_tau(np.asarray(dep.drafter[0].conditional))
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
    from specpilot.forcing import force

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


def format_table(records: list[dict]) -> str:
    width = max([4] + [len(r["method"]) for r in records]) + 2
    head = (f"{'plan':<{width}}{'verify':<7}{'weights':<8}{'matmul':<13}{'block':>5}{'ms/token':>10}{'tok/s':>10}"
            f"{'speedup':>9}{'tau':>7}{'ceiling ms':>11}{'% ceil':>8}{'pred ms':>9}{'mismatch':>10}")
    lines = [head, "-" * len(head)]
    for r in records:
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        mm = str(r["mismatches"]) if r.get("mismatches") is not None else "-"
        ceil = f"{r['ceiling_ms_per_token']:.3f}" if r.get("ceiling_ms_per_token") is not None else "-"
        pct = f"{r['pct_of_ceiling']:.0f}%" if r.get("pct_of_ceiling") is not None else "-"
        pred = f"{r['predicted_ms_per_token']:.3f}" if r.get("predicted_ms_per_token") is not None else "-"
        lines.append(f"{r['method']:<{width}}{r['verify']:<7}{r['weights']:<8}{r['matmul']:<13}{r['block_size']:>5}"
                     f"{r['decode_ms_per_token']:>10.3f}{r['tokens_per_s']:>10.1f}"
                     f"{r['speedup_vs_ar']:>8.2f}x{tau:>7}{ceil:>11}{pct:>8}{pred:>9}{mm:>10}")
    if records:
        r = records[0]
        stock = f"; stock: {r['stock_baseline']}" if r.get("stock_baseline") else ""
        lines.append(f"speedup over AR = the fastest bf16 ar plan measured in this run: {r['baseline']}{stock}; "
                     "ceiling: the cost model's floor per output token; pred: its prediction from the "
                     "device's measured rates (conf/gpu/rates/)")
    for r in records:
        if r.get("acceptance_length_upstream") is not None:
            lines.append(f"{r['method']}: tau {r['tau']:.2f} (tokens emitted per verification step within the budget); "
                         f"upstream DFlash's mean acceptance length {r['acceptance_length_upstream']:.2f} (also counts "
                         "the tokens the budget cut off)")
        if r.get("speedup_at_profile_tau") is not None:
            lines.append(f"{r['method']}: oracle acceptance, tau {r['tau']:.2f} measured vs {r['profile_tau']:.2f} "
                         f"in the profile; {r['ms_per_step']:.3f} ms per step ({r['step_vs_ar_step']:.2f}x an AR "
                         f"step) -> {r['speedup_at_profile_tau']:.2f}x at the profile's tau")
        if r.get("mesh", "1x1") != "1x1":
            lines.append(f"{r['method']}: sharded over a {r['mesh']} mesh (data x tensor devices)")
        split = (r.get("stats") or {}).get("time_split")
        if split:
            lines.append(f"{r['method']}: time split (profiled pass) " + ", ".join(
                f"{k} {100 * v:.0f}%" for k, v in split.items()))
        if r.get("attribution"):
            lines += prediction.format_attribution(r["method"], r["attribution"])
        if r.get("forcing"):
            lines.append(f"{r['method']}: {r['forcing']['summary']}")
    notes = {r["notes"] for r in records if r.get("notes")}
    lines += [f"note: {n}" for n in sorted(notes)]
    return "\n".join(lines)
