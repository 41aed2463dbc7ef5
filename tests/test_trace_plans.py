"""experiments/bench/trace_plans.py: a plan's decode and profiled phases traced, kernels summed per span."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specpilot.harness import config_schema, deploy

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = ["target=tiny_random", "drafter=oracle", "drafter.tau=2.5", "drafter.block_size=4", "bench=default",
             "bench.num_prompts=2", "bench.new_tokens=12"]


def _script():
    spec = importlib.util.spec_from_file_location("trace_plans_script", ROOT / "experiments" / "bench" / "trace_plans.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # ~45 s on 2 cores: AR, stock and the profiled phases compile
def test_every_decode_and_phase_call_lies_in_its_profiler_span():
    """On the CPU there are no device kernels to sum, but the host spans are real: the traced decode has one
    "specpilot.decode" span per batch (2 prompts at batch 1), and the profiled pass one span per phase per
    verification step of its first batch, so a device's kernels are attributed to the right phase. Loop
    steps are each batch's longest row's verification steps, summed."""
    mod = _script()
    config_schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = config_schema.typed(compose("config", overrides=OVERRIDES))
    plans = config_schema.build_plans(cfg)
    dep = deploy.build(cfg, plans)
    ar_row, ar_run = mod.trace_plan(dep, plans[0], top=5)
    dep.reference_tokens = ar_run.tokens
    assert ar_row["decode"]["spans"] == 2 and ar_row["steps"] == ar_run.decode_tokens == 2 * 11
    stock = next(p for p in plans if p.verify == "chain")
    row, run = mod.trace_plan(dep, stock, top=5)
    assert row["decode"]["spans"] == 2
    assert row["steps"] == run.stats["loop_steps"] and 2 * 11 / 4 <= row["steps"] <= 2 * 11
    prof = row["profiled"]
    assert set(prof) == {"draft", "verify", "accept"}
    spans = {p: v["spans"] for p, v in prof.items()}
    assert len(set(spans.values())) == 1 and 11 / 4 <= spans["draft"] <= 11  # one span per step, first batch
    assert all(v["host_ms_per_step"] > 0 for v in prof.values())
    assert "stock" in mod.format_rows([ar_row, row])


def test_unknown_plan_names_are_refused(tmp_path):
    bad = subprocess.run([sys.executable, "experiments/bench/trace_plans.py", *OVERRIDES, "+trace.plans=[nope]",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 1 and "trace.plans names ['nope']" in bad.stderr, bad.stderr
