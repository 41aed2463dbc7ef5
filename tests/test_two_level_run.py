"""Two-level plans through the run entry point (subprocess, as a user runs it): token forcing is clean,
the outputs equal AR's, and the records carry the nodes each step verifies."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_level_plans_run_and_pass_token_forcing(tmp_path):
    out = tmp_path / "out"
    tree = "{nodes: 12, depth: 3, branching: 3}"
    plans = (f"+decoding.plans={{conf: {{verify: two_level, tree: {tree}, two_level: {{first: drafter_confidence, "
             f"keep: 6}}}}, exit: {{verify: two_level, tree: {tree}, two_level: {{first: early_exit, keep: 6, "
             f"exit_layer: 2}}}}}}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "target=tiny_random", "drafter=random",
         "drafter.num_layers=1", "drafter.block_size=4", "decoding=ar", plans,
         "bench=default", "bench.num_prompts=2", "bench.new_tokens=12", f"output_dir={out}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert {"conf", "exit"} <= set(records)
    for name in ("conf", "exit"):
        rec = records[name]
        assert rec["verify"] == "two_level" and rec["block_size"] == 12
        assert rec["forcing"]["positions"] == 24 and rec["mismatches"] == 0
        assert rec["forcing"]["outputs_differ"] == 0
        assert rec["stats"]["nodes_verified"] == 6
    assert records["exit"]["stats"]["first_level"] == {"nodes": 12, "layers": 2, "target_layers": 4,
                                                       "head": "the target's"}
    assert "exit: token forcing: 24 positions, 0 mismatches" in proc.stdout


def _run(tmp_path, plans: str):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "target=tiny_random", "drafter=random",
         "drafter.num_layers=1", "drafter.block_size=4", "decoding=ar", plans,
         "bench=default", "bench.num_prompts=2", "bench.new_tokens=12", f"output_dir={out}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.slow
def test_an_exit_head_plan_runs_and_passes_token_forcing(tmp_path):
    import numpy as np
    from specpilot.models import exit_head

    cfg = exit_head.ExitHeadConfig(exit_layer=2, hidden_size=128, rank=8, num_ids=256, vocab_size=512,
                                   num_layers=4)  # conf/target/tiny_random.yaml's shape
    rng = np.random.default_rng(0)
    params = {k: (1.0 if k == "norm" else 0.0) + 0.3 * rng.standard_normal(s) for k, s in cfg.param_shapes().items()}
    exit_head.save(tmp_path / "head", params, cfg, np.arange(0, 512, 2))
    tree = "{nodes: 12, depth: 3, branching: 3}"
    proc, out = _run(tmp_path, f"+decoding.plans={{head: {{verify: two_level, tree: {tree}, two_level: {{first: "
                               f"early_exit, keep: 6, exit_layer: 2, exit_head: {tmp_path / 'head'}}}}}}}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert rec["method"] == "head" and rec["mismatches"] == 0 and rec["forcing"]["outputs_differ"] == 0
    assert rec["stats"]["first_level"]["head"] == "trained" and rec["plan"]["two_level"]["exit_head"] == str(
        tmp_path / "head")

    proc, _ = _run(tmp_path, f"+decoding.plans={{bad: {{verify: two_level, tree: {tree}, two_level: {{first: "
                             f"early_exit, keep: 6, exit_layer: 3, exit_head: {tmp_path / 'head'}}}}}}}")
    assert proc.returncode != 0
    assert "decoding.plans.bad.two_level.exit_head: exit head" in proc.stdout + proc.stderr
    assert "reads layer 2's output; the plan's exit_layer is 3" in proc.stdout + proc.stderr
