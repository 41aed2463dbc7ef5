"""The warm worker: plan-only candidates on a kept deployment, timed in turn, with the tokens a fresh
process gives; a candidate that breaks the worker loses alone."""

import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from agent_helpers import HONEST_PROGRAM, spec, toy_cfg
from specpilot.agent import evaluator as ev
from specpilot.agent import warm_pool
from specpilot.agent import warm_worker as ww


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    cache = tmp_path_factory.mktemp("warm-cache")
    cfg = toy_cfg(cache_dir=str(cache))
    prompts = np.random.default_rng(0).integers(0, 200, size=(1, 12)).tolist()
    return cfg, prompts, tmp_path_factory.mktemp("warm-work")


def _go_order(folder) -> list[str]:
    return re.findall(r"^== go (\S+)$", (Path(folder) / "stderr.txt").read_text(), re.M)


def test_plan_only_specs_share_one_kept_deployment(toy):
    cfg, prompts, work = toy
    specs = [spec(cfg, "inc", {"verify": "chain"}, prompts),
             {**spec(cfg, "b4", {"verify": "chain", "block_size": 4}, prompts), "profile": False},
             spec(cfg, "ar", {"verify": "ar"}, prompts),
             spec(cfg, "bad", {"verify": "chain", "batching": {"nonsense": 1}}, prompts)]
    first = warm_pool.evaluate_warm(specs, timeout_s=300, memory_mb=None, workdir=str(work), sandbox="none")
    by = {r["name"]: r for r in first}
    assert [r["name"] for r in first] == ["inc", "b4", "ar", "bad"]
    assert by["bad"]["status"] == ev.CRASHED and "nonsense" in by["bad"]["reason"]
    for name in ("inc", "b4", "ar"):
        assert by[name]["status"] == ev.OK, by[name]
        assert len(by[name]["wall_s"]) == 2 and by[name]["warm"]
        assert by[name]["timed_compiles"] == 0  # every program compiled at load, none evicted since
    # lossless: stock at either block size emits AR's tokens, run after run
    assert by["inc"]["tokens"] == by["ar"]["tokens"] == by["b4"]["tokens"]
    assert by["inc"]["deployment_built"] and not by["b4"]["deployment_built"]
    # the stage split only where asked for (the incumbent's and a winner's: its programs compile)
    assert by["inc"]["stats"].get("time_split") and not by["b4"]["stats"].get("time_split")
    # timed in turn, each plan first in one repeat
    assert _go_order(by["inc"]["folder"]) == ["inc", "b4", "ar", "b4", "ar", "inc"]

    again = warm_pool.evaluate_warm(specs[:2], timeout_s=300, memory_mb=None, workdir=str(work), sandbox="none")
    assert [r["status"] for r in again] == [ev.OK, ev.OK]
    assert {r["worker_pid"] for r in again} == {by["inc"]["worker_pid"]}  # the same process
    assert not any(r["deployment_built"] for r in again)
    assert again[1]["tokens"] == by["b4"]["tokens"]

    cold = ev.evaluate_candidate(specs[1], timeout_s=300, memory_mb=None, workdir=str(work), sandbox="none")
    assert cold["status"] == ev.OK and cold["tokens"] == by["b4"]["tokens"]  # what a fresh process gives
    assert not cold["stats"].get("time_split")  # nor does a fresh process profile what is not asked for


def _patched_python(tmp_path, go_body: str) -> Path:
    """A python that runs the warm worker with `go` patched (`go_body`: statements before the real go, with
    `self`, `name` and `Path` in scope), everything else as usual."""
    worker = tmp_path / "patched_worker.py"
    worker.write_text("import sys\nfrom pathlib import Path\nfrom specpilot.agent import warm_worker as ww\n"
                      "go = ww.WarmWorker.go\ndef patched_go(self, name):\n"
                      + textwrap.indent(textwrap.dedent(go_body), "    ")
                      + "    return go(self, name)\nww.WarmWorker.go = patched_go\nsys.exit(ww.main())\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$2" = specpilot.agent.warm_worker ]; then exec {sys.executable} {worker}; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return python


def test_a_candidate_that_kills_the_worker_loses_alone(toy, tmp_path):
    cfg, prompts, work = toy
    # the worker, with a plan that ends its process on its first timed run
    python = _patched_python(tmp_path, """
        import os, signal
        if name == "crash-me":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    specs = [spec(cfg, name, {"verify": "chain", "block_size": b}, prompts) for name, b in
             (("inc", 8), ("crash-me", 4), ("b2", 2))]
    out = warm_pool.evaluate_warm(specs, timeout_s=300, memory_mb=None, workdir=str(work), python=str(python),
                                  sandbox="none")
    by = {r["name"]: r for r in out}
    assert by["crash-me"]["status"] == ev.KILLED and "signal 9" in by["crash-me"]["reason"]
    assert by["inc"]["status"] == by["b2"]["status"] == ev.OK
    assert by["inc"]["tokens"] == by["b2"]["tokens"]
    assert "crash-me" not in _go_order(by["inc"]["folder"])  # the others ran again in a new worker


def test_every_plan_failing_its_timed_runs_is_reported_not_a_lost_worker(toy, tmp_path):
    cfg, prompts, work = toy
    python = _patched_python(tmp_path, """
        if name.startswith("fail"):
            raise RuntimeError("this plan breaks when timed")
    """)
    specs = [spec(cfg, name, {"verify": "chain", "block_size": b}, prompts) for name, b in (("fail-a", 8), ("fail-b", 4))]
    out = warm_pool.evaluate_warm(specs, timeout_s=300, memory_mb=None, workdir=str(work), python=str(python),
                                  sandbox="none")
    for r in out:
        assert r["status"] == ev.CRASHED and "during timed run 1" in r["reason"] and "breaks" in r["reason"], r


def test_a_kept_worker_out_of_memory_is_replaced_and_the_round_runs_again(toy, tmp_path):
    """A worker kept across rounds holds what they compiled and kept; out of memory there, its plans run
    again in a fresh worker (on the CPU pair, a second round's every candidate failed in the old one)."""
    cfg, prompts, work = toy
    marker = tmp_path / "oom-once"
    python = _patched_python(tmp_path, f"""
        if Path({str(marker)!r}).exists():
            Path({str(marker)!r}).unlink()
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 51576912 bytes.")
    """)
    specs = [spec(cfg, "inc", {"verify": "chain", "block_size": 8}, prompts),
             spec(cfg, "b4", {"verify": "chain", "block_size": 4}, prompts)]
    first = warm_pool.evaluate_warm(specs, timeout_s=300, memory_mb=None, workdir=str(work), python=str(python),
                                    sandbox="none")
    assert [r["status"] for r in first] == [ev.OK, ev.OK]
    marker.touch()  # the kept worker's next timed run runs out of memory
    again = warm_pool.evaluate_warm(specs, timeout_s=300, memory_mb=None, workdir=str(work), python=str(python),
                                    sandbox="none")
    assert [r["status"] for r in again] == [ev.OK, ev.OK], again
    assert not marker.exists() and {r["worker_pid"] for r in again} != {first[0]["worker_pid"]}
    assert again[0]["tokens"] == first[0]["tokens"] and again[1]["tokens"] == first[1]["tokens"]


def test_evaluator_runs_plan_only_specs_warm_and_programs_apart(toy, tmp_path):
    cfg, prompts, _ = toy
    program = tmp_path / "honest.py"
    program.write_text(HONEST_PROGRAM)
    specs = [spec(cfg, "inc", {"verify": "chain"}, prompts),
             spec(cfg, "given", {"verify": "chain"}, prompts, program=program),
             spec(cfg, "b4", {"verify": "chain", "block_size": 4}, prompts)]
    assert [warm_pool.plan_only(s) for s in specs] == [True, False, True]
    assert not warm_pool.plan_only({**specs[0], "stage": "check"})
    with ev.Evaluator(1, timeout_s=300, memory_mb=None, workdir=tmp_path / "work", sandbox="none") as e:
        seen = []
        out = e.evaluate(specs, progress=seen.append, warm=True)
    assert [r["name"] for r in out] == ["inc", "given", "b4"] and sorted(r["name"] for r in seen) == sorted(
        ["inc", "given", "b4"])
    assert [r["status"] for r in out] == [ev.OK] * 3
    assert out[0]["warm"] and out[2]["warm"] and not out[1].get("warm")
    assert out[0]["worker_pid"] == out[2]["worker_pid"]
    assert out[0]["tokens"] == out[2]["tokens"] and out[1]["tokens"][0] == [[0] * 16]


def test_the_deployment_key_ignores_what_each_plan_sets(toy):
    cfg, prompts, _ = toy
    a = spec(cfg, "a", {"verify": "chain"}, prompts)
    b = spec(cfg, "b", {"verify": "ar"}, prompts, new_tokens=4)
    b["config"]["bench"]["prompt_len"] = 99
    assert ww.deployment_key(a) == ww.deployment_key(b)
    c = spec(toy_cfg("seed=7", cache_dir=str(cfg.cache_dir)), "c", {"verify": "chain"}, prompts)
    assert ww.deployment_key(c) != ww.deployment_key(a)


def test_candidates_at_a_step_trace_deployment_replay_their_traces_warm_and_cold(tmp_path):
    """drafter=oracle_trace (the DDTree-calibrated file): a candidate shape the file does not name runs from
    a trace sampled for it, in the warm worker and in a fresh process alike, and emits AR's tokens."""
    cfg = toy_cfg("drafter=oracle_trace", "drafter.block_size=16",
                  "drafter.step_trace=docs/results/trace_ddtree_calibrated.json", cache_dir=str(tmp_path / "c"))
    prompts = np.random.default_rng(1).integers(0, 200, size=(1, 12)).tolist()
    specs = [spec(cfg, "inc", {"verify": "chain", "block_size": 16}, prompts, repeats=1),
             {**spec(cfg, "t12", {"verify": "tree", "tree": {"nodes": 12, "depth": 5, "branching": 2}}, prompts,
                     repeats=1), "profile": False},
             spec(cfg, "ar", {"verify": "ar"}, prompts, repeats=1)]
    warm = {r["name"]: r for r in warm_pool.evaluate_warm(specs, timeout_s=300, memory_mb=None,
                                                          workdir=str(tmp_path / "w"), sandbox="none")}
    assert all(r["status"] == ev.OK for r in warm.values()), warm
    assert warm["inc"]["tokens"] == warm["t12"]["tokens"] == warm["ar"]["tokens"]
    assert warm["t12"]["stats"]["trace_sampled"] and warm["t12"]["stats"]["tau"] > 1
    cold = ev.evaluate_candidate(specs[1], timeout_s=300, memory_mb=None, workdir=str(tmp_path / "w"),
                                 sandbox="none")
    assert cold["status"] == ev.OK and cold["tokens"] == warm["ar"]["tokens"], cold


def test_under_an_address_space_limit_a_worker_drops_the_programs_of_plans_it_no_longer_keeps(toy, monkeypatch):
    # a CPU warm worker kept every program of every round's candidates and outgrew its 8 GB limit
    from specpilot.decoding import aot
    cfg, prompts, _ = toy
    worker = ww.WarmWorker()
    for s in (spec(cfg, "inc", {"verify": "chain"}, prompts), spec(cfg, "b4", {"verify": "chain", "block_size": 4}, prompts)):
        worker.load(s)
        worker.go(s["name"])
    monkeypatch.setattr(ww, "address_space_limited", lambda: True)
    assert worker.retain(["inc", "b4"])["programs_dropped"] == 0  # both kept: nothing to drop
    assert worker.retain(["inc"])["programs_dropped"] > 0  # b4's own
    before = aot.total_compiles()
    worker.load(spec(cfg, "inc2", {"verify": "chain"}, prompts))  # the kept plan's programs: no compile
    assert aot.total_compiles() == before
    worker.load(spec(cfg, "b4_again", {"verify": "chain", "block_size": 4}, prompts))  # the dropped plan's: again
    assert aot.total_compiles() > before
    monkeypatch.setattr(ww, "address_space_limited", lambda: False)  # no limit: programs stay
    assert worker.retain(["inc2"])["programs_dropped"] == 0
