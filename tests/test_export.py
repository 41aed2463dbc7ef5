"""Exporting a target trained here (orbax) to a Hugging Face directory, and generating from either.

A pair folder is laid out as the embedded cache and `experiments/train.py` lay it out (tokenizer.json,
target/model written by `save_model`, drafter/model in the DFlash format); the weights are random, so
the test needs no training.
"""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.data.tokenizer import load_tokenizer, train_tokenizer
from specpilot.decoding.ar import generate
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf
from specpilot.models.config import ModelConfig
from specpilot.training.checkpointing import save_model

ROOT = Path(__file__).resolve().parents[1]
EXPORT, GENERATE = ROOT / "experiments" / "export.py", ROOT / "experiments" / "generate.py"
TEXT = "def add(x, y):\n    return x + y\n"


def _run(script, *args):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(cache dir holding one embedded-* pair, the pair folder, target params, target cfg)."""
    cache = tmp_path_factory.mktemp("cache")
    folder = cache / "embedded-0123456789ab"
    tok = train_tokenizer([TEXT * 50], vocab_size=300)
    tok.save(folder / "tokenizer.json")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, eos_token_id=tok.eos_id)
    params = dense.init(jax.random.key(0), cfg, dtype=jnp.float32, std=0.5)
    save_model(folder / "target" / "model", params, cfg)
    tok.save(folder / "target" / "model" / "tokenizer.json")
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    dr.save_drafter(folder / "drafter" / "model", dr.init(jax.random.key(1), dcfg, jnp.float32), dcfg)
    return cache, folder, params, cfg


def test_export_round_trips_the_target(pair, tmp_path):
    _, folder, params, cfg = pair
    proc = _run(EXPORT, folder, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= written
    loaded, loaded_cfg = load_hf(tmp_path / "hf", dtype=None)
    assert loaded_cfg == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)
    want, _, _ = dense.chain_forward(params, cfg, tokens, dense.init_state(cfg, 1, 8, jnp.float32))
    got, _, _ = dense.chain_forward(loaded, loaded_cfg, tokens, dense.init_state(cfg, 1, 8, jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    tok = load_tokenizer(tmp_path / "hf")
    assert tok.encode(TEXT) == load_tokenizer(folder).encode(TEXT)


def test_export_in_bfloat16(pair, tmp_path):
    _, folder, params, _ = pair
    proc = _run(EXPORT, folder / "target" / "model", tmp_path / "hf", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded, _ = load_hf(tmp_path / "hf", dtype=None)
    assert loaded["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded["embed"]),
                                  np.asarray(params["embed"].astype(jnp.bfloat16)))


@pytest.mark.parametrize("where", ["cache", "pair", "exported"])
def test_generate_reads_the_cached_pair_or_its_export(pair, tmp_path, where):
    cache, folder, params, cfg = pair
    if where == "exported":
        assert _run(EXPORT, cache, tmp_path / "hf").returncode == 0
    checkpoint = {"cache": cache, "pair": folder, "exported": tmp_path / "hf"}[where]
    proc = _run(GENERATE, "--checkpoint", checkpoint, "--prompt", TEXT, "--max-new-tokens", 6,
                "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tok = load_tokenizer(folder)
    want = generate(dense.target(cfg, params["embed"].dtype), params, [tok.encode(TEXT)], 6).as_lists(
        cfg.eos_token_id)[0]
    assert proc.stdout.rstrip("\n") == tok.decode(want)


def test_ambiguous_or_empty_sources_fail_clearly(pair, tmp_path):
    cache, folder, _, _ = pair
    proc = _run(EXPORT, tmp_path, tmp_path / "out")
    assert proc.returncode != 0 and "no target" in proc.stderr
    two = tmp_path / "two"
    for name in ("embedded-aaaaaaaaaaaa", "embedded-bbbbbbbbbbbb"):
        (two / name / "target" / "model").mkdir(parents=True)
        for f in (folder / "target" / "model").iterdir():
            (two / name / "target" / "model" / f.name).symlink_to(f)
    proc = _run(GENERATE, "--checkpoint", two, "--prompt-ids", "1,2")
    assert proc.returncode != 0 and "embedded-aaaaaaaaaaaa" in proc.stderr
    assert "embedded-bbbbbbbbbbbb" in proc.stderr
