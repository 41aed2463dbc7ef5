"""Prediction and attribution arithmetic on a tiny shape with hand-made rates."""

import dataclasses

import pytest

from specpilot.costmodel.roofline import Hardware
from specpilot.costmodel.counts import Shape, step_counts
from specpilot.costmodel.prediction import Measurement, Setting, attribute, kernel_seconds, predict
from specpilot.costmodel.rates import MatmulTable, Rates
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig
from specpilot.plan import Plan

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, qk_norm=True, tap_layers=(0, 2))
SHAPE = Shape(CFG, dr.DrafterConfig.for_target(CFG, num_layers=2, block_size=4), batch=2, context=20, cache_len=64,
              dtype_bytes=2)
RATES = Rates("test", copy_gbs=10.0, launch_us=2.0, host_step_us=5.0, dispatch_us=7.0, matmul_tflops=1.0)
SETTING = Setting(SHAPE, RATES, Hardware(100.0, 10.0))
STOCK = Plan("stock", verify="chain", block_size=4)
AR = Plan("ar", verify="ar", block_size=1)


def test_a_kernel_without_a_table_costs_launches_plus_its_roofline():
    for k in step_counts(STOCK, SHAPE).kernels:
        t, how = kernel_seconds(k, RATES)
        flops = k.flops if k.dot else 0.0
        roof = max(k.bytes / 10e9, flops / 1e12)
        per_launch = roof / k.count if how == "roofline" else roof
        expected = k.count * (2e-6 + per_launch) if how == "roofline" else k.count * 2e-6 + roof
        assert t == pytest.approx(expected)


def test_matmul_tables_are_used_per_launch():
    table = MatmulTable("xla/bf16", (1, 8), ((32, 96),), ((1e-5, 3e-5),))
    rates = Rates("t", 10.0, 2.0, 5.0, 7.0, 1.0, {"xla/bf16": table})
    k = [k for k in step_counts(STOCK, SHAPE).kernels if k.name == "target.lm_head"][0]
    assert (k.m, k.k, k.n) == (8, 32, 96)
    assert kernel_seconds(k, rates) == (pytest.approx(3e-5), "table")


def test_prediction_sums_stages_and_divides_by_tau():
    p = predict(STOCK, SETTING, tau=2.5)
    assert set(p.stages) == {"draft", "verify", "accept"}
    assert p.per_token_s == pytest.approx(sum(p.stages.values()) / 2.5)
    assert p.classes["accept"]["host"] == pytest.approx(5e-6)
    for st in p.stages:
        assert p.stages[st] == pytest.approx(sum(p.classes[st].values()))
        assert p.floors[st] <= p.stages[st]
    ar = predict(AR, SETTING)
    assert ar.tau == 1.0 and set(ar.stages) == {"verify", "accept"}
    with pytest.raises(ValueError, match="tau must be in"):
        predict(STOCK, SETTING, tau=5.0)


def test_attribution_splits_the_measured_step_and_sorts_by_lost_time():
    m = Measurement(per_token_s=1e-3, tau=2.0, split={"draft": 0.25, "verify": 0.5, "bookkeeping": 0.25})
    att = attribute(STOCK, SETTING, m)
    assert att["measured_ms_per_step"] == pytest.approx(2.0)
    by = {r["stage"]: r for r in att["stages"]}
    assert by["accept"]["measured_ms"] == pytest.approx(0.5) and by["verify"]["measured_ms"] == pytest.approx(1.0)
    lost = [r["lost_ms"] for r in att["stages"]]
    assert lost == sorted(lost, reverse=True)
    assert [r["lost_ms"] for r in att["classes"]] == sorted((r["lost_ms"] for r in att["classes"]), reverse=True)
    assert att["error"] == pytest.approx(att["predicted_ms_per_step"] / 2.0 - 1)


def test_a_reduced_draft_vocabulary_counts_its_rows_and_the_fill():
    """The drafter's head reads K rows instead of the vocabulary's, and its scores are put into full-size
    logits (one float32 pass); the target's head is unchanged."""
    big = dataclasses.replace(CFG, vocab_size=4096)
    shape = Shape(big, dr.DrafterConfig.for_target(big, num_layers=2, block_size=4), batch=2, context=20,
                  cache_len=64, dtype_bytes=2)
    full = {k.name: k for k in step_counts(STOCK, shape).kernels}
    cut = {k.name: k for k in step_counts(STOCK, dataclasses.replace(shape, draft_vocab=256)).kernels}
    assert "drafter.lm_head" in full and "drafter.lm_head" not in cut
    head = cut["drafter.draft_head"]
    assert (head.m, head.k, head.n) == (2 * 3, 32, 256) and head.weight_bytes == 256 * 32 * 2
    assert cut["drafter.draft_vocab_fill"].bytes == 2 * 3 * 4096 * 4
    assert cut["target.lm_head"] == full["target.lm_head"]
    assert predict(STOCK, dataclasses.replace(SETTING, shape=dataclasses.replace(shape, draft_vocab=256)),
                   1.0).stages["draft"] < predict(STOCK, dataclasses.replace(SETTING, shape=shape), 1.0).stages["draft"]
