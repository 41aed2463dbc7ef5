"""Run one deployment with every configured method and write its results.

Design choices:
- AR always runs (it is the baseline that defines speedup) even when not listed, and its numbers are
  measured in the same process as every other method's.
- Each result record is self-describing: the deployment labels, the method, the device, jax's version,
  the date, and notes such as "random weights" or "oracle acceptance", which the report repeats.
- Records go to `results.jsonl` (one per method) and `results.csv` in the output directory.
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

from specpilot import costmodel, deploy
from specpilot.config_schema import validate
from specpilot.methods import METHODS, median_run

log = logging.getLogger(__name__)

CSV_FIELDS = ("target", "drafter", "gpu", "batch_size", "prompts", "new_tokens", "method",
              "decode_ms_per_token", "tokens_per_s", "prefill_ms", "speedup_vs_ar", "tau",
              "ceiling_ms_per_token", "pct_of_ceiling", "mismatches", "notes")


def environment() -> dict:
    dev = jax.devices()[0]
    return {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def run(cfg: DictConfig, out_dir: str | Path) -> list[dict]:
    validate(cfg)
    t0 = time.perf_counter()
    dep = deploy.build(cfg)
    log.info("deployment %s built in %.1f s", dep.labels, time.perf_counter() - t0)
    methods = list(dict.fromkeys(["ar", *cfg.decoding.methods]))
    env = environment()
    runs = {}
    for name in methods:  # AR first: its tokens are the reference an oracle drafter replays
        runs[name] = median_run(METHODS[name], dep, int(cfg.bench.repeats), progress=log.info)
        if name == "ar":
            dep.reference_tokens = runs["ar"].tokens
    forcing = {}
    for name in runs:
        if name != "ar":
            t0 = time.perf_counter()
            forcing[name] = check_by_forcing(METHODS[name], dep, runs["ar"], runs[name],
                                             float(cfg.decoding.forcing_margin))
            log.info("%s: token forcing in %.1f s", name, time.perf_counter() - t0)
    ar_tpot = runs["ar"].decode_time_per_token
    hw = costmodel.Hardware.from_conf(cfg.gpu)
    mean_context = sum(len(p) for p in dep.prompts) / len(dep.prompts) + dep.new_tokens / 2
    ar_floor = costmodel.ar_ceiling_s(hw, dep.cfg, dep.batch_size, int(mean_context))
    records = []
    for name, r in runs.items():
        ceiling = method_ceiling_s(name, r, dep, hw, int(mean_context))
        rec = dict(dep.labels)
        rec.update(
            method=name,
            decode_ms_per_token=1e3 * r.decode_time_per_token,
            tokens_per_s=dep.batch_size / r.decode_time_per_token,
            prefill_ms=1e3 * r.prefill_s / max(1, len(dep.batches())),
            speedup_vs_ar=ar_tpot / r.decode_time_per_token,
            ar_ceiling_ms_per_token=1e3 * ar_floor,
            **oracle_fields(dep, r, ar_tpot),
            ceiling_ms_per_token=None if ceiling is None else 1e3 * ceiling,
            pct_of_ceiling=None if ceiling is None else 100 * ceiling / r.decode_time_per_token,
            tau=r.stats.get("tau"),
            mismatches=forcing[name]["mismatches"] if name in forcing else None,
            forcing=forcing.get(name),
            notes="; ".join(dep.notes + r.stats.get("notes", [])),
            stats={k: v for k, v in r.stats.items() if k not in ("tau", "mismatches", "notes")},
            config=OmegaConf.to_container(cfg, resolve=True),
            **env,
        )
        records.append(rec)
    write(records, out_dir)
    return records


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


def method_ceiling_s(name: str, r, dep, hw, context: int) -> float | None:
    """The cost model's floor per output token for this method: AR's step floor, or for speculative
    methods (draft + verify floors) / measured tau, at the method's bits per weight."""
    bits = 12.0 if name.endswith("_w12") else 16.0
    if dep.drafter is None or r.stats.get("tau") is None:
        return costmodel.ar_ceiling_s(hw, dep.cfg, dep.batch_size, context, bits)
    dcfg = getattr(dep.drafter[0], "inner", dep.drafter[0]).cfg
    c = costmodel.spec_ceiling_s(hw, dep.cfg, dep.batch_size, context, dep.block_size, float(r.stats["tau"]),
                                 dcfg.num_layers, len(dcfg.tap_layers), bits)
    return c["per_token_s"]


def check_by_forcing(method, dep, ar_run, run, tie_margin: float) -> dict:
    """Token forcing against AR: AR's output tokens forced into both AR's and the method's numerics.

    Also counts prompts whose raw output differs from AR's. Greedy only: sampled outputs are checked
    statistically (tests), not token by token.
    """
    from specpilot.forcing import force

    outputs_differ = sum(a != b for a, b in zip(ar_run.tokens, run.tokens))
    if not dep.sampling.greedy or method.scorer is None:
        return {"mismatches": None, "outputs_differ": outputs_differ,
                "summary": "not checked by token forcing (sampling, or the method has no scorer)"}
    n = len(ar_run.tokens)
    report = force(METHODS["ar"].scorer(dep), method.scorer(dep), dep.prompts[:n],
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
    head = (f"{'method':<10}{'ms/token':>10}{'tok/s':>10}{'speedup':>9}{'tau':>7}{'ceiling':>9}"
            f"{'% ceil':>8}{'mismatch':>10}")
    lines = [head, "-" * len(head)]
    for r in records:
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        mm = str(r["mismatches"]) if r.get("mismatches") is not None else "-"
        ceil = f"{r['ceiling_ms_per_token']:.3f}" if r.get("ceiling_ms_per_token") is not None else "-"
        pct = f"{r['pct_of_ceiling']:.0f}%" if r.get("pct_of_ceiling") is not None else "-"
        lines.append(f"{r['method']:<10}{r['decode_ms_per_token']:>10.3f}{r['tokens_per_s']:>10.1f}"
                     f"{r['speedup_vs_ar']:>8.2f}x{tau:>7}{ceil:>9}{pct:>8}{mm:>10}")
    for r in records:
        if r.get("speedup_at_profile_tau") is not None:
            lines.append(f"{r['method']}: oracle acceptance, tau {r['tau']:.2f} measured vs {r['profile_tau']:.2f} "
                         f"in the profile; {r['ms_per_step']:.3f} ms per step ({r['step_vs_ar_step']:.2f}x an AR "
                         f"step) -> {r['speedup_at_profile_tau']:.2f}x at the profile's tau")
        split = (r.get("stats") or {}).get("time_split")
        if split:
            lines.append(f"{r['method']}: time split (profiled pass) " + ", ".join(
                f"{k} {100 * v:.0f}%" for k, v in split.items()))
        if r.get("forcing"):
            lines.append(f"{r['method']}: {r['forcing']['summary']}")
    notes = {r["notes"] for r in records if r.get("notes")}
    lines += [f"note: {n}" for n in sorted(notes)]
    return "\n".join(lines)
