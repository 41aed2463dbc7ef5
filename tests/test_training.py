"""Target pretraining: training forward vs dense.forward, loss goes down, bit-exact checkpoints and resume."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specpilot.data.corpus import load_corpus
from specpilot.data.tokenizer import train_tokenizer
from specpilot.models import dense
from specpilot.training.checkpointing import Checkpointer, abstract_of, load_model, save_model
from specpilot.training.common import JsonlLog, make_optimizer
from specpilot.training.target import (TargetTrainConfig, lm_loss, make_train_step, model_config,
                                       train_forward, train_target)
from tests.test_data import write_tree

TINY_TRAIN = TargetTrainConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                               intermediate_size=64, seq_len=16, batch_size=4, steps=6,
                               learning_rate=1e-2, warmup_steps=2, log_every=1, eval_every=3,
                               eval_sequences=8, checkpoint_every=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = write_tree(tmp_path_factory.mktemp("corpus"))
    corpus = load_corpus(root, heldout_fraction=0.3)
    tokenizer = train_tokenizer(corpus.texts("train"), vocab_size=300)
    return corpus, tokenizer


def tiny_model(tokenizer, seed=0):
    cfg = model_config(TINY_TRAIN, tokenizer)
    return cfg, dense.init(jax.random.key(seed), cfg, jnp.float32, std=0.1)


def test_train_forward_matches_dense_forward(setup):
    _, tokenizer = setup
    cfg, params = tiny_model(tokenizer)
    cfg = cfg.with_taps((0, 1))
    tokens = jax.random.randint(jax.random.key(1), (3, 11), 0, cfg.vocab_size)
    logits, taps = jax.jit(train_forward, static_argnums=1)(params, cfg, tokens)
    # A decoding cache is longer than the sequence: the extra, masked slots must change nothing.
    ref_logits, ref_taps, _ = jax.jit(dense.chain_forward, static_argnums=1)(
        params, cfg, tokens, dense.init_state(cfg, 3, 32, jnp.float32))
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(taps, ref_taps, rtol=1e-6, atol=1e-6)
    assert logits.shape == (3, 11, cfg.vocab_size) and taps.shape == (3, 11, 2 * cfg.hidden_size)


def test_train_step_lowers_loss_on_fixed_batch(setup):
    _, tokenizer = setup
    cfg, params = tiny_model(tokenizer)
    opt = make_optimizer(1e-2, steps=20, warmup_steps=2, weight_decay=0.1, grad_clip=1.0)
    step = make_train_step(cfg, opt)
    batch = jax.random.randint(jax.random.key(2), (4, 17), 0, cfg.vocab_size)
    state = {"params": params, "opt_state": opt.init(params), "step": jnp.zeros((), jnp.int32)}
    loss_fn = jax.jit(lm_loss, static_argnums=1)
    first = float(loss_fn(params, cfg, batch))
    for _ in range(20):
        state, metrics = step(state, batch)
    assert float(loss_fn(state["params"], cfg, batch)) < first - 1.0
    assert int(state["step"]) == 20 and np.isfinite(float(metrics["grad_norm"]))


def test_checkpoint_round_trip_is_bit_exact(setup, tmp_path):
    _, tokenizer = setup
    cfg, params = tiny_model(tokenizer)
    opt = optax.adamw(1e-3)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt.init(params), params)
    state = {"params": params, "opt_state": opt_state, "step": jnp.asarray(7, jnp.int32)}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(7, state, {"data": 1})
        assert ck.latest_step() == 7
        restored, meta = ck.restore(7, abstract_of(state))
    assert meta == {"data": 1}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    save_model(tmp_path / "model", jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), cfg)
    loaded, loaded_cfg = load_model(tmp_path / "model")
    assert loaded_cfg == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        assert a.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))


def test_resumed_training_equals_uninterrupted(setup, tmp_path):
    corpus, tokenizer = setup
    full = train_target(TINY_TRAIN, corpus, tokenizer, tmp_path / "full", progress=False)
    part = train_target(TINY_TRAIN, corpus, tokenizer, tmp_path / "resumed", stop_at=3, progress=False)
    assert not (tmp_path / "resumed" / "model").exists()  # interrupted: no finished model yet
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(part), jax.tree.leaves(full)))
    resumed = train_target(TINY_TRAIN, corpus, tokenizer, tmp_path / "resumed", progress=False)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(full)):
        assert np.array_equal(np.asarray(a), np.asarray(b))

    def curve(d):
        return [(r["step"], r.get("loss"), r.get("heldout_loss")) for r in JsonlLog(d / "log.jsonl").read()]
    assert curve(tmp_path / "resumed") == curve(tmp_path / "full")
    losses = [r for r in JsonlLog(tmp_path / "full" / "log.jsonl").read() if "heldout_loss" in r]
    assert [r["step"] for r in losses] == [3, 6]
    params, cfg = load_model(tmp_path / "full" / "model")
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.eos_token_id == tokenizer.eos_id
    changed = dataclasses.replace(TINY_TRAIN, seed=1)
    with pytest.raises(ValueError, match="different settings"):
        train_target(changed, corpus, tokenizer, tmp_path / "full", progress=False)
