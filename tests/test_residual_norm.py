"""The fused residual add and RMSNorm (`pallas_kernels.residual_norm`), interpreted on the CPU: the kernel
against its reference, the reference against the model's own add and `rms_norm`, the dense model with the
plan's `kernels.residual_norm` naming the kernel against the default forward, and the plan field.

Tolerance: none. The kernel rounds each step as the reference does (the add in the stream's dtype, the
mean of squares and rsqrt in float32 over the same row, the normalised row rounded before the weight
multiplies it), and interpreted on the CPU it reduces each row as XLA does, so every comparison here is
bit for bit. On a GPU the row sum may add in another order (an ulp of the normalised value).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from pallas_kernels import dispatch
from pallas_kernels import residual_norm as rn
from specpilot import plan as plan_mod
from specpilot.harness import config_schema
from specpilot.harness.config_schema import build_plans, typed, validate
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from specpilot.models.layers import rms_norm
from tests.test_configs import CONF

EPS = 1e-6
INTERPRET = rn.ResidualNormConfig(block_rows=4, interpret=True)
FUSED = dispatch.choice("residual_norm", ["triton", "xla"], {"interpret": True})
CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=32, qk_norm=True, tap_layers=(0, 1))


def _inputs(shape, dtype=jnp.bfloat16, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = (3 * jax.random.normal(k[0], shape, jnp.float32)).astype(dtype)
    r = jax.random.normal(k[1], shape, jnp.float32).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(k[2], shape[-1:], jnp.float32)).astype(dtype)
    return x, r, w


def _equal(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# ---- the kernel --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype", [((2, 4, 64), jnp.bfloat16), ((3, 5, 128), jnp.bfloat16),
                                          ((7, 256), jnp.float32)])
def test_kernel_matches_reference_bit_for_bit(shape, dtype):
    # 15 and 7 rows: no power of two divides them past 1, so the launch takes one row per program
    x, r, w = _inputs(shape, dtype)
    _equal(rn.residual_norm(x, r, w, EPS, INTERPRET), rn.residual_norm_reference(x, r, w, EPS))


def test_reference_is_the_models_add_and_norm():
    x, r, w = _inputs((2, 3, 64))
    h = x + r
    _equal(rn.residual_norm_reference(x, r, w, EPS), (h, rms_norm(h, w, EPS)))


def test_kernel_refusals_fall_through_to_the_reference():
    x, r, w = _inputs((2, 48))  # width 48: not a power of two
    with pytest.raises(NotImplementedError, match="power-of-two"):
        rn.residual_norm(x, r, w, EPS, INTERPRET)
    _equal(dispatch.residual_norm(x, r, w, EPS, choice=FUSED), rn.residual_norm_reference(x, r, w, EPS))
    x, r, w = _inputs((2, 64))
    with pytest.raises(NotImplementedError, match="weight"):
        rn.residual_norm(x, r, w.astype(jnp.float32), EPS, INTERPRET)
    if jax.default_backend() != "gpu":
        with pytest.raises(NotImplementedError, match="runs on GPUs"):
            rn.residual_norm(x, r, w, EPS, rn.ResidualNormConfig())
    with pytest.raises(ValueError, match="must match"):
        rn.residual_norm(x, r[:1], w, EPS, INTERPRET)


def test_config_checks_powers_of_two():
    with pytest.raises(ValueError, match="block_rows must be a power of two"):
        rn.ResidualNormConfig(block_rows=3)


# ---- the dense model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def params():
    return dense.fuse_projections(dense.init_wide_margin(jax.random.PRNGKey(0), CFG))


def _forward(params, cfg, exit_layer=None):
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, CFG.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((8, 32), bool)), (2, 8, 32))
    state = dense.init_state(cfg, 2, 32, jnp.bfloat16)
    return dense.forward(params, cfg, tokens, positions, state, mask, exit_layer=exit_layer)


@pytest.mark.parametrize("exit_layer", [None, 1])
def test_dense_forward_with_the_kernel_is_the_default_forward(params, exit_layer):
    """Logits, taps and K/V of the interpreted kernel's forward (two fused adds per layer, the last one's
    with the final norm) equal the default forward's bit for bit."""
    _equal(jax.tree.leaves(_forward(params, dataclasses.replace(CFG, residual_norm=FUSED), exit_layer)),
           jax.tree.leaves(_forward(params, CFG, exit_layer)))


def test_only_a_choice_naming_triton_changes_the_forward(params):
    def jaxpr(cfg):
        return str(jax.make_jaxpr(lambda p: _forward(p, cfg))(params))
    default = jaxpr(CFG)
    assert "pallas_call" not in default
    assert jaxpr(dataclasses.replace(CFG, residual_norm=dispatch.choice("residual_norm", ["xla"]))) == default
    assert jaxpr(dataclasses.replace(CFG, residual_norm=FUSED)).count("name=residual_norm_pallas") == 2 * CFG.num_layers


# ---- the plan field ----------------------------------------------------------------------------------

def _compose(overrides):
    base = ["target=tiny_random", "drafter=random", "drafter.block_size=4", "decoding=stock", "bench=default",
            "gpu=cpu"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return typed(compose(config_name="config", overrides=[*base, *overrides]))


def test_plan_field_composes_defaults_to_xla_and_refuses_bad_names():
    assert "residual_norm" in plan_mod.KERNEL_OPS
    assert {p.kernels.residual_norm for p in build_plans(_compose([]))} == {dispatch.OpChoice(("xla",))}
    cfg = _compose(["decoding.plans.stock.kernels.residual_norm.implementation=[triton,xla]",
                    "+decoding.plans.stock.kernels.residual_norm.config.block_rows=2"])
    validate(cfg)
    [stock] = [p for p in build_plans(cfg) if p.name == "stock"]
    assert stock.kernels.residual_norm == dispatch.OpChoice(("triton", "xla"), rn.ResidualNormConfig(block_rows=2))
    for override, match in (("decoding.plans.stock.kernels.residual_norm.implementation=[cuda]",
                             "decoding.plans.stock.kernels.residual_norm: unknown residual_norm implementation"
                             ".*'cuda'"),
                            ("gpu.residual_norm=[mosaic]", "gpu.residual_norm: 'mosaic' is not")):
        with pytest.raises(config_schema.ConfigValueError, match=match):
            validate(_compose([override]))
