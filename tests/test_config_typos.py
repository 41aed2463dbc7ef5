"""A misspelled key, an unknown group option or a wrongly typed value: one line naming it and the valid keys
or options nearest to it, never Hydra's `+key` advice (a typed group has no room for new keys)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from specpilot.harness import config_errors, config_schema
from specpilot.harness.config_errors import ConfigValueError

ROOT = Path(__file__).resolve().parents[1]
config_schema.register()


def _composition_message(overrides, config="config"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        with pytest.raises(HydraException) as e:
            compose(config_name=config, overrides=overrides)
    return config_errors.from_composition(e.value)


@pytest.mark.parametrize("override,message", [
    ("decoding.plans.stock.blok_size=4", "decoding.plans.stock has no key 'blok_size'; did you mean 'block_size'?"),
    ("sed=3", "the config has no key 'sed'; did you mean 'seed'?"),
    ("bench.new_tokenz=5", "bench has no key 'new_tokenz'; did you mean 'new_tokens'?"),
    ("decoding.plans.stok.block_size=4",  # the default run's plans: stock and stock_rows
     "decoding.plans has no key 'stok'; did you mean 'stock' or 'stock_rows'?"),
    ("gpu.allow_missmatch=true", "gpu has no key 'allow_missmatch'; did you mean 'allow_mismatch'?"),
    ("decoding.plans.stock.kernels.matmul.implementaion=[xla]",
     "decoding.plans.stock.kernels.matmul has no key 'implementaion'; did you mean 'implementation'?"),
    ("bench.batch_size=many", "bench.batch_size: Value 'many' of type 'str' could not be converted to Integer"),
])
def test_a_misspelled_or_mistyped_key_is_named_with_the_nearest_valid_ones(override, message):
    got = _composition_message(["decoding=stock", override] if "plans.stock" in override else [override])
    assert got == message and "+" not in got


def test_a_key_with_nothing_near_lists_the_valid_keys():
    assert _composition_message(["gpu.zzz=1"]).startswith("gpu has no key 'zzz' (its keys: name, allow_mismatch, ")


def test_an_unknown_group_option_lists_the_nearest_options():
    got = _composition_message(["target=qwen9"])
    assert got.startswith("target has no option 'qwen9'; did you mean 'qwen3_8b'")
    assert "(options: embedded, gguf, hf, llama3_8b, qwen3_4b" in got and "target_schema" not in got
    assert _composition_message(["decoding=stokc"]).startswith("decoding has no option 'stokc'; did you mean 'stock'")


def test_a_key_added_with_a_plus_is_refused_by_the_typed_config():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["decoding=stock", "+decoding.plans.stock.blok_size=4"])
    with pytest.raises(ConfigValueError) as e:
        config_schema.typed(cfg)
    assert str(e.value) == "decoding.plans.stock has no key 'blok_size'; did you mean 'block_size'?"


def test_a_scripts_own_options_are_pointed_at_their_plus():
    got = config_errors.unknown_key("serve", ["seed", "target"], options_namespace="serve")
    assert got == "'serve' holds this script's own options, which are added with a +: +serve.<option>=<value>"


def _script(name, *args, env=None, cwd):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / name), *args, f"hydra.run.dir={cwd}/h"],
                          cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_the_entry_points_print_one_line_and_keep_the_traceback_on_request(tmp_path):
    proc = _script("run.py", "decoding.plans.stock.blok_size=4", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: decoding.plans.stock has no key 'blok_size'; did you mean 'block_size'?"]
    assert not (tmp_path / "h").exists()
    proc = _script("predict.py", "target=qwen9", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("config error: target has no option 'qwen9'; did you mean 'qwen3_8b'")
    full = _script("run.py", "sed=3", cwd=tmp_path, env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0 and "Traceback" in full.stderr and "sed" in full.stderr
