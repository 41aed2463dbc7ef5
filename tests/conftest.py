"""Shared fixtures: tiny model configs built with dataclasses.replace, as the style guide suggests."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from specpilot.models import dense
from specpilot.models.config import ModelConfig

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))


@pytest.fixture
def tiny_cfg():
    return TINY


@pytest.fixture
def tiny_params():
    # A large init std makes logits peaked, so greedy choices are not near-ties between tokens.
    return dense.init(jax.random.key(0), TINY, dtype=jnp.float32, std=0.5)


def replace(cfg, **kw):
    return dataclasses.replace(cfg, **kw)
