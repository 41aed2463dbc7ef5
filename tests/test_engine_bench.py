"""experiments/bench/bench_engine.py: the Poisson workload and fixed batches on the tiny random pair; a deployment
composed from run.py's config groups (tiny random target, oracle drafter at a tau), whose oracle stock plan
(and a tree plan of decoding=tree) emits AR's tokens per request through the engine; speedups against AR of
the same run; clear errors."""

import dataclasses
import re

import pytest

from experiments.bench import bench_engine, engine_report, engine_setup
from specpilot.plan import Batching
from specpilot.serving import Request
from specpilot.serving.budget import StepCost
from specpilot.serving.workloads import run_fixed, slo_goodput

# run.py's groups at a tiny shape: an oracle drafter (1 layer, block 4) replaying AR's continuation at tau 3
DEPLOYMENT = ("target=tiny_random drafter=oracle drafter.tau=3 drafter.block_size=4 drafter.num_layers=1 "
              "decoding=stock bench=default bench.prompt_len=12")


@pytest.fixture(scope="module")
def deployment_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "engine.json"
    record = bench_engine.main(["--deployment", DEPLOYMENT, "--m", "2", "--rates", "0,200", "--requests", "4",
                      "--new-tokens", "12", "--chunk", "16", "--batching", "fixed,budget+packed", "--out", str(out)])
    return record, out


def test_bench_engine_smoke(tmp_path):
    out = tmp_path / "engine.json"
    record = bench_engine.main(["--smoke", "--out", str(out), "--tpot-slo-ms", "1e6"])
    assert out.is_file() and {r["plan"] for r in record["rows"]} == {"ar", "stock"}
    assert {r["rate"] for r in record["rows"]} == {0.0, 200.0}
    for r in record["rows"]:
        assert r["mismatched_requests"] == 0  # the random drafter's stock emits AR's tokens
        if r["rate"] == 0:
            continue
        assert r["output_tokens"] > r["requests"]  # every request emits at least one token, most more
        assert r["throughput_tok_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["tpot_p50_s"] <= r["tpot_p99_s"] and 1 <= r["slots_in_use_max"] <= r["slots"]
        assert 0 < r["kv_tokens_max"] <= r["kv_tokens_capacity"]
        # an SLO every request meets: the goodput is the throughput
        assert r["slo_met_fraction"] == 1.0 and r["goodput_tok_s"] == pytest.approx(r["throughput_tok_s"])


def test_goodput_counts_only_the_requests_that_met_the_slo():
    got = slo_goodput([0.01, 0.05, None, 0.02], [10, 20, 1, 30], span_s=2.0, tpot_slo_s=0.02)
    assert got == {"tpot_slo_s": 0.02, "slo_met_fraction": 0.75, "goodput_tok_s": (10 + 1 + 30) / 2.0}


def test_deployment_rows_oracle_acceptance_and_batchings(deployment_record):
    record, out = deployment_record
    assert out.is_file() and any("oracle acceptance" in n for n in record["notes"])
    rows = record["rows"]
    assert [(r["plan"], r["batching"], r["rate"]) for r in rows] == [
        ("ar", "fixed", 0.0), ("ar", "fixed", 200.0), ("ar_lockstep", "lockstep", 0.0),
        ("stock", "fixed", 0.0), ("stock", "fixed", 200.0),
        ("stock", "budget+packed", 0.0), ("stock", "budget+packed", 200.0)]
    for r in rows:
        assert r["mismatched_requests"] == 0, r  # oracle acceptance changes no output token
        if r["plan"] == "stock":
            assert r["tokens_per_row_step"] > 1.5, r  # the oracle's drafts are accepted through the engine
    packed = [r for r in rows if r["batching"] == "budget+packed"]
    assert all(r["token_budget"] == 4 for r in packed)  # batching_for's default: 2 slots x block 4 / 2
    assert all(r["forward_tokens_per_decode"] == 4 for r in packed)  # only the packed budget is verified


def test_fixed_rows_and_speedup_against_ar_of_the_same_run(deployment_record):
    rows = [r for r in deployment_record[0]["rows"] if r["rate"] == 0]
    ar = next(r for r in rows if r["plan"] == "ar")
    lockstep = next(r for r in rows if r["plan"] == "ar_lockstep")  # the harness's loop on the same batch
    best = max((ar, lockstep), key=lambda r: r["decode_tok_s"])
    for r in rows:
        assert r["requests"] == r["slots"] == 2 and r["output_tokens"] == 2 * 12  # one full request per slot
        assert r["decode_steps"] >= 1 and r["decode_s"] > 0 and r["mismatched_requests"] == 0
        assert r["decode_tok_s"] == pytest.approx(r["tokens_per_step"] * r["decode_steps"] / r["decode_s"])
        assert r["step_ms"] == pytest.approx(1e3 * r["decode_s"] / r["decode_steps"])
        assert r["baseline"] == best["plan"]  # the faster AR baseline of the same run
        assert r["speedup"] == pytest.approx(r["decode_tok_s"] / best["decode_tok_s"])
        if r is not lockstep:
            assert r["device_step_ms"] > 0  # --device-calls' default: decode calls timed back to back
            assert r["host_step_ms"] == pytest.approx(r["step_ms"] - r["device_step_ms"])
    for r in (ar, lockstep):
        assert r["ar_baseline"] and r["tokens_per_step"] == 2.0  # AR: one token per slot per step
        assert r["decode_steps"] == 11  # tokens 2..12 of both rows; the first comes from the prefill step


def test_oracle_stock_tokens_equal_ar_per_request():
    """The lossless check itself, outside the bench's own counting: each request's tokens from the oracle
    stock plan through the engine equal the AR plan's through the engine."""
    args, _ = bench_engine.parse_args(["--deployment", DEPLOYMENT, "--m", "3", "--rates", "0", "--new-tokens", "10"])
    setup = bench_engine.build_setup(args)
    ar, stock = setup.plans
    assert setup.reference is ar and stock.replays and not ar.replays
    requests = [Request(p, 10) for p in setup.prompts[:3]]
    _, ar_handles = run_fixed(ar.make(3, None, setup.context, 8), requests)
    want = [h.tokens for h in ar_handles]
    engine = stock.make(3, None, setup.context, 8)
    _, handles = run_fixed(engine, engine_setup.with_reference(requests, want))
    assert [h.tokens for h in handles] == want and all(len(t) == 10 for t in want)
    assert engine.stats.tokens_per_row_step > 1.5
    # timing the device's share mid-run (decode calls that commit nothing) leaves every request's tokens alone
    handles = [engine.submit(r) for r in engine_setup.with_reference(requests, want)]
    for _ in range(3):
        engine.step()
    lengths = engine.state.target_state.lengths.tolist()
    assert engine.device_step_ms(2) > 0 and engine.state.target_state.lengths.tolist() == lengths
    engine.run()
    assert [h.tokens for h in handles] == want


def test_step_cost_model_prices_the_confidence_budget():
    """--step-cost model: a packed confidence budget's engine gets the cost model's step time of a token
    count (a per-token slope > 0 on the CPU's rates); padded budgets, fixed drafts and AR keep it flat."""
    args, _ = bench_engine.parse_args(["--deployment", DEPLOYMENT, "--m", "2", "--rates", "0", "--step-cost", "model"])
    setup = bench_engine.build_setup(args)
    ar, stock = setup.plans
    packed = engine_setup.batching_for("budget+packed", 2, stock.block, 0)
    cost = stock.make(2, packed, setup.context, 8).setup.cost
    assert cost != StepCost() and cost.per_token_s > 0 and cost.fixed_s > 0
    # padded verification computes the whole block whatever a row keeps: flat, as fixed drafts and AR
    assert stock.make(2, engine_setup.batching_for("budget", 2, stock.block, 0), setup.context, 8).setup.cost == StepCost()
    assert stock.make(2, None, setup.context, 8).setup.cost == StepCost()
    assert ar.make(2, None, setup.context, 8).setup.cost == StepCost()


def test_add_speedups_takes_the_fastest_ar_baseline_per_slot_count():
    def row(plan, slots, tok_s, baseline=False):
        return {"plan": plan, "slots": slots, "rate": 0.0, "decode_tok_s": tok_s, "ar_baseline": baseline}

    rows = [row("ar", 4, 100.0, True), row("ar_mosaic", 4, 125.0, True), row("stock", 4, 250.0),
            row("ar", 8, 160.0, True), row("stock", 8, 240.0), row("ar_w12", 8, 200.0)]
    engine_report.add_speedups(rows)
    assert [(r["baseline"], r["speedup"]) for r in rows] == [
        ("ar_mosaic", 0.8), ("ar_mosaic", 1.0), ("ar_mosaic", 2.0), ("ar", 1.0), ("ar", 1.5), ("ar", 1.25)]


def test_batchings_apply_to_speculative_plans_only():
    args, _ = bench_engine.parse_args(["--shape", "tiny", "--batching", "fixed,budget", "--overlap", "none,halves"])
    ar = engine_setup.PlanRun("ar", None, ar_baseline=True)
    stock = engine_setup.PlanRun("stock", None, block=4, batching=Batching(policy="static"))
    setup = engine_setup.Setup("test", [ar, stock], [[1]], [], 64, has_own_batching=True)
    assert engine_setup.batchings(setup, ar, args, 4) == [None]
    got = engine_setup.batchings(setup, stock, args, 4)
    assert [engine_setup.batching_label(b) for b in got] == ["fixed/static", "fixed+halves/static", "budget/static",
                                                   "budget+halves/static"]
    assert [b.token_budget for b in got] == [None, None, 8, 4]  # halves: half the slots verify per step
    args, _ = bench_engine.parse_args(["--shape", "tiny"])  # no --batching / --overlap: the plan's own
    assert engine_setup.batchings(setup, stock, args, 4) == [stock.batching]


@pytest.mark.parametrize("argv,message", [
    (["--plans", "ar,stock_w12"], r"--plans: stock_w12 not a plan of this config \(decoding=stock: ar, stock\)"),
    (["--m", "3", "--overlap", "halves"], r"--m 3 with --overlap halves"),
    (["--block", "8"], r"--block belongs to --shape"),
    (["--rates", "0", "--new-tokens", "1"], r"--new-tokens must be >= 2"),
    (["--tpot-slo-ms", "-5"], r"--tpot-slo-ms takes a time per output token"),
    (["--deployment", "", "--shape", "tiny", "--step-cost", "model"], r"--step-cost model prices a --deployment"),
])
def test_bad_arguments_exit_naming_them(capsys, argv, message):
    with pytest.raises(SystemExit):
        bench_engine.main(["--deployment", DEPLOYMENT, *argv])
    assert re.search(message, capsys.readouterr().err)


def test_bad_deployments_exit_naming_them(capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--deployment", "target=nope"])
    assert "Could not find 'target/nope'" in capsys.readouterr().err


def test_a_step_trace_deployment_runs_through_the_engine():
    """drafter=oracle_trace (the DDTree-calibrated file): its chain and tree plans replay their traces per
    slot through the engine, every request AR's tokens."""
    deployment = ("target=tiny_random drafter=oracle_trace drafter.num_layers=1 "
                  "drafter.step_trace=docs/results/trace_ddtree_calibrated.json decoding=oracle_tree_ddtree "
                  "bench=default")
    record = bench_engine.main(["--deployment", deployment, "--plans", "oracle_chain,oracle_tree_n32", "--m", "2",
                                "--rates", "0", "--new-tokens", "24", "--chunk", "16", "--lockstep-ar", "off"])
    rows = record["rows"]
    assert [r["plan"] for r in rows] == ["ar", "oracle_chain", "oracle_tree_n32"]
    assert all(r["mismatched_requests"] == 0 for r in rows), rows
    assert all(r["tokens_per_row_step"] > 2 for r in rows[1:]), rows  # the traces' depths: tau 7.8-9.0


TREE_DEPLOYMENT = DEPLOYMENT.replace("drafter.block_size=4", "drafter.block_size=16").replace(
    "decoding=stock", "decoding=tree")


def test_tree_plans_of_a_deployment_run_through_the_engine():
    """--plans names a tree plan of decoding=tree: built by Engine.from_plan, AR's tokens per request."""
    record = bench_engine.main(["--deployment", TREE_DEPLOYMENT, "--plans", "tree_n16", "--m", "2", "--rates", "0",
                      "--new-tokens", "12", "--chunk", "16", "--lockstep-ar", "off"])
    rows = record["rows"]
    assert [(r["plan"], r["batching"]) for r in rows] == [("ar", "fixed"), ("tree_n16", "fixed")]
    assert all(r["mismatched_requests"] == 0 for r in rows), rows
    assert rows[1]["tokens_per_row_step"] > 1.5 and rows[1]["forward_tokens_per_decode"] == 2 * 16


def test_tree_plans_refuse_chain_only_batchings(capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--deployment", TREE_DEPLOYMENT, "--plans", "tree_n16", "--batching", "budget"])
    assert re.search(r"--plans tree_n16 is a tree plan: --batching budget is chain-only", capsys.readouterr().err)


def test_context_reserves_positions_per_slot_and_refuses_too_few(capsys):
    record = bench_engine.main(["--smoke", "--context", "256", "--kv", "contiguous,paged"])
    assert record["context"] == 256 and not record["not_fitting"]
    rows = {r["kv"]: r for r in record["rows"] if r["plan"] == "stock" and r["rate"] == 0}
    short = bench_engine.main(["--smoke", "--plans", "stock", "--kv", "contiguous"])
    assert short["context"] == 64  # the default: the longest prompt plus the new tokens, rounded up to 64
    [row64] = [r for r in short["rows"] if r["plan"] == "stock" and r["rate"] == 0]
    # contiguous K/V reserves every position of the context per slot; paged holds what the rows use
    # (the cache also holds a verification block past the context)
    per_position = (rows["contiguous"]["kv_bytes_per_slot"] - row64["kv_bytes_per_slot"]) / (256 - 64)
    assert per_position > 0 and 64 <= row64["kv_bytes_per_slot"] / per_position <= 64 + 16
    assert rows["paged"]["kv_bytes_per_slot"] <= row64["kv_bytes_per_slot"] < rows["contiguous"]["kv_bytes_per_slot"]
    assert all(r["mismatched_requests"] == 0 for r in record["rows"])
    with pytest.raises(SystemExit):
        bench_engine.main(["--smoke", "--context", "8"])
    assert "--context 8 is shorter than the longest prompt" in capsys.readouterr().err


def test_an_engine_out_of_device_memory_is_a_row_not_a_crash(monkeypatch):
    real = bench_engine.build_setup

    def build_setup(args, ap=None):
        setup = real(args, ap)
        stock = next(p for p in setup.plans if p.name == "stock")

        def make(*a):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 77.3GiB.")
        setup.plans[setup.plans.index(stock)] = dataclasses.replace(stock, make=make)
        return setup
    monkeypatch.setattr(bench_engine, "build_setup", build_setup)
    record = bench_engine.main(["--smoke"])
    assert {r["plan"] for r in record["rows"]} == {"ar"}  # AR ran; stock's engine did not fit
    [miss] = record["not_fitting"]
    assert miss["plan"] == "stock" and miss["slots"] == 2 and "RESOURCE_EXHAUSTED" in miss["error"]
    assert bench_engine.out_of_memory(RuntimeError("XlaRuntimeError: RESOURCE_EXHAUSTED: ..."))
    assert not bench_engine.out_of_memory(ValueError("a shape mismatch"))


def test_an_engine_out_of_device_memory_mid_run_is_a_row_not_a_crash(monkeypatch):
    """As at build: an engine that runs out of memory while running a workload (a prefill's temporaries) is
    listed under not_fitting with the workload, and the other plans still run."""
    real = bench_engine.run_fixed

    def run_fixed(engine, requests, calls):
        if engine.setup.uses_drafter:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 7.49GiB.")
        return real(engine, requests, calls)
    monkeypatch.setattr(bench_engine, "run_fixed", run_fixed)
    record = bench_engine.main(["--smoke"])
    assert {r["plan"] for r in record["rows"]} == {"ar"}
    [miss] = record["not_fitting"]
    assert miss["plan"] == "stock" and miss["workload"] == "fixed" and "7.49GiB" in miss["error"]
