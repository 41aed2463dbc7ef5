"""The loop end to end at a toy deployment, as a user runs it: two rounds on two Dask workers, one injected
crashing candidate, and the driver killed (kill -9) after its first round and restarted: it resumes from memory."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from agent_helpers import ROOT, TOY, toy_cfg

from specpilot.agent import memory as mem
from specpilot.agent.loop import Loop, tried_before
from specpilot.harness.config_schema import build_plans, validate


def _command(tmp_path, crash):
    return [sys.executable, str(ROOT / "experiments" / "agent.py"), *TOY,
            "agent.rounds=2", "agent.workers=2", "agent.per_proposer=1", "agent.repeats=2", "agent.heldout=8",
            "agent.proposers=[memory,guided,optuna]", f"agent.memory_url=sqlite:///{tmp_path / 'memory.db'}",
            f"agent.candidates=[{{name:crash,fields:{{block_size:4}},program:{crash}}}]",
            f"cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'hydra'}"]


@pytest.mark.slow
def test_two_rounds_a_crash_and_a_resume(tmp_path):
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('injected crash')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen(_command(tmp_path, crash), cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 400
        for line in driver.stdout:
            lines.append(line)
            if line.startswith("round 0 done") or time.monotonic() > deadline:
                break
        assert any(line.startswith("round 0 done") for line in lines), "".join(lines[-40:])
        os.kill(driver.pid, signal.SIGKILL)  # the driver dies between rounds
        driver.wait(30)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)  # whatever it had started (its Dask workers)
        except ProcessLookupError:
            pass
    first = "".join(lines)
    assert "r0-given0-crash: crashed" in first and "round 1" not in first.replace("round 1:", "")
    memory = mem.Memory(f"sqlite:///{tmp_path / 'memory.db'}")
    (run,) = memory.run_keys()
    assert [r.index for r in memory.rounds(run)] == [0]
    crashed = [c for c in memory.candidates(run, 0) if c.name.endswith("crash")]
    assert crashed[0].status == "failed" and "injected crash" in crashed[0].reason

    again = subprocess.run(_command(tmp_path, crash), cwd=tmp_path, capture_output=True, text=True, env=env,
                           timeout=400)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming run {run} at round 1" in again.stdout
    assert "round 0:" not in again.stdout.split("resuming")[1].split("round 1 done")[0].replace("round 0: best", "")
    assert [r.index for r in memory.rounds(run)] == [0, 1]
    judged = [c for c in memory.candidates(run) if c.status != "incumbent"]
    assert len({c.rewrite_key for c in judged}) == len(judged)  # nothing proposed twice across the restart
    assert not [c for c in memory.candidates(run, 1) if c.name.endswith("crash")]  # given in round 0 only
    assert {c.status for c in memory.candidates(run, 1)} <= {"incumbent", "accepted", "rejected", "dropped",
                                                               "pruned", "failed"}

    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert [r["index"] for r in summary["rounds"]] == [0, 1]
    assert all(r["best_s_per_token"] > 0 for r in summary["rounds"])
    assert (out / "round_0.md").exists() and "crash" in (out / "round_0.md").read_text()
    assert (out / "round_1.md").exists() and (out / "best_by_round.png").stat().st_size > 0
    # the winning plan is a decoding config any run takes: decoding=<name> once it sits in a decoding/ folder
    extra = tmp_path / "conf_extra"
    (extra / "decoding").mkdir(parents=True)
    plan_file = Path(summary["plan_file"])
    shutil.copy(plan_file, extra / "decoding" / plan_file.name)
    cfg = toy_cfg(f"decoding={plan_file.stem}", f"hydra.searchpath=[file://{extra}]")
    validate(cfg)
    plan = next(p for p in build_plans(cfg) if p.name == "found")
    assert plan.verify == summary["incumbent"]["verify"]


def test_a_resumed_round_counts_only_finished_rounds_as_tried(tmp_path):
    memory = mem.Memory(f"sqlite:///{tmp_path / 'memory.db'}")
    memory.start_run("k", {}, {})
    for r, key, status in ((0, "a", "rejected"), (0, "i", "incumbent"), (1, "b", "failed")):
        memory.record_candidate("k", r, name=f"r{r}-{key}", proposer="guided", rewrite_key=key, rewrite={},
                                fields=None, status=status, reason="")
    memory.finish_round("k", 0, {"verify": "ar"}, 1e-3, 1e-3)  # round 1 was interrupted after judging "b"
    assert tried_before(memory, "k", 1) == {"a"}
    assert tried_before(memory, "k", 2) == {"a", "b"}


def test_a_winner_is_profiled_once_and_keeps_its_timed_result_if_that_fails():
    """Candidates are timed without the stage split; the loop asks for it once, from the winner."""
    calls = []

    class FakeEvaluator:
        def __init__(self, status):
            self.status = status

        def evaluate(self, specs, warm):
            calls.append((specs, warm))
            return [{"status": self.status, "stats": {"time_split": {"draft": 1.0}}}]

    fake = types.SimpleNamespace(agent=types.SimpleNamespace(warm=True),
                                 spec=lambda name, fields, prompts, profile: {"name": name, "fields": fields,
                                                                              "profile": profile, "repeats": 3})
    best = {"fields": {"block_size": 4}, "result": {"status": "ok", "stats": {}}}
    out = Loop._profiled(fake, FakeEvaluator("ok"), 2, best, [[1, 2]])
    assert calls == [([{"name": "r2-winner", "fields": {"block_size": 4}, "profile": True, "repeats": 1}], True)]
    assert out["stats"]["time_split"] == {"draft": 1.0}
    assert Loop._profiled(fake, FakeEvaluator("crashed"), 2, best, [[1, 2]]) is best["result"]
