"""target.matmul_precision: jax's default matmul precision for the deployment's process (float32 targets on
GPUs, whose default may run float32 products in TF32), checked where the products are lowered."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hydra import compose, initialize_config_dir

from specpilot.harness import config_schema, deploy
from specpilot.harness.config_schema import ConfigValueError, build_plans, validate

BASE = ["target=tiny_random", "target.dtype=float32", "drafter=none", "decoding=ar", "bench=default",
        "bench.num_prompts=1", "bench.new_tokens=2", "bench.prompt_len=4"]


def _compose(overrides):
    config_schema.register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return config_schema.typed(compose(config_name="config", overrides=BASE + list(overrides)))


def _dot_precision_text() -> str:
    a = jnp.ones((4, 4), jnp.float32)
    return jax.jit(jnp.dot).lower(a, a).as_text()


@pytest.fixture
def restore_precision():
    before = jax.config.jax_default_matmul_precision
    yield
    jax.config.update("jax_default_matmul_precision", before)


def test_highest_reaches_the_products_lowered_after_the_build(restore_precision):
    assert "HIGHEST" not in _dot_precision_text()  # jax's default states no precision
    cfg = _compose(["target.matmul_precision=highest"])
    validate(cfg)
    dep = deploy.build(cfg, build_plans(cfg))
    assert jax.config.jax_default_matmul_precision == "highest"
    assert any("matmul precision highest" in n for n in dep.notes)
    assert "HIGHEST" in _dot_precision_text()


def test_without_it_the_build_leaves_jaxs_setting_alone(restore_precision):
    jax.config.update("jax_default_matmul_precision", "high")  # the user's own, process-wide
    cfg = _compose([])
    deploy.build(cfg, build_plans(cfg))
    assert jax.config.jax_default_matmul_precision == "high"


def test_an_unknown_precision_is_refused_by_name():
    with pytest.raises(ConfigValueError, match=r"target.matmul_precision: 'tf32' is not null or one of"):
        validate(_compose(["target.matmul_precision=tf32"]))
