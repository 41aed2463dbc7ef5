"""experiments/predict.py: predictions from the config alone, with the deployment built abstractly."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specpilot.costmodel import roofline, counts, prediction
from specpilot.harness import config_schema, deploy
from specpilot.costmodel.rates import Rates

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["target=tiny_random", "drafter=random", "decoding=stock", "bench=default"]


def _script():
    spec = importlib.util.spec_from_file_location("predict_script", ROOT / "experiments" / "predict.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(extra=()):
    config_schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return config_schema.typed(compose("config", overrides=OVERRIDES + list(extra)))


def test_abstract_build_predicts_what_the_built_deployment_predicts():
    mod = _script()
    cfg = _cfg()
    rows = mod.predict_all(cfg, tau=1.75)
    plans = config_schema.build_plans(cfg)
    import jax

    abstract = mod.abstract_deployment(cfg, plans)
    assert isinstance(abstract.params["embed"], jax.ShapeDtypeStruct)  # no weights were made
    dep = deploy.build(cfg, plans)  # real weights this time
    setting = prediction.Setting(counts.Shape.from_deployment(dep), Rates.for_gpu(cfg.gpu),
                                 roofline.Hardware.from_conf(cfg.gpu))
    assert [r["method"] for r in rows] == [p.name for p in plans]
    for row, plan in zip(rows, plans):
        want = prediction.predict(plan, setting, None if plan.verify == "ar" else 1.75).to_dict()
        assert row["ms_per_step"] == pytest.approx(want["ms_per_step"], rel=1e-12)
        assert row["stages_ms"] == pytest.approx(want["stages_ms"], rel=1e-12)
        assert row["tau"] == (1.0 if plan.verify == "ar" else 1.75)


def test_the_script_prints_a_table_and_refuses_a_drafting_plan_without_tau(tmp_path):
    base = [sys.executable, str(ROOT / "experiments" / "predict.py"), *OVERRIDES, f"hydra.run.dir={tmp_path}/h"]
    bad = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 1 and "+predict.tau" in bad.stderr
    out = tmp_path / "p.jsonl"
    ok = subprocess.run(base + ["+predict.tau=2", f"+predict.out={out}"], capture_output=True, text=True,
                        cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "| stock | 2.00 |" in ok.stdout and len(out.read_text().splitlines()) == 2
