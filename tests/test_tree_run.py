"""Tree plans through the run entry point (subprocess, as a user runs it): token forcing is clean and the
outputs equal AR's."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tree_plans_run_and_pass_token_forcing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "target=tiny_random", "drafter=oracle",
         "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=2.5", "decoding=tree",
         "decoding.plans.tree_n16.tree.nodes=8", "decoding.plans.tree_n16.tree.depth=3",
         "decoding.plans.tree_n32.tree.nodes=12", "decoding.plans.tree_n32.tree.depth=3",
         "bench=default", "bench.num_prompts=2", "bench.new_tokens=12", f"output_dir={out}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(records) == {"ar", "stock", "tree_n16", "tree_n32"}
    for name in ("tree_n16", "tree_n32"):
        rec = records[name]
        assert rec["verify"] == "tree" and rec["block_size"] == {"tree_n16": 8, "tree_n32": 12}[name]
        assert rec["forcing"]["positions"] == 24 and rec["mismatches"] == 0
        assert rec["forcing"]["outputs_differ"] == 0
        assert 1.0 < rec["tau"] <= 4.0 and "oracle acceptance" in rec["notes"]
        assert len(rec["stats"]["acceptance_per_position"]) == 3
    assert "tree_n16: token forcing: 24 positions, 0 mismatches" in proc.stdout
