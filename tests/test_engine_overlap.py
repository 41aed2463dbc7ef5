"""The engine under batching.overlap=halves (mechanism 3): every request's output equals `ar.generate`'s
under staggered arrivals, stops, cancellations and slot reuse, alone and with the other mechanisms;
the step stats; nothing compiles in steady state; bad values refused; the field flips by config and
is kept by a saved plan's fields."""

import jax.numpy as jnp
import pytest

from experiments.bench import bench_engine
from specpilot.agent import space as sp
from specpilot.decoding import ar, spec
from specpilot.harness.config_schema import ConfigValueError, build_plans, validate
from specpilot.models import drafter as dr
from specpilot.models import hybrid
from specpilot.plan import Batching, Plan, PlanError
from specpilot.serving import Engine, Request
from specpilot.serving.overlap import Overlap
from engine_helpers import BUDGETS, CFG, PROMPTS, TARGET, count_compiles, run_staggered
from test_engine import ARRIVALS, CANCELS, check_outputs, requests_with_stops
from test_engine_mechanisms import block_drafter, params, reference  # noqa: F401 (the same module fixtures)

SLOTS = 4  # two halves of two rows


def halves_engine(params, drafter, dparams, **batching):
    return Engine(TARGET, params, drafter, dparams, slots=SLOTS, context_len=48, prefill_chunk=8,
                  sampling=False, batching=Batching(overlap="halves", **batching))


def check_halves_stats(stats, per_row_tokens):
    """Each decode verifies at most one half and drafts at most the other; every verified row was drafted
    one call before (rows drafted cover rows verified, bar the drafts of rows that left)."""
    assert stats.decode_calls > 0 and stats.rows_verified_per_decode <= SLOTS // 2
    assert stats.rows_drafted_per_decode <= SLOTS // 2
    assert stats.decode_row_steps <= stats.rows_drafted
    assert 0 < stats.both_halves_busy <= stats.decode_calls
    assert stats.forward_tokens == stats.decode_calls * per_row_tokens


@pytest.mark.parametrize("batching", [{}, {"draft_budget": "confidence", "token_budget": 5},
                                      {"draft_budget": "confidence", "verify": "packed", "token_budget": 6}],
                         ids=["fixed", "conf5", "conf6-packed"])
def test_block_drafter_halves_equal_ar_per_request(params, reference, block_drafter, batching):
    drafter, dparams = block_drafter
    engine = halves_engine(params, drafter, dparams, **batching)
    requests = requests_with_stops(reference)
    handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
    check_outputs(handles, requests, reference)
    # under halves the token budget counts the half a step verifies (null: 2 rows x block 4)
    budget = batching.get("token_budget", (SLOTS // 2) * 4)
    assert engine.setup.token_budget == budget
    check_halves_stats(engine.stats, budget if batching.get("verify") == "packed" else (SLOTS // 2) * 4)
    assert engine.stats.verify_tokens <= engine.stats.decode_calls * budget


def test_replay_drafter_halves_accept_blocks_and_reuse_slots(params, reference):
    """A replaying drafter (every draft right): long accepted blocks, and a second wave through the same
    slots after the first left (resets clear the prepared drafts)."""
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4)
    engine = halves_engine(params, drafter, None)
    base = requests_with_stops(reference)
    requests = [Request(r.prompt_ids, r.max_new_tokens, stop_token=r.stop_token,
                        draft_reference=list(r.prompt_ids) + reference[i]) for i, r in enumerate(base)]
    handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
    check_outputs(handles, requests, reference)
    again = run_staggered(engine, requests[::-1], [0, 1, 1, 2, 2, 2, 5, 6])
    check_outputs(again[::-1], requests, reference, cancelled={})
    assert engine.stats.tokens_per_row_step > 3.0
    check_halves_stats(engine.stats, (SLOTS // 2) * 4)


def test_halves_compile_nothing_in_steady_state(params, reference, block_drafter):
    drafter, dparams = block_drafter
    engine = halves_engine(params, drafter, dparams)
    engine.warm_up()
    requests = [Request(p, b) for p, b in zip(PROMPTS, BUDGETS)]
    with count_compiles() as compiles:
        handles = run_staggered(engine, requests, ARRIVALS)
    assert compiles == [], compiles
    assert [h.tokens for h in handles] == [reference[i][:b] for i, b in enumerate(BUDGETS)]


@pytest.mark.slow  # the sampled chain step compiles slowly on a 2-core CPU (two parities)
def test_halves_sampled_requests_equal_single_runs(params, block_drafter):
    from test_engine_sampling import ARRIVALS as S_ARRIVALS, alone, requests as sampled_requests

    drafter, dparams = block_drafter
    engine = Engine(TARGET, params, drafter, dparams, slots=SLOTS, context_len=48, prefill_chunk=8,
                    batching=Batching(overlap="halves"))
    reqs = sampled_requests()
    handles = run_staggered(engine, reqs, S_ARRIVALS)
    want = [alone(lambda *a, **k: spec.generate(TARGET, params, drafter, dparams, *a, block_size=4, **k), r)
            for r in reqs]
    assert [h.tokens for h in handles] == want


def test_overlap_host_side_refuses_a_row_without_a_prepared_draft():
    ov = Overlap(4)
    parity, verify, draft = ov.plan_call(decoding=[], drafting=[2, 3])  # call 0: verify 0-1, draft 2-3
    assert parity == 0 and not verify.any() and draft.tolist() == [False, False, True, True]
    ov.called(verify, draft)
    parity, verify, draft = ov.plan_call(decoding=[2, 3], drafting=[2, 3])  # call 1 verifies what call 0 drafted
    assert parity == 1 and verify.tolist() == [False, False, True, True] and not draft.any()
    ov.called(verify, draft)
    ov.reset(verify)
    with pytest.raises(RuntimeError, match=r"slot\(s\) \[0\] would verify without a prepared draft"):
        ov.plan_call(decoding=[0], drafting=[0])


def test_bad_overlap_values_are_refused(params, block_drafter):
    drafter, dparams = block_drafter
    with pytest.raises(PlanError, match=r"batching\.overlap.*'thirds' is not one of \('none', 'halves'\)"):
        Plan(name="stock", verify="chain", block_size=4, batching=Batching(overlap="thirds"))
    with pytest.raises(PlanError, match=r"batching\.overlap.*needs a chain plan"):
        Plan(name="ar", verify="ar", batching=Batching(overlap="halves"))
    with pytest.raises(ValueError, match=r"batching\.overlap: 'thirds' is not one of"):
        Engine(TARGET, params, drafter, dparams, slots=4, batching=Batching(overlap="thirds"))
    with pytest.raises(ValueError, match=r"batching\.overlap: 'halves' needs a drafter"):
        Engine(TARGET, params, slots=4, batching=Batching(overlap="halves"))
    with pytest.raises(ValueError, match=r"two equal halves, got 3 slots"):
        Engine(TARGET, params, drafter, dparams, slots=3, batching=Batching(overlap="halves"))
    with pytest.raises(ValueError, match=r"batching\.token_budget: 6 is less than the 2 slots x block 4"):
        Engine(TARGET, params, drafter, dparams, slots=4, batching=Batching(overlap="halves", token_budget=6))


def test_overlap_flips_by_config_and_a_saved_plan_keeps_it():
    from agent_helpers import toy_cfg

    cfg = toy_cfg("decoding.plans.stock.batching.overlap=halves")
    validate(cfg)
    plans = {p.name: p for p in build_plans(cfg)}
    assert plans["stock"].batching == Batching(overlap="halves")
    assert plans["ar"].batching == Batching()
    with pytest.raises(ConfigValueError, match=r"decoding\.plans\.stock\.batching\.overlap: 'quarters'"):
        validate(toy_cfg("decoding.plans.stock.batching.overlap=quarters"))
    space = sp.build_space(toy_cfg())
    # not a choice of the loop's space (its candidates are timed by the run harness, not the engine), but a
    # plan field a saved plan keeps and rebuilds
    assert space.choice("batching.overlap") is None
    fields = sp.plan_fields(plans["stock"])
    assert fields["batching"]["overlap"] == "halves" and space.check("stock", fields) == plans["stock"]



def test_bench_engine_smoke_compares_overlaps(tmp_path):
    """experiments/bench/bench_engine.py --overlap none,halves on the tiny pair: a row per overlap, with the
    halves row verifying and drafting at most one half (one of the 2 slots) per decode step."""
    record = bench_engine.main(["--smoke", "--plans", "stock", "--overlap", "none,halves",
                           "--out", str(tmp_path / "engine.json")])
    rows = {r["overlap"]: r for r in record["rows"]}
    assert set(rows) == {"none", "halves"}
    for r in rows.values():
        assert r["output_tokens"] > r["requests"] and r["throughput_tok_s"] > 0
    assert rows["halves"]["rows_verified_per_decode"] <= 1 and rows["halves"]["rows_drafted_per_decode"] <= 1
    block = record["block"]  # padded verification: one block per verified row
    assert rows["halves"]["forward_tokens_per_decode"] == rows["halves"]["slots"] // 2 * block
    # overlap none verifies the decoding rows (on the CPU compact decodes compute only those), at most every slot
    assert block <= rows["none"]["forward_tokens_per_decode"] <= rows["none"]["slots"] * block
    assert rows["none"]["both_halves_busy_fraction"] == 0


@pytest.mark.slow  # ~30 s on 2 CPU cores (hybrid compiles)
def test_hybrid_target_halves_equal_ar():
    """Recurrent state rows slice into halves like attention rows: a hybrid target under halves, every
    slot reset and reused, outputs equal `ar.generate`'s."""
    from test_engine_hybrid import ARRIVALS as H_ARRIVALS, BUDGETS as H_BUDGETS
    from test_hybrid_spec import CFG as HCFG, hybrid_params

    target = hybrid.target(HCFG, jnp.float32, max_block_size=8)
    hparams = hybrid_params(HCFG, 0)
    want = [row.tolist() for row in ar.generate(target, hparams, PROMPTS[:6], 20).tokens]
    drafter = dr.ReplayDrafter(HCFG.vocab_size, 4, shift=1, wrong_every=3)
    engine = Engine(target, hparams, drafter, None, slots=2, context_len=40, prefill_chunk=5, sampling=False,
                    batching=Batching(overlap="halves"))
    requests = [Request(p, b, draft_reference=list(p) + want[i]) for i, (p, b) in enumerate(zip(PROMPTS[:6], H_BUDGETS))]
    handles = run_staggered(engine, requests, H_ARRIVALS)
    assert [h.tokens for h in handles] == [want[i][:b] for i, b in enumerate(H_BUDGETS)]
    assert engine.stats.tokens_per_row_step > 1.5 and engine.stats.rows_verified_per_decode <= 1
