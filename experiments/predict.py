"""Predict a deployment's plans without building or running them: `python experiments/predict.py
[run.py's overrides]`, e.g. `gpu=h200 target=qwen3_8b decoding=w12 +predict.tau=6.27`.

Composes `conf/predict.yaml` (run.py's config groups, by default at the GPU experiments' drafter and
bench), takes the deployment's shapes from the configs alone (no weight is made and no device used, so
`gpu=` may name any device, and the Qwen3-8B shape predicts in seconds on a laptop) and prints, for every
plan, the cost model's time per step of each stage and per output token at a tau, against the gpu
config's calibrated rates (`conf/gpu/rates/<gpu>.yaml`). Prompts count at `bench.prompt_len` tokens: for
random prompts a prediction equals the `pred ms` a run of the same config prints at the same tau.
Options: `+predict.tau=7.94` (tokens per verification step; default the drafter config's `tau`; under
`drafter=oracle_trace`, each plan's own trace tau: recorded, or sampled for its shape from the file's model),
`+predict.rates=<file>` (another rates file, e.g. a fresh calibration), `+predict.out=<file.jsonl>`,
`+predict.best=8` (also what the loop's `predicted` proposer would propose first from the first drafting
plan: the plans of the structural space predicted fastest, each at its own τ where the drafter's
acceptance model gives one).
"""

from __future__ import annotations

import json
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict

from specpilot.agent import predicted
from specpilot.agent import proposers as props
from specpilot.agent import space as sp
from specpilot.costmodel import prediction, roofline
from specpilot.costmodel.rates import Rates
from specpilot.harness import config_schema, deploy, entry, shapes
from specpilot.models.oracle_trace import OracleTraceDrafter, load_model, load_traces

config_schema.register()


def _setting(cfg, plans, rates: Rates) -> prediction.Setting:
    return prediction.Setting(shapes.cost_shape(cfg, plans), rates, roofline.Hardware.from_conf(cfg.gpu))


def _trace_drafter(cfg) -> OracleTraceDrafter | None:
    """An oracle_trace drafter's traces and acceptance model (no inner drafter: nothing is built), else None."""
    if cfg.drafter.source != "oracle_trace":
        return None
    path = cfg.drafter.step_trace
    return OracleTraceDrafter.from_traces(None, load_traces(path), str(path), load_model(path))


def predict_all(cfg, tau: float | None = None, rates: Rates | None = None) -> list[dict]:
    """One row per plan of the composed, typed config `cfg`: the prediction's dict plus the deployment's
    labels. Nothing is built: the shapes come from the configs."""
    config_schema.validate(cfg)
    plans = config_schema.build_plans(cfg)
    if tau is None:
        tau = cfg.drafter.get("tau")
    rates = rates or Rates.for_gpu(cfg.gpu)
    setting = _setting(cfg, plans, rates)
    traces = _trace_drafter(cfg) if tau is None else None  # each plan's trace tau, as a run replays it
    rows = []
    for plan in plans:
        plan_tau = traces.for_plan(plan).trace_tau if traces is not None and plan.verify != "ar" else tau
        if plan.verify != "ar" and plan_tau is None:
            raise config_schema.ConfigValueError(
                f"predict.tau: plan {plan.name!r} drafts: give its tau (+predict.tau=...); the drafter config "
                f"{cfg.drafter.name!r} states none")
        p = prediction.predict(plan, setting, None if plan.verify == "ar" else float(plan_tau))
        rows.append({**deploy.labels(cfg), "method": plan.name, **p.to_dict(), "rates": rates.source})
    return rows


def best_plans(cfg, n: int, tau: float | None = None, rates: Rates | None = None) -> tuple[str, list[dict]]:
    """(the starting plan's name, rows) of the `n` plans the `predicted` proposer ranks first from the first
    drafting plan of the typed config `cfg` (else its first plan). τ per plan: an oracle_trace file's model
    for any shape, else `tau` (default the drafter config's) for the starting plan's drafting shape only."""
    plans = config_schema.build_plans(cfg)
    start = next((p for p in plans if p.verify != "ar"), plans[0])
    setting = _setting(cfg, plans, rates or Rates.for_gpu(cfg.gpu))
    drafter = _trace_drafter(cfg)
    start_tau = tau if tau is not None else cfg.drafter.get("tau")
    if start_tau is None and drafter is not None and start.verify != "ar":
        start_tau = drafter.for_plan(start).trace_tau
    predictor = predicted.Predictor(setting, drafter, start, float(start_tau or 1.0))
    space = sp.build_space(cfg, platform="cpu" if cfg.gpu.name == "cpu" else "gpu")
    fields = sp.plan_fields(start)
    proposals = predicted.PredictedProposer().propose(props.Context(space, fields, None, set(), predict=predictor), n)
    rows = []
    for prop in proposals:
        plan = space.quick_plan("candidate", sp.apply(fields, prop.rewrite))
        rows.append({"rewrite": prop.rewrite, "tau": predictor.tau(plan), "ms_per_token": 1e3 * predictor(plan),
                     "gain": prop.handle[1]})
    return start.name, rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| plan | tau | pred ms/step | pred ms/token | floor ms/token | stages (pred ms per step) |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        stages = ", ".join(f"{k} {v:.3f}" for k, v in r["stages_ms"].items())
        floor = sum(r["floors_ms"].values()) / r["tau"]
        lines.append(f"| {r['method']} | {r['tau']:.2f} | {r['ms_per_step']:.3f} | {r['ms_per_token']:.3f} | "
                     f"{floor:.3f} | {stages} |")
    return "\n".join(lines)


@entry.app(config_path="../conf", config_name="predict", options="predict")
def main(cfg: DictConfig) -> None:
    with open_dict(cfg):  # this script's own options, not part of the run config the schema types
        opts = cfg.pop("predict", None) or {}
    try:
        unknown = sorted(set(opts) - {"tau", "rates", "out", "best"})
        if unknown:
            raise config_schema.ConfigValueError(f"predict.{unknown[0]}: not an option of predict.py (options: "
                                                 "tau, rates, out, best)")
        cfg = config_schema.typed(cfg)
        rates = Rates.load(opts["rates"]) if opts.get("rates") else None
        tau = float(opts["tau"]) if opts.get("tau") is not None else None
        rows = predict_all(cfg, tau, rates)
        best = None
        if opts.get("best") is not None:
            n = opts["best"]
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise config_schema.ConfigValueError(f"predict.best: {n!r} is not a number of plans (an integer >= 1)")
            best = best_plans(cfg, n, tau, rates)
    except Exception as e:
        entry.report(e)
    given = [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task]
    if "experiment" in given and "drafter" not in given:  # conf/predict.yaml's drafter wins over the experiment's
        print(f"note: predicting with drafter={cfg.drafter.name} (conf/predict.yaml's); pass drafter=... for the "
              f"experiment's own drafter")
    print(f"rates: {rows[0]['rates'] if rows else ''}")
    print(format_rows(rows))
    if best is not None:
        print(f"\nwhat the loop's predicted proposer would propose first, from {best[0]}:")
        print("| rewrite | tau | pred ms/token | predicted gain |\n|---|---:|---:|---:|")
        for r in best[1]:
            print(f"| `{json.dumps(r['rewrite'])}` | {r['tau']:.2f} | {r['ms_per_token']:.3f} | {r['gain']:.2f}x |")
    if opts.get("out"):
        Path(opts["out"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"predictions: {opts['out']}")


if __name__ == "__main__":
    main()
