"""The default deployment's pieces that need no download: the shipped drafter, chat training data."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.data.corpus import load_corpus
from specpilot.data.chat import REQUEST_KINDS, stdlib_requests
from specpilot.decoding.ar import generate
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ConfigError, ModelConfig
from specpilot.training.drafter import regenerate
from tests.test_data import write_tree
from specpilot.harness import config_schema
from specpilot.harness.config_schema import ConfigValueError, typed, validate

SHIPPED = "smollm2-135m-instruct-dflash-b16"
# SmolLM2-135M-Instruct as its GGUF's metadata gives it (tests/test_gguf_import.py checks the reader).
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192)


def test_the_shipped_drafter_loads_and_fits_smollm2():
    assert SHIPPED in dr.packaged_drafters()
    params, cfg = dr.load_drafter(dr.PACKAGED / SHIPPED)
    assert (cfg.block_size, cfg.num_layers, cfg.tap_layers, cfg.mask_token_id) == (16, 4, (6, 12, 17, 23, 29), 16)
    assert params["fc"].dtype == jnp.bfloat16  # shipped in bf16: it shares the target's embedding and head
    dr.check_compatible(cfg, SMOLLM2.with_taps(cfg.tap_layers))
    with pytest.raises(ConfigError, match="30-layer target"):
        dr.check_compatible(cfg, dataclasses.replace(SMOLLM2, num_layers=24).with_taps((6, 12, 17, 23)))
    for leaf in jax.tree.leaves(params):
        assert bool(jnp.isfinite(leaf.astype(jnp.float32)).all())


def test_every_kind_requests_cover_each_function_once_per_kind(tmp_path):
    corpus = load_corpus(write_tree(tmp_path), heldout_fraction=0.0)
    cycled = stdlib_requests(corpus, "train")
    every = stdlib_requests(corpus, "train", every_kind=True)
    functions = {r.where for r in cycled}
    assert {r.where for r in every} == functions
    for where in functions:
        kinds = [r.kind for r in every if r.where == where]
        assert len(kinds) == len(set(kinds)) and set(kinds) <= set(REQUEST_KINDS) and "explain" in kinds


def test_ragged_regeneration_with_a_stop_token_equals_one_prompt_at_a_time():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=256)
    params = dense.init(jax.random.key(0), cfg, jnp.float32, std=0.5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, n).tolist() for n in (5, 9, 3, 7, 12)]
    alone = [generate(dense.target(cfg, jnp.float32), params, [p], 10).tokens[0] for p in prompts]
    stop = int(alone[1][4])  # a token prompt 1's continuation emits, so at least one row stops early
    seqs = regenerate(params, cfg, prompts, 10, batch=2, stop_token=stop)
    assert seqs.tokens.shape == (5, 12 + 10)
    for i, (p, cont) in enumerate(zip(prompts, alone)):
        cont = cont.tolist()
        n = cont.index(stop) + 1 if stop in cont else 10
        assert seqs.starts[i] == len(p) and seqs.ends[i] == len(p) + n
        assert seqs.tokens[i, :len(p)].tolist() == p
        assert seqs.tokens[i, len(p):len(p) + n].tolist() == cont[:n]
    assert (seqs.ends - seqs.starts < 10).any()


def test_an_unknown_packaged_drafter_is_refused_naming_the_key():
    from hydra import compose, initialize_config_dir

    config_schema.register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = typed(compose(config_name="config", overrides=["drafter.path=no-such-drafter"]))
    with pytest.raises(ConfigValueError, match=r"drafter.path: 'no-such-drafter' is not a drafter shipped in .*"
                                               r"smollm2-135m-instruct-dflash-b16"):
        validate(cfg)


def test_the_shipped_drafter_drafts_as_wide_as_it_was_trained():
    """conf/drafter/smollm2.yaml drafts every block 16 rows wide; null: as wide as the plan's block; 0 refused."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specpilot.harness import deploy

    config_schema.register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        dconf = compose(config_name="config").drafter
    target_params = {"embed": jnp.zeros((1, 1), jnp.float32)}  # only its dtype is read without a draft vocabulary
    for width in (16, None, 8):
        got = OmegaConf.merge(dconf, {"draft_vocab": None} if width == 16 else {"draft_vocab": None,
                                                                                  "draft_width": width})
        drafter, _, _, notes = deploy.build_drafter(got, SMOLLM2, target_params, 0)
        assert drafter.draft_width == width and drafter.block_size == 16
        assert any(f"drafted {width} rows wide" in n for n in notes) == (width is not None)
    with pytest.raises(ConfigValueError, match="drafter.draft_width: must be >= 1 rows"):
        deploy.build_drafter(OmegaConf.merge(dconf, {"draft_width": 0}), SMOLLM2, target_params, 0)
