"""experiments/predict.py: predictions from the configs alone, nothing built, no device needed."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specpilot.costmodel import counts, prediction, roofline
from specpilot.costmodel.rates import Rates
from specpilot.harness import config_schema, deploy
from specpilot.models import dense

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["target=tiny_random", "drafter=random", "decoding=stock", "bench=default"]


def _script():
    spec = importlib.util.spec_from_file_location("predict_script", ROOT / "experiments" / "predict.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(extra=(), config="config"):
    config_schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return config_schema.typed(compose(config, overrides=OVERRIDES + list(extra)))


def test_shapes_predict_what_the_built_deployment_predicts(monkeypatch):
    mod = _script()
    cfg = _cfg()
    with monkeypatch.context() as m:  # no weights, no deployment
        m.setattr(deploy, "build", lambda *a, **k: pytest.fail("predict built the deployment"))
        m.setattr(dense, "INITS", {})
        rows = mod.predict_all(cfg, tau=1.75)
    plans = config_schema.build_plans(cfg)
    dep = deploy.build(cfg, plans)  # real weights this time
    setting = prediction.Setting(counts.Shape.from_deployment(dep), Rates.for_gpu(cfg.gpu),
                                 roofline.Hardware.from_conf(cfg.gpu))
    assert [r["method"] for r in rows] == [p.name for p in plans]
    for row, plan in zip(rows, plans):
        want = prediction.predict(plan, setting, None if plan.verify == "ar" else 1.75).to_dict()
        assert row["ms_per_step"] == pytest.approx(want["ms_per_step"], rel=1e-12)
        assert row["stages_ms"] == pytest.approx(want["stages_ms"], rel=1e-12)
        assert row["tau"] == (1.0 if plan.verify == "ar" else 1.75)
        assert row["target"] == "tiny_random" and row["gpu"] == "cpu"


def test_the_script_prints_a_table_and_refuses_a_drafting_plan_without_tau(tmp_path):
    base = [sys.executable, str(ROOT / "experiments" / "predict.py"), *OVERRIDES, f"hydra.run.dir={tmp_path}/h"]
    bad = subprocess.run(base + ["drafter.tau=null"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "config error: predict.tau: plan 'stock' drafts: give its tau (+predict.tau=...); the drafter config "
        "'random' states none"]
    out = tmp_path / "p.jsonl"
    ok = subprocess.run(base + ["+predict.tau=2", f"+predict.out={out}"], capture_output=True, text=True,
                        cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "| stock | 2.00 |" in ok.stdout and len(out.read_text().splitlines()) == 2


def test_the_readme_line_predicts_the_8b_shape_in_seconds(tmp_path):
    """README: `python experiments/predict.py gpu=h200 target=qwen3_8b decoding=w12 +predict.tau=6.27`, as
    written, on this CPU: another device's config, a shape far beyond this machine's memory."""
    out = tmp_path / "p.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "predict.py"), "gpu=h200", "target=qwen3_8b",
                           "decoding=w12", "+predict.tau=6.27", f"+predict.out={out}", f"hydra.run.dir={tmp_path}/h"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert time.perf_counter() - t0 < 60
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["method"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"ar", "ar_mosaic", "stock", "ar_w12", "stock_w12"}
    assert all(r["target"] == "qwen3_8b" and r["gpu"] == "h200" for r in rows.values())
    assert rows["stock"]["tau"] == 6.27 and rows["stock"]["ms_per_token"] < rows["ar"]["ms_per_token"]
    for name in rows:
        assert f"| {name} |" in proc.stdout


def test_the_bare_command_predicts_the_8b_stock_experiment(tmp_path):
    """`python experiments/predict.py` with no override: the GPU experiments' setting, not run.py's CPU
    default (whose block-4 plan cannot emit the oracle's 6.27 tokens a step)."""
    out = tmp_path / "p.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "predict.py"), f"+predict.out={out}",
                           f"hydra.run.dir={tmp_path}/h"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["method"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"ar", "ar_mosaic", "stock"}
    assert all(r["target"] == "qwen3_8b" and r["gpu"] == "h200" for r in rows.values())
    assert rows["stock"]["tau"] == 6.27 and rows["stock"]["ms_per_token"] < rows["ar"]["ms_per_token"]


def test_under_a_step_trace_each_plan_is_predicted_at_its_own_trace_tau():
    """drafter=oracle_trace: a recorded plan at its trace's tau, another shape at the tau of the trace
    sampled for it from the file's model (what a run would replay), AR at 1."""
    from specpilot.models.oracle_trace import OracleTraceDrafter, load_model, load_traces

    trace = "docs/results/trace_ddtree_calibrated.json"
    cfg = _cfg(["drafter=oracle_trace", "drafter.num_layers=1", f"drafter.step_trace={trace}",
                "+decoding.plans={ar: {verify: ar}, oracle_tree_n32: {verify: tree, tree: {nodes: 32, depth: 15, "
                "branching: 4}}, b8: {verify: chain, block_size: 8}}"], config="predict")
    rows = {r["method"]: r for r in _script().predict_all(cfg)}
    drafter = OracleTraceDrafter.from_traces(None, load_traces(trace), trace, load_model(trace))
    plans = {p.name: p for p in config_schema.build_plans(cfg)}
    assert rows["ar"]["tau"] == 1.0
    assert rows["oracle_tree_n32"]["tau"] == pytest.approx(np.mean(dict(drafter.traces)["tree_n32"]) + 1)
    assert rows["b8"]["tau"] == pytest.approx(drafter.for_plan(plans["b8"]).trace_tau)
    assert 1 < rows["b8"]["tau"] < rows["oracle_tree_n32"]["tau"]


def test_best_lists_what_the_predicted_proposer_proposes_each_at_predict_alls_figure(tmp_path):
    """+predict.best=N: the plans the loop's `predicted` proposer would propose first, each row's τ and
    ms/token those predict_all gives the same plan."""
    mod = _script()
    config_schema.register()
    trace = "docs/results/trace_ddtree_calibrated.json"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = config_schema.typed(compose("predict", overrides=[
            "experiment=oracle_tree_ddtree_qwen3_8b_h200", "drafter=oracle_trace", f"drafter.step_trace={trace}"]))
    start, rows = mod.best_plans(cfg, 3)
    assert start == "oracle_chain" and len(rows) == 3
    assert rows[0]["rewrite"]["weights"] == "w12" and rows[0]["rewrite"]["verify"] == "tree"
    from specpilot.agent import space as sp
    chain = next(p for p in config_schema.build_plans(cfg) if p.name == "oracle_chain")
    fields = sp.plan_fields(chain)
    again = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    # beside the config's own plans: the cost shape's cache length follows the largest block of the run
    again.decoding.plans = {**again.decoding.plans, "base": fields,
                            **{f"p{i}": sp.apply(fields, r["rewrite"]) for i, r in enumerate(rows)}}
    again = config_schema.typed(again)
    want = {r["method"]: r for r in mod.predict_all(again)}
    for i, r in enumerate(rows):
        assert r["tau"] == pytest.approx(want[f"p{i}"]["tau"])
        assert r["ms_per_token"] == pytest.approx(want[f"p{i}"]["ms_per_token"])
        assert r["gain"] == pytest.approx(want["base"]["ms_per_token"] / want[f"p{i}"]["ms_per_token"])


@pytest.mark.parametrize("value", ["0", "two"])
def test_best_that_is_not_a_count_of_plans_is_refused_by_name(tmp_path, value):
    cmd = [sys.executable, str(ROOT / "experiments" / "predict.py"), *OVERRIDES, "+predict.tau=2",
           f"+predict.best={value}", f"hydra.run.dir={tmp_path}/h"]
    bad = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("config error: predict.best: ")
    assert "is not a number of plans (an integer >= 1)" in bad.stderr
