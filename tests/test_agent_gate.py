"""The gate against adversarial candidates (subprocess programs patching the candidate module), and an honest one.

Each candidate runs as the evaluator runs it (its own process, timed from outside); the gate judges it in
this process against stock's scorer and the AR reference on prompts it drew itself.
"""

import json
import textwrap

import numpy as np
import pytest
from agent_helpers import spec, toy_cfg
from omegaconf import OmegaConf

from specpilot.agent import evaluator as ev
from specpilot.agent import space as sp
from specpilot.agent.gate import Gate
from specpilot.harness.config_schema import typed

STOCK = {"verify": "chain", "block_size": 4}
PATCH = """
import sys, time
from specpilot.agent import candidate
from specpilot.harness import methods
real_run = methods.run_plan
{body}
methods.run_plan = patched
sys.exit(candidate.main(sys.argv[1], sys.argv[2]))
"""
PROGRAMS = {
    # the last token of the first prompt is changed
    "late_token": """
def patched(dep, plan):
    r = real_run(dep, plan)
    r.tokens[0][-1] = (r.tokens[0][-1] + 1) % dep.cfg.vocab_size
    return r
""",
    # replays the reference's outputs of an earlier round (leaked into its source: the sandbox hides the
    # evaluator's files) without computing anything
    "reads_reference": """
import json
from specpilot.harness.methods import MethodRun
LEAKED = json.loads({leak!r})
def patched(dep, plan):
    return MethodRun([list(t) for t in LEAKED], 0.0, 1e-9, len(LEAKED) * dep.new_tokens)
""",
    # reports a clock that never moves, while each run really takes longer
    "fake_clock": """
candidate.time = type("FakeTime", (), {{"perf_counter": staticmethod(lambda: 0.0)}})
def patched(dep, plan):
    time.sleep(0.3)
    return real_run(dep, plan)
""",
    # computes the right tokens once (warm-up), then returns them at once: skips the work
    "skips_work": """
cache = {{}}
def patched(dep, plan):
    if "run" not in cache:
        cache["run"] = real_run(dep, plan)
    return cache["run"]
""",
}


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gate")
    cfg = toy_cfg(cache_dir=str(tmp / "cache"))
    gate = Gate(cfg, heldout=12, prompts_per_round=2, noise_margin=0.05, secret=1234)
    leaked_prompts = gate.draw(0)
    leak = tmp / "leaked.json"
    leak.write_text(json.dumps(gate.reference_tokens))  # round 0's reference outputs
    prompts = gate.draw(1)
    assert prompts != leaked_prompts  # fresh each round
    incumbent = ev.evaluate_candidate(spec(cfg, "incumbent", STOCK, prompts), timeout_s=240, memory_mb=None,
                                      workdir=str(tmp / "work"))
    assert incumbent["status"] == ev.OK, incumbent["reason"]
    return cfg, gate, prompts, incumbent, tmp, leak


def _judge(setting, name, fields=STOCK, repeats=2):
    cfg, gate, prompts, incumbent, tmp, leak = setting
    program = None
    if name in PROGRAMS:
        program = tmp / f"{name}.py"
        program.write_text(PATCH.format(body=textwrap.dedent(PROGRAMS[name]).format(leak=leak.read_text())))
    res = ev.evaluate_candidate(spec(cfg, name, fields, prompts, repeats=repeats, program=program), timeout_s=240,
                                memory_mb=None, workdir=str(tmp / "work"))
    assert res["status"] == ev.OK, res["reason"]
    plan = sp.build_space(cfg).check(name, fields)
    return res, gate.check(res, plan, incumbent)


def test_honest_candidate_is_clean(setting):
    cfg, gate, prompts, incumbent, *_ = setting
    v = gate.check(incumbent, gate.stock, None)
    assert v.accepted and v.mismatches == 0 and v.reference_equal and not v.flagged
    assert incumbent["s_per_token"] > v.ceiling_s_per_token
    assert np.asarray(incumbent["tokens"][0]).tolist() == gate.reference_tokens


def test_ar_rewrite_is_clean_and_can_win(setting):
    cfg, gate, _, incumbent, *_ = setting
    res, v = _judge(setting, "ar", fields={"verify": "ar"}, repeats=3)
    assert v.mismatches == 0 and v.reference_equal and not v.flagged
    # The verdict follows the measured times. Which plan is faster is a timing (random drafts are never
    # accepted, so AR usually beats the chain of 4, but one loaded 2-core measurement fell inside the
    # noise margin): the win is checked at a time the evaluator could have measured.
    assert v.accepted == (v.speedup > 1 / (1 - gate.noise_margin)), (v.speedup, v.reasons)
    plan = sp.build_space(cfg).check("ar", {"verify": "ar"})
    quicker = gate.check({**res, "s_per_token": incumbent["s_per_token"] * 0.9}, plan, incumbent)
    assert quicker.accepted and quicker.speedup == pytest.approx(1 / 0.9), quicker.reasons


def test_late_token_change_is_rejected(setting):
    _, v = _judge(setting, "late_token")
    assert not v.accepted and v.mismatches == 1 and not v.reference_equal
    assert any("not forcing-clean" in r for r in v.reasons)


def test_replaying_the_reference_of_another_round_is_rejected(setting):
    _, v = _judge(setting, "reads_reference")
    assert not v.accepted and v.mismatches > 0 and not v.reference_equal


def test_a_faked_clock_is_not_believed(setting):
    res, v = _judge(setting, "fake_clock")
    assert res["self_reported_s"] == [0.0, 0.0]  # what it claims
    assert min(res["wall_s"]) > 0.3  # what the evaluator measured
    assert not v.accepted and any("not faster than the incumbent" in r for r in v.reasons)


def test_beating_the_ceiling_is_rejected_and_flagged(setting, monkeypatch):
    # judged against a device 25x slower than the configured CPU profile: skipping the work leaves only a
    # pipe's round trip, ~1 ms a run on a loaded 2-core machine (above the CPU profile's ceiling of
    # ~0.4 ms a run), and honest work on the CPU (~1 ms/token) stays far above the slower ceiling
    gate = setting[1]
    slow = OmegaConf.create(OmegaConf.to_container(gate.cfg, resolve=True))
    slow.gpu.memory_bandwidth_gbs = gate.cfg.gpu.memory_bandwidth_gbs / 25
    slow.gpu.matmul_tflops_bf16 = gate.cfg.gpu.matmul_tflops_bf16 / 25
    monkeypatch.setattr(gate, "cfg", typed(slow))
    res, v = _judge(setting, "skips_work", repeats=5)
    assert v.mismatches == 0 and v.reference_equal  # its tokens are right...
    assert res["s_per_token"] < v.ceiling_s_per_token  # ...and it is faster than physics allows
    assert not v.accepted and v.flagged and any("ceiling" in r for r in v.reasons)
    honest = gate.check(setting[3], gate.stock, None)  # the incumbent, against the same slower ceiling
    assert honest.accepted and not honest.flagged


def test_a_forcing_run_that_fails_rejects_the_candidate_and_not_the_loop(setting, monkeypatch):
    # the gate's own forcing run ran out of GPU memory beside a warm worker: that candidate is not judged,
    # and the loop goes on to the next
    cfg, gate, _, incumbent, *_ = setting

    def out_of_memory(tokens):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.27GiB\nmore")

    monkeypatch.setattr(gate, "forcing_report", out_of_memory)
    v = gate.check({**incumbent, "s_per_token": incumbent["s_per_token"] * 0.5}, gate.stock, incumbent)
    assert not v.accepted and v.mismatches is None
    assert v.reasons == ["not checked: the forcing run failed (RuntimeError: RESOURCE_EXHAUSTED: Out of memory "
                         "while trying to allocate 2.27GiB); the workers may be pooling the GPU: set "
                         "agent.worker_gpu_fraction"]

    def crash(tokens):
        raise ValueError("a bad scorer")

    monkeypatch.setattr(gate, "forcing_report", crash)
    assert gate.check(incumbent, gate.stock, None).reasons == [
        "not checked: the forcing run failed (ValueError: a bad scorer)"]
