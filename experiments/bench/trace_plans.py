"""Where a plan's step time goes on the device, kernel by kernel: `python experiments/bench/trace_plans.py [run.py's overrides]`.

Composes the same config as experiments/run.py and builds the same deployment. Each plan (or those of
`+trace.plans=[stock,stock_w12]`) runs once to compile and warm up, then once more under the JAX profiler
(a Perfetto trace), and the device kernels inside the decode's profiler span ("specpilot.decode") are
summed per step: busy time against the step's wall time is the share the device sat idle (launch gaps,
host work), and the per-kernel table says which ops hold the rest. Chain plans also run the profiled
pass the run table's time split comes from (each phase its own synced call), traced the same way:
each phase's wall time per step beside its device busy time shows how much of a phase is the call
itself rather than its kernels.

Options: `+trace.plans=[...]` (plan names; default every plan), `+trace.top=12` (kernels listed per
window), `+trace.out=<file.json>` (default `trace.json` in the run's output folder). An oracle drafter
replays the first plan's tokens (an AR baseline), so that plan always runs first. The summaries are
device measurements: on a CPU-only machine there are no device kernels to sum and the script says so.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import hydra
import jax
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from specpilot.harness import bench, config_schema, deploy, devices, methods, plan_variants

config_schema.register()
log = logging.getLogger("trace_plans")
PHASES = ("draft", "verify", "accept")


def loop_steps(plan, run: methods.MethodRun) -> int:
    """Decode loop iterations of a run: AR's decode tokens (per sequence, summed over batches), a
    speculative plan's verification steps of each batch's longest row."""
    return int(run.decode_tokens) if plan.verify == "ar" else int(run.stats["loop_steps"])


def traced(fn, windows, top: int):
    """Run fn() under the profiler; windows(result) -> {span name: steps}; -> (the result,
    {span name: kernel_summary over that many steps})."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            result = fn()
            jax.effects_barrier()
        return result, {w: bench.kernel_summary(d, max(1, n), top=top, window=w) for w, n in windows(result).items()}


def trace_plan(dep, plan, top: int) -> tuple[dict, methods.MethodRun]:
    """One plan's warm run, its traced run and (chain plans) its traced profiled pass -> (summary, warm run)."""
    dep.profile_split = False  # the timed and traced runs hold the decode only; the profiled pass comes apart
    t0 = time.perf_counter()
    warm = methods.run_plan(dep, plan)
    warm_s = time.perf_counter() - t0
    timed = methods.run_plan(dep, plan)  # untraced, after the warm-up: the step time the trace is set against
    row = {"plan": plan.name, "verify": plan.verify, "weights": plan.weights, "describe": plan.describe(),
           "warm_run_s": warm_s, "steps": loop_steps(plan, timed),
           "ms_per_step": 1e3 * timed.decode_s / max(1, loop_steps(plan, timed))}
    if plan.verify != "ar":
        row["tau"] = warm.stats.get("tau")
    run, sums = traced(lambda: methods.run_plan(dep, plan),
                       lambda r: {"specpilot.decode": loop_steps(plan, r)}, top)
    row["traced_ms_per_step"] = 1e3 * run.decode_s / max(1, loop_steps(plan, run))
    row["decode"] = sums["specpilot.decode"]
    if plan.verify == "chain":
        methods.profiled_chain_pass(dep, plan)  # compiles the separately jitted phases
        prof, phases = traced(lambda: methods.profiled_chain_pass(dep, plan),
                              lambda st: {f"specpilot.{p}": int(st.steps.max()) for p in PHASES}, top)
        steps = max(1, int(prof.steps.max()))
        row["profiled"] = {p: dict(phases[f"specpilot.{p}"] or {}, host_ms_per_step=1e3 * t / steps)
                           for p, t in zip(PHASES, (prof.draft_s, prof.verify_s, prof.bookkeeping_s))}
    return row, warm


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'plan':<14} {'ms/step':>8} {'traced':>8} {'busy':>8} {'kernels':>8}  profiled pass: phase "
             f"wall / busy ms per step"]
    for r in rows:
        d = r.get("decode") or {}
        busy = d.get("busy_ms_per_step")
        phases = "  ".join(
            f"{p} {v.get('host_ms_per_step', float('nan')):.3f} / {v.get('busy_ms_per_step', float('nan')):.3f}"
            for p, v in (r.get("profiled") or {}).items())
        lines.append(f"{r['plan']:<14} {r['ms_per_step']:>8.3f} {r['traced_ms_per_step']:>8.3f} "
                     f"{busy if busy is None else round(busy, 3)!s:>8} "
                     f"{d.get('kernels_per_step', 0):>8.1f}  {phases}")
    for r in rows:
        for window, s in [("decode", r.get("decode"))] + [(p, v) for p, v in (r.get("profiled") or {}).items()]:
            if s and s.get("top"):
                lines.append(f"{r['plan']} {window}: " + "; ".join(
                    f"{t['name'][:48]} {t['ms_per_step']:.3f} ms ({t['calls_per_step']:.0f} calls)" for t in s["top"]))
    return "\n".join(lines)


@hydra.main(version_base=None, config_path="../../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    with open_dict(cfg):  # this script's own options, not part of the run config the schema types
        extra = cfg.pop("trace", None) or {}
    extra = OmegaConf.to_container(extra, resolve=True) if isinstance(extra, DictConfig) else dict(extra)
    try:
        cfg = config_schema.typed(cfg)
        devices.setup(cfg)
        if cfg.compile_cache:
            devices.enable_compile_cache(Path(cfg.cache_dir).expanduser() / "xla")
        config_schema.validate(cfg)
        plan_variants.load(cfg)
        plans = config_schema.build_plans(cfg)
        names = extra.get("plans") or [p.name for p in plans]
        unknown = sorted(set(names) - {p.name for p in plans})
        if unknown:
            raise ValueError(f"trace.plans names {unknown}, not plans of this run ({[p.name for p in plans]})")
        dep = deploy.build(cfg, plans)
        reference = plans[0]
        out = Path(extra.get("out") or Path(HydraConfig.get().runtime.output_dir) / "trace.json")
        rows = []
        if reference.name not in names:  # its tokens only: what an oracle drafter replays
            dep.reference_tokens = methods.run_plan(dep, reference).tokens
        for plan in [p for p in plans if p.name in names]:
            row, warm = trace_plan(dep, plan, int(extra.get("top", 12)))
            if plan is reference:
                dep.reference_tokens = warm.tokens
            rows.append(row)
            log.info("%s: %.3f ms per step, traced %.3f", plan.name, row["ms_per_step"], row["traced_ms_per_step"])
            out.write_text(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__,  # after each plan
                                       "labels": dep.labels, "rows": rows}, indent=1))
        if not any(r.get("decode") and r["decode"].get("kernels") != 0 for r in rows):
            log.warning("no device kernels in the traces (a CPU-only run has none to sum)")
    except Exception as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    print(format_rows(rows))
    print(f"trace summaries: {out}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
