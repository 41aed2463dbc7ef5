"""Cost model: byte counts against hand counts of a public shape, and ceiling arithmetic."""

import pytest

from specpilot.costmodel import roofline
from specpilot.models import dense
from specpilot.models.config import ModelConfig

QWEN3_8B = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                       num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, rope_theta=1e6)


def test_qwen3_8b_weight_bytes_match_hand_count():
    # q,k,v,o: 4096*(4096+1024+1024) + 4096*4096; gate,up,down: 3*4096*12288; LM head 151936*4096
    per_layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 12288
    expected = (36 * per_layer + 151936 * 4096) * 2
    step = roofline.target_step(QWEN3_8B, batch=1, tokens=1, context=512)
    assert step.weight_bytes == pytest.approx(expected, rel=1e-6)
    assert step.weight_bytes / 1e9 == pytest.approx(15.13, abs=0.02)  # DESIGN.md: 15.14 GB a step
    assert step.kv_bytes == 36 * 2 * 512 * 1024 * 2


def test_ar_ceiling_is_bandwidth_bound_at_batch_1():
    hw = roofline.Hardware(memory_bandwidth_gbs=4280.0, matmul_tflops=790.0)
    t = roofline.ar_ceiling_s(hw, QWEN3_8B, batch=1, context=0)
    assert t == pytest.approx(15.13e9 / 4.28e12, rel=2e-3)  # ~3.54 ms, as DESIGN.md states
    # 12-bit weights read 3/4 of the bytes
    t12 = roofline.ar_ceiling_s(hw, QWEN3_8B, batch=1, context=0, bits_per_weight=12)
    assert t12 / t == pytest.approx(0.75, rel=1e-3)


def test_compute_bound_when_flops_dominate():
    hw = roofline.Hardware(memory_bandwidth_gbs=1e6, matmul_tflops=1.0)
    step = roofline.target_step(QWEN3_8B, batch=64, tokens=16, context=128)
    assert hw.floor_s(step.bytes, step.flops) == pytest.approx(step.flops / 1e12)


def test_spec_ceiling_divides_by_tau_and_gaps_sort():
    hw = roofline.Hardware(4280.0, 790.0)
    c = roofline.spec_ceiling_s(hw, QWEN3_8B, 1, 512, block=16, tau=4.0, draft_layers=5, num_taps=5)
    assert c["per_token_s"] == pytest.approx((c["draft_s"] + c["verify_s"]) / 4.0)
    assert c["verify_s"] > roofline.ar_ceiling_s(hw, QWEN3_8B, 1, 512)
    g = roofline.gaps({"draft_s": 2.0, "verify_s": 9.0}, {"draft_s": 1.0, "verify_s": 5.0})
    assert g == [("verify_s", 4.0), ("draft_s", 1.0)]


def test_num_params_counts_every_parameter_of_the_pytree():
    import dataclasses

    import jax
    import numpy as np

    for kw in ({}, dict(attention_bias=True, mlp_bias=True, architecture="LlamaForCausalLM",
                        qk_norm=False, tie_word_embeddings=True)):
        cfg = dataclasses.replace(QWEN3_8B, vocab_size=64, hidden_size=32, intermediate_size=48,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, **kw)
        shapes = jax.tree.leaves(dense.param_shapes(cfg),
                                 is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x))
        assert cfg.num_params() == sum(int(np.prod(s)) for s in shapes)
