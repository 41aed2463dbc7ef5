"""Candidates timed through the serving engine (`agent.workload=engine`): the plans' batching fields join the
rewrite space, and an engine candidate's tokens go through the same gate (forcing against stock, equality with
the AR reference) as the run harness's."""

import numpy as np
import pytest
from agent_helpers import spec, toy_cfg

from specpilot.agent import evaluator as ev
from specpilot.agent import space as sp
from specpilot.agent.gate import Gate
from specpilot.agent.loop import Loop, agent_conf
from specpilot.plan import Batching

STOCK = {"verify": "chain", "block_size": 8}
BATCHING_FIELDS = {"batching.policy", "batching.draft_budget", "batching.token_budget", "batching.verify", "batching.streams",
                   "batching.pricing",
                   "batching.overlap", "batching.dispatch", "batching.kv", "batching.page_size"}


def test_batching_fields_are_choices_only_when_the_engine_times_candidates():
    cfg = toy_cfg("bench.batch_size=2")
    assert not [c for c in sp.build_space(cfg).choices if c.field.startswith("batching.")]
    engine = sp.build_space(cfg, workload="engine")
    assert BATCHING_FIELDS <= {c.field for c in engine.choices}
    budget = engine.choice("batching.token_budget")
    assert budget.values == (4, 8, 12)  # 2 slots x block 8 = 16 tokens a padded step verifies: 1/4, 1/2, 3/4
    assert not budget.applies(STOCK)  # a token budget means something under the confidence budget only
    assert budget.applies({**STOCK, "batching": {"draft_budget": "confidence"}})
    assert not engine.choice("batching.verify").applies({"verify": "ar"})  # chain plans only
    # the incumbent's batching defaults are its current values: a rewrite never sets one to itself; the
    # confidence budget comes with the middle token budget (without one every row keeps its whole block)
    assert sp.single_field_rewrites(engine, STOCK, engine.choice("batching.draft_budget")) == [
        {"batching.draft_budget": "confidence", "batching.token_budget": 8}]
    assert sp.single_field_rewrites(engine, STOCK, engine.choice("batching.overlap")) == [
        {"batching.overlap": "halves"}]
    fields, plan = engine.rewrite("c", STOCK, {"batching.kv": "paged"})
    assert plan.batching == Batching(kv="paged") and fields["batching"]["kv"] == "paged"
    pages = engine.choice("batching.page_size")
    assert pages.values == (16, 32, 64) and not pages.applies(STOCK) and pages.applies(fields)
    fields, plan = engine.rewrite("c", fields, {"batching.page_size": 32})
    assert plan.batching == Batching(kv="paged", page_size=32)
    fields, plan = engine.rewrite("c", STOCK, {"batching.draft_budget": "confidence", "batching.token_budget": 8,
                                               "batching.verify": "packed"})
    assert plan.batching == Batching(draft_budget="confidence", verify="packed", token_budget=8)
    assert fields["batching"]["verify"] == "packed"  # the found plan's YAML carries it
    with pytest.raises(ValueError, match="agent.workload: 'server'"):
        sp.build_space(cfg, workload="server")


def test_hybrid_targets_are_offered_padded_verification_only():
    cfg = toy_cfg("target=tiny_hybrid", "bench.batch_size=2")
    assert sp.build_space(cfg, workload="engine").choice("batching.verify").values == ("padded",)


def test_the_loop_sends_its_workload_to_candidates_and_keys_memory_by_it(tmp_path):
    cfg = toy_cfg("bench.batch_size=2", cache_dir=str(tmp_path / "cache"))
    agent = agent_conf({"workload": "engine", "prefill_chunk": 16,
                        "memory_url": f"sqlite:///{tmp_path / 'memory.db'}"})
    loop = Loop(cfg, agent, tmp_path / "out", progress=lambda m: None)
    assert BATCHING_FIELDS <= {c.field for c in loop.space.choices}
    s = loop.spec("c", STOCK, [[1, 2, 3]])
    assert (s["workload"], s["prefill_chunk"]) == ("engine", 16)
    assert loop.features["workload"] == "engine"
    harness = Loop(cfg, agent_conf({"memory_url": f"sqlite:///{tmp_path / 'memory.db'}"}), tmp_path / "out2",
                   progress=lambda m: None)
    assert "workload" not in harness.features and harness.key != loop.key
    with pytest.raises(ValueError, match="agent.workload"):
        agent_conf({"workload": "server"})
    with pytest.raises(ValueError, match="agent.prefill_chunk"):
        agent_conf({"workload": "engine", "prefill_chunk": 0})


@pytest.fixture(scope="module")
def oracle_round(tmp_path_factory):
    """A toy deployment with an oracle drafter (tau 3 at block 4), 2 slots and a round of 4 prompts (two
    waves: continuous admission refills slots), its gate and the round's prompts."""
    tmp = tmp_path_factory.mktemp("engine_workload")
    cfg = toy_cfg("drafter=oracle", "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=3.0",
                  "bench.batch_size=2", cache_dir=str(tmp / "cache"))
    gate = Gate(cfg, heldout=8, prompts_per_round=4, secret=7)
    return cfg, gate, gate.draw(0), tmp


@pytest.mark.parametrize("batching", [
    {},  # stock through the engine
    {"draft_budget": "confidence", "token_budget": 4, "verify": "packed"},  # mechanisms 1 + 2
    {"overlap": "halves", "dispatch": "sync", "policy": "static"},  # mechanism 3, other dispatch and policy
], ids=["padded", "budget_packed", "halves_sync_static"])
def test_an_engine_candidate_passes_the_gate_with_the_engines_own_tokens(oracle_round, batching):
    cfg, gate, prompts, tmp = oracle_round
    fields = {"verify": "chain", "block_size": 4, **({"batching": batching} if batching else {})}
    res = ev.evaluate_candidate({**spec(cfg, "engine", fields, prompts), "workload": "engine", "prefill_chunk": 8},
                                timeout_s=240, memory_mb=None, workdir=str(tmp / "work"))
    assert res["status"] == ev.OK, res["reason"]
    stats = res["stats"]
    assert stats["workload"] == "engine" and stats["tau"] > 1.5  # the oracle's drafts were accepted
    # the engine ran the plan's batching: a packed budget computes fewer tokens than 2 slots x block 4
    computed = stats["forward_tokens_per_decode"]
    assert computed <= 4 if batching.get("verify") == "packed" else computed >= 4
    plan = sp.build_space(cfg, workload="engine").check("engine", fields)
    v = gate.check(res, plan, None)
    assert v.accepted and v.mismatches == 0 and v.reference_equal, v.reasons
    assert np.asarray(res["tokens"][0]).tolist() == gate.reference_tokens


def test_a_batching_the_engine_cannot_run_loses_that_candidate_only(oracle_round):
    cfg, gate, prompts, tmp = oracle_round
    fields = {"verify": "chain", "block_size": 4, "batching": {"overlap": "halves"}}
    odd = toy_cfg("drafter=oracle", "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=3.0",
                  "bench.batch_size=1", cache_dir=str(tmp / "cache"))  # one slot cannot split into halves
    res = ev.evaluate_candidate({**spec(odd, "halves1", fields, prompts[:1]), "workload": "engine"},
                                timeout_s=240, memory_mb=None, workdir=str(tmp / "work"))
    assert res["status"] == ev.CRASHED and "halves" in res["reason"]
