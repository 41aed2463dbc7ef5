"""Drafter training: training blocks equal inference drafts; end to end against a frozen toy target."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.data.corpus import load_corpus
from specpilot.data.tokenizer import train_tokenizer
from specpilot.decoding import spec
from specpilot.models import dense
from specpilot.models import drafter as drafter_model
from specpilot.training import drafter as drafter_training
from specpilot.training.common import JsonlLog
from specpilot.training.drafter import (DrafterTrainConfig, block_labels, block_logits, drafter_config,
                                        spaced_taps, target_taps, train_drafter)
from specpilot.training.target import TargetTrainConfig, model_config
from tests.test_data import write_tree

TINY_TARGET = TargetTrainConfig(hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=16,
                                intermediate_size=64, seq_len=16)
TINY_DRAFTER = DrafterTrainConfig(block_size=4, num_taps=2, gamma=2.0, num_sequences=12, prompt_len=8,
                                  gen_len=12, gen_batch=4, heldout_sequences=4, anchors_per_seq=3,
                                  batch_size=4, steps=4, learning_rate=1e-2, warmup_steps=1, log_every=1,
                                  eval_every=2, eval_batch=2, checkpoint_every=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    corpus = load_corpus(write_tree(tmp_path_factory.mktemp("corpus")), heldout_fraction=0.3)
    tokenizer = train_tokenizer(corpus.texts("train"), vocab_size=300)
    target_cfg = model_config(TINY_TARGET, tokenizer)
    target_params = dense.init(jax.random.key(0), target_cfg, jnp.float32, std=0.3)
    return corpus, tokenizer, target_cfg, target_params


def test_walk_tau_follows_decoding_jumps():
    # Anchors visited: 1 (3 accepted -> 4 tokens), 5 (1 -> 2), 7 (0 -> 1), 8 (2 -> 3): 10 tokens / 4 steps.
    assert drafter_training.walk_tau(np.array([[0, 3, 0, 0, 0, 1, 0, 0, 2, 0]]), first=1) == 2.5
    # Per-row starts and ends: row 2 starts at anchor 2 and stops before anchor 6 (2 -> 3 tokens, 5 -> 1).
    rows = np.array([[0, 3, 0, 0, 0, 1, 0, 0, 2, 0], [9, 9, 2, 9, 9, 0, 9, 9, 9, 9]])
    assert drafter_training.walk_tau(rows, first=[1, 2], last=[10, 6]) == 14 / 6


def test_draw_anchors_stay_in_each_rows_range():
    lo, hi = jnp.array([0, 5, 7]), jnp.array([3, 5, 20])
    a = np.asarray(drafter_training.draw_anchors(jax.random.key(0), 4000, lo, hi))
    for row, l, h in zip(a, np.asarray(lo), np.asarray(hi)):
        assert row.min() == l and row.max() == h  # every value of the range is drawn, none outside
        assert set(np.unique(row)) == set(range(l, h + 1))


def test_labels_past_a_sequences_end_are_invalid():
    tokens = jnp.arange(20, dtype=jnp.int32).reshape(2, 10)
    labels, valid = block_labels(tokens, jnp.array([[2], [7]]), 4, ends=jnp.array([10, 9]))
    np.testing.assert_array_equal(labels[:, 0], [[3, 4, 5], [18, 19, 19]])
    np.testing.assert_array_equal(valid[:, 0], [[True, True, True], [True, False, False]])


def test_spaced_taps():
    assert spaced_taps(4, 3) == (1, 2, 3)
    assert spaced_taps(36, 5) == (7, 14, 21, 28, 35)
    assert spaced_taps(2, 5) == (0, 1)


def test_training_blocks_equal_inference_drafts(setup):
    _, tokenizer, target_cfg, target_params = setup
    dcfg = drafter_config(TINY_DRAFTER, target_cfg, tokenizer)
    tcfg = target_cfg.with_taps(dcfg.tap_layers)
    params = drafter_model.init(jax.random.key(1), dcfg, jnp.float32, std=0.2)
    tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, tcfg.vocab_size)
    anchors = jnp.asarray([[3, 9, 16], [0, 11, 5]], jnp.int32)
    taps = target_taps(target_params, tcfg, tokens)
    logits = jax.jit(block_logits, static_argnums=(1, 3))(params, dcfg, target_params, tcfg, taps, tokens,
                                                         anchors)  # [B, K, Bs-1, V]
    drafter = drafter_model.BlockDrafter(dcfg, tcfg)

    @jax.jit
    def inference_drafts(a):  # a [B]: context = taps before the anchor only (later rows zeroed)
        seen = taps * (jnp.arange(taps.shape[1])[None, :, None] < a[:, None, None])
        state = drafter.init_state(params, 2, 24, jnp.float32)
        state = drafter.extend(params, target_params, state, seen, a)
        last = jnp.take_along_axis(tokens, a[:, None], axis=1)[:, 0]
        return drafter.propose(params, target_params, state, last, dcfg.block_size)[0]

    for k in range(anchors.shape[1]):
        np.testing.assert_allclose(logits[:, k], inference_drafts(anchors[:, k]), rtol=1e-5, atol=1e-5)
    labels, valid = block_labels(tokens, anchors, dcfg.block_size)
    np.testing.assert_array_equal(labels[1, 1], tokens[1, 12:15])
    assert bool(valid.all())


@pytest.mark.slow
def test_drafter_training_end_to_end(setup, tmp_path):
    corpus, tokenizer, target_cfg, target_params = setup
    frozen = jax.tree.map(np.array, target_params)
    params, dcfg = train_drafter(TINY_DRAFTER, corpus, tokenizer, target_params, target_cfg, tmp_path,
                                 progress=False)
    for a, b in zip(jax.tree.leaves(target_params), jax.tree.leaves(frozen)):
        assert np.array_equal(np.asarray(a), b)  # the target is never updated
    data = np.load(tmp_path / "regenerated.npz")
    assert data["train"].shape == (12, 20) and data["heldout"].shape[1] == 20
    log = JsonlLog(tmp_path / "log.jsonl").read()
    assert [r["step"] for r in log if "heldout_tau" in r] == [2, 4]
    assert all(1.0 <= r["heldout_tau"] <= dcfg.block_size for r in log if "heldout_tau" in r)
    loaded, loaded_cfg = drafter_model.load_drafter(tmp_path / "model")
    assert loaded_cfg == dcfg
    # The trained drafter plugs into the speculative loop, which stays lossless.
    tcfg = target_cfg.with_taps(dcfg.tap_layers)
    prompts = data["heldout"][:2, :TINY_DRAFTER.prompt_len].tolist()
    out = spec.generate(dense.target(tcfg, target_params["embed"].dtype), target_params,
                        drafter_model.BlockDrafter(dcfg, tcfg), loaded, prompts, 10)
    np.testing.assert_array_equal(out.tokens, data["heldout"][:2, 8:18])
    # Resuming a finished run restores instead of retraining, and gives the same params.
    again, _ = train_drafter(TINY_DRAFTER, corpus, tokenizer, target_params, target_cfg, tmp_path,
                             progress=False)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="mask token"):
        drafter_config(TINY_DRAFTER, target_cfg, dataclasses.replace(tokenizer, mask_id=None))
    assert drafter_training.position_weights(4, 2.0)[0] == 1.0
