"""Predict a deployment's plans without running them: `python experiments/predict.py [run.py's overrides]`.

Composes the same config as experiments/run.py, builds the deployment abstractly (shapes only, under
`jax.eval_shape`: no weights are made, so the Qwen3-8B shape predicts in a second on a laptop) and prints,
for every plan, the cost model's time per step of each stage and per output token at a tau, against the
gpu config's calibrated rates (`conf/gpu/rates/<gpu>.yaml`). Nothing is measured: a prediction made here
equals the `pred ms` a run of the same config prints at the same tau.
Options: `+predict.tau=7.94` (tokens per verification step; default the drafter config's `tau`),
`+predict.rates=<file>` (another rates file, e.g. a fresh calibration), `+predict.out=<file.jsonl>`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import hydra
import jax
from omegaconf import DictConfig, open_dict

from specpilot.costmodel import roofline, counts, prediction
from specpilot.harness import config_schema, deploy
from specpilot.costmodel.rates import Rates

config_schema.register()
log = logging.getLogger("predict")


def abstract_deployment(cfg, plans):
    """`deploy.build` with every array abstract (its params, the drafter's and the key become
    `jax.ShapeDtypeStruct`s: a deployment to count, not to run); a build that needs concrete values
    (a checkpoint's checks) is made for real instead."""
    box = {}

    def build():
        dep = box["dep"] = deploy.build(cfg, plans)
        return dep.params, (dep.drafter[1] if dep.drafter is not None else None), dep.key

    try:
        params, drafter_params, key = jax.eval_shape(build)
    except jax.errors.JAXTypeError:
        log.info("the deployment needs concrete values to build; building it for real")
        return deploy.build(cfg, plans)
    dep = box["dep"]
    drafter = (dep.drafter[0], drafter_params) if dep.drafter is not None else None
    return dataclasses.replace(dep, params=params, drafter=drafter, key=key)


def predict_all(cfg, tau: float | None = None, rates: Rates | None = None) -> list[dict]:
    """One row per plan of the composed, typed config `cfg`: the prediction's dict plus the deployment."""
    plans = config_schema.build_plans(cfg)
    dep = abstract_deployment(cfg, plans)
    if tau is None:
        tau = getattr(cfg.drafter, "tau", None)
    rates = rates or Rates.for_gpu(cfg.gpu)
    setting = prediction.Setting(counts.Shape.from_deployment(dep), rates, roofline.Hardware.from_conf(cfg.gpu))
    rows = []
    for plan in plans:
        if plan.verify != "ar" and tau is None:
            raise ValueError(f"plan {plan.name!r} drafts: give its tau (+predict.tau=...); the drafter config "
                             f"{cfg.drafter.name!r} states none")
        p = prediction.predict(plan, setting, None if plan.verify == "ar" else float(tau))
        rows.append({**dep.labels, "method": plan.name, **p.to_dict(), "rates": rates.source})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = ["| plan | tau | pred ms/step | pred ms/token | floor ms/token | stages (pred ms per step) |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        stages = ", ".join(f"{k} {v:.3f}" for k, v in r["stages_ms"].items())
        floor = sum(r["floors_ms"].values()) / r["tau"]
        lines.append(f"| {r['method']} | {r['tau']:.2f} | {r['ms_per_step']:.3f} | {r['ms_per_token']:.3f} | "
                     f"{floor:.3f} | {stages} |")
    return "\n".join(lines)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    with open_dict(cfg):  # this script's own options, not part of the run config the schema types
        opts = cfg.pop("predict", None) or {}
    try:
        cfg = config_schema.typed(cfg)
        rates = Rates.load(opts["rates"]) if opts.get("rates") else None
        tau = float(opts["tau"]) if opts.get("tau") is not None else None
        rows = predict_all(cfg, tau, rates)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"rates: {rows[0]['rates'] if rows else ''}")
    print(format_rows(rows))
    if opts.get("out"):
        Path(opts["out"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"predictions: {opts['out']}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
