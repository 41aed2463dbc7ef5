"""Every config composes and types check; impossible values fail with messages naming the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from specpilot import config_schema
from specpilot.config_schema import ConfigValueError, typed, validate

CONF = Path(__file__).resolve().parents[1] / "conf"
config_schema.register()


TINY = ["target=tiny_random", "drafter=none", "decoding=ar", "bench=default"]


def _compose(overrides=(), base=TINY):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return typed(compose(config_name="config", overrides=[*base, *overrides]))


def _fixups(group, option):
    """Companion choices an option needs to form a valid deployment."""
    if (group, option) in (("target", "embedded"), ("drafter", "embedded"), ("bench", "heldout")):
        return ["target=embedded", "drafter=embedded", "decoding=stock", "bench=heldout"]
    if group == "decoding" and option != "ar":
        extra = ["drafter=random"]  # speculative methods need a drafter
        if "w12" in option:
            extra.append("target.dtype=bfloat16")  # the 12-bit format encodes bf16 weights
        if "twin" in option:
            extra.append("gpu.kernel_backend=mosaic")  # the bf16 twin is the Mosaic kernel's
        return extra
    return []


def test_default_config_composes_and_validates():
    cfg = _compose(base=())
    validate(cfg)
    assert (cfg.target.source, cfg.drafter.source, cfg.bench.prompts) == ("embedded", "embedded", "heldout")


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["target", "drafter", "gpu", "decoding", "bench", "experiment"])
def test_every_option_composes(group):
    for option in _options(group):
        if group == "experiment":
            cfg = _compose([f"experiment={option}"], base=())
        else:
            cfg = _compose([*_fixups(group, option), f"{group}={option}"])
        if not any(c.source in ("hf", "dflash") and not c.path for c in (cfg.target, cfg.drafter)):
            validate(cfg)


@pytest.mark.parametrize("override,match", [
    ("drafter.block_size=0", "drafter.block_size"),
    ("bench.batch_size=8", "bench.batch_size"),
    ("bench.cache_len=16", "bench.cache_len"),
    ("decoding.methods=[ar,warp]", "unknown method 'warp'"),
    ("target.source=cloud", "target.source"),
    ("target.init=uniform", "target.init"),
    ("drafter=oracle drafter.acceptance_trace=/nonexistent/run", "no results.jsonl"),
    ("gpu.kernel_backend=cuda", "gpu.kernel_backend"),
    ("bench.prompts=poems", "bench.prompts"),
    ("decoding.top_p=1.5", "decoding"),
    ("target=hf", "target.path"),
    ("drafter=embedded", "drafter.source"),
    ("bench=heldout", "bench.prompts"),
    ("decoding=stock", "needs a drafter"),
    ("decoding=ar_w12_twin target.dtype=bfloat16 gpu.kernel_backend=xla", "ar_twin runs the Mosaic GPU kernel"),
    ("decoding.methods=[ar,ar_twin] gpu.kernel_backend=mosaic target.dtype=float32", "ar_twin multiplies bfloat16"),
])
def test_impossible_values_fail_clearly(override, match):
    with pytest.raises(ConfigValueError, match=match):
        validate(_compose(override.split()))


def test_typos_and_wrong_types_fail_at_composition():
    with pytest.raises(ConfigCompositionException):
        _compose(["bench.new_tokenz=5"])
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["bench.new_tokens=many"])
    with pytest.raises(ConfigCompositionException):
        _compose(["target=qwen9"])


def test_heads_not_dividing_fail_clearly():
    from specpilot.deploy import build_target
    from specpilot.models.config import ConfigError

    cfg = _compose(["target.model.num_key_value_heads=3"])
    with pytest.raises(ConfigError, match="num_kv_heads"):
        build_target(cfg.target, cfg.drafter, 0)
