"""What a checkpoint path names (specpilot.training.locate): the default deployment's converted SmolLM2 in a
cache directory, a pair's target and drafter, and one-line errors when a cache holds several targets.

Targets here are tiny random folders laid out as `make run` and the embedded pair lay them out (a GGUF
conversion is a Hugging Face folder with its import record), so no download or conversion is needed.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from specpilot.data.registry_models import SMOLLM2_FILE
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import save_hf
from specpilot.models.gguf_import import SOURCE_FILE
from specpilot.training import locate

ROOT = Path(__file__).resolve().parents[1]


def conversion(cache: Path, gguf_name: str, cfg) -> Path:
    """A tiny Hugging Face folder under cache/gguf/ with the import record naming `gguf_name`."""
    folder = cache / locate.GGUF_DIR / f"{Path(gguf_name).stem}-0123456789ab"
    save_hf(dense.init(jax.random.key(0), cfg, dtype=jnp.float32), cfg, folder)
    (folder / SOURCE_FILE).write_text(json.dumps({"source": gguf_name}))
    return folder


def pair(cache: Path, name: str, cfg) -> Path:
    folder = cache / f"{locate.PAIR_PREFIX}{name}"
    save_hf(dense.init(jax.random.key(0), cfg, dtype=jnp.float32), cfg, folder / locate.TARGET_MODEL)
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    dr.save_drafter(folder / locate.DRAFTER_MODEL, dr.init(jax.random.key(1), dcfg, jnp.float32), dcfg)
    return folder


def test_the_default_deployment_wins_in_a_cache_and_brings_its_packaged_drafter(tmp_path, tiny_cfg):
    default = conversion(tmp_path, SMOLLM2_FILE, tiny_cfg)
    found = locate.locate(tmp_path)
    assert found == locate.Located(default, dr.PACKAGED / locate.DEFAULT_DRAFTER)
    assert (found.drafter / "model.safetensors").is_file()
    trained = pair(tmp_path, "aaaaaaaaaaaa", tiny_cfg)
    conversion(tmp_path, "other.Q8_0.gguf", tiny_cfg)
    found = locate.locate(tmp_path)
    assert found.target == default and found.drafter == dr.PACKAGED / locate.DEFAULT_DRAFTER
    assert f"{trained.name}/target/model" in found.note and "gguf/other.Q8_0-0123456789ab" in found.note
    # Named directly, each target keeps the drafter made for it.
    assert locate.locate(trained) == locate.Located(trained / locate.TARGET_MODEL, trained / locate.DRAFTER_MODEL)
    assert locate.locate(default).drafter == dr.PACKAGED / locate.DEFAULT_DRAFTER


def test_a_single_target_is_taken_and_several_others_are_listed_in_one_line(tmp_path, tiny_cfg):
    other = conversion(tmp_path, "other.Q8_0.gguf", tiny_cfg)
    assert locate.locate(tmp_path) == locate.Located(other, None)  # no drafter known for it
    pair(tmp_path, "bbbbbbbbbbbb", tiny_cfg)
    pair(tmp_path, "aaaaaaaaaaaa", tiny_cfg)
    with pytest.raises(ValueError) as e:
        locate.find_target(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path} holds 3 targets (")
    assert msg.index("embedded-aaaaaaaaaaaa") < msg.index("embedded-bbbbbbbbbbbb") < msg.index("gguf/other")
    assert f"e.g. {tmp_path}/embedded-aaaaaaaaaaaa/target/model" in msg


def test_an_unconverted_or_empty_folder_says_what_it_expected(tmp_path, tiny_cfg):
    (tmp_path / locate.GGUF_DIR / "half-written").mkdir(parents=True)  # no import record: not a target
    with pytest.raises(FileNotFoundError, match=r"no target in .*gguf/ conversion \(experiments/run.py makes"):
        locate.find_target(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        locate.find_target(tmp_path / "missing")


def test_the_default_drafter_is_the_one_the_default_config_ships():
    text = (ROOT / "conf" / "drafter" / "smollm2.yaml").read_text()
    assert f"path: {locate.DEFAULT_DRAFTER}\n" in text and "source: packaged" in text
    assert locate.DEFAULT_DRAFTER in dr.packaged_drafters()
