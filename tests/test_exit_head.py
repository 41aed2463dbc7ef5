"""A trained exit head as the two-level first level: a fresh head is the untrained early exit, its scores
match a numpy reference, two-level decoding through a head (fresh, perturbed or trained here) equals AR
token for token and forcing is clean, and every bad checkpoint or plan fails naming the problem."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specpilot import forcing
from specpilot import state as st
from specpilot.decoding import ar, two_level
from specpilot.decoding import token_tree as tt
from specpilot.harness.config_errors import ConfigValueError
from specpilot.harness.deploy import Deployment
from specpilot.models import dense, exit_head
from specpilot.models import drafter as dr
from specpilot.plan import Plan, TreeShape, TwoLevel
from specpilot.training.exit_head import ExitHeadTrainConfig, train_exit_head
from helpers import random_params
from test_tree import CFG, PROMPTS, TARGET
import test_hybrid_spec as hs

N = 20

@pytest.fixture(scope="module")
def target():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    return ar.generate(TARGET, target, PROMPTS, N).tokens


@pytest.fixture(scope="module")
def block_drafter():
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=8)
    return dr.BlockDrafter(dcfg, CFG), random_params(dr.param_shapes(dcfg), 0.5, 1)


HCFG = exit_head.ExitHeadConfig(exit_layer=1, hidden_size=CFG.hidden_size, rank=8, num_ids=48,
                                vocab_size=CFG.vocab_size, num_layers=CFG.num_layers)
IDS = np.sort(np.random.default_rng(0).choice(CFG.vocab_size, HCFG.num_ids, replace=False)).astype(np.int32)


def perturbed(cfg, seed=0, scale=0.5):
    """A head with every parameter non-trivial (as training leaves it)."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray((1.0 if k == "norm" else 0.0) + scale * rng.standard_normal(s), jnp.float32)
            for k, s in cfg.param_shapes().items()}


def prefilled(target_params, target_obj, prompts, cache_len=64):
    tokens, lengths = ar.pack_prompts(prompts, cache_len)
    state = target_obj.init_state(len(prompts), cache_len)
    _, _, state = jax.jit(st.prompt_forward, static_argnums=0)(target_obj, target_params, jnp.asarray(tokens),
                                                               jnp.asarray(lengths), state)
    return state


def random_tree(b, nodes=9, depth=3, k=3, seed=0):
    rng = np.random.default_rng(seed)
    logprobs = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(b, depth, CFG.vocab_size)) * 3.0), axis=-1)
    return tt.build_tree(logprobs, jnp.asarray(rng.integers(0, CFG.vocab_size, size=b)), nodes, depth, k)


# ---- scores ---------------------------------------------------------------------------------------

def test_a_fresh_head_over_every_id_is_the_untrained_exit(target):
    ids = np.arange(CFG.vocab_size, dtype=np.int32)
    cfg = dataclasses.replace(HCFG, num_ids=CFG.vocab_size)
    head = exit_head.for_target(exit_head.init(jax.random.key(0), cfg), ids, target, CFG)
    state, t = prefilled(target, TARGET, PROMPTS), random_tree(len(PROMPTS))
    want = two_level.early_exit_node_logprob(TARGET, target, state, t, 1)
    got = two_level.exit_head_node_logprob(TARGET, two_level.with_exit_head(target, head), state, t, 1)
    np.testing.assert_allclose(got[:, 1:], want[:, 1:], rtol=1e-4, atol=1e-4)


def test_token_logprob_matches_a_numpy_reference(target):
    params = perturbed(HCFG)
    head = exit_head.for_target(params, IDS, target, CFG)
    rng = np.random.default_rng(3)
    b, n = 2, 7
    hidden = rng.standard_normal((b, n, CFG.hidden_size)).astype(np.float32)
    parents = np.array([[-1, 0, 0, 1, 2, 2, 5]] * b, np.int32)
    tokens = rng.integers(0, CFG.vocab_size, (b, n)).astype(np.int32)
    tokens[0, 3] = IDS[5]
    got = np.asarray(exit_head.token_logprob(head, jnp.asarray(hidden), jnp.asarray(parents), jnp.asarray(tokens),
                                             CFG.rms_norm_eps))
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x = hidden.astype(np.float64)
    normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG.rms_norm_eps) * p["norm"]
    inner = normed @ p["down"]
    a = x + (inner / (1 + np.exp(-inner))) @ p["up"]
    logits = a @ np.asarray(target["lm_head"], np.float64)[:, IDS] + p["bias"]  # CFG's head is untied
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    for r in range(b):
        for i in range(1, n):
            where = np.flatnonzero(IDS == tokens[r, i])
            want = logp[r, parents[r, i], where[0]] if where.size else exit_head.OUTSIDE_LOGPROB
            np.testing.assert_allclose(got[r, i], want, rtol=1e-4, atol=1e-4)
    assert got[0, 3] > exit_head.OUTSIDE_LOGPROB


# ---- decoding is lossless -------------------------------------------------------------------------

def test_two_level_through_a_head_equals_ar(target, ar_tokens, block_drafter):
    drafter, dparams = block_drafter
    head = exit_head.for_target(perturbed(HCFG), IDS, target, CFG)
    res = two_level.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=12, depth=5, branching=3,
                             first="early_exit", keep=6, exit_layer=1, exit_head=head)
    np.testing.assert_array_equal(res.tokens, ar_tokens)
    assert res.stats.emitted.sum() == len(PROMPTS) * (N - 1)


def test_forcing_through_a_head_is_clean(target, ar_tokens):
    head = exit_head.for_target(perturbed(HCFG, 1), IDS, target, CFG)
    report = forcing.force(forcing.chunked_scorer(target, TARGET, chunk=1),
                           forcing.two_level_scorer(target, TARGET, 12, 4, 3, "early_exit", 6, 1, exit_head=head),
                           PROMPTS, ar_tokens)
    assert report.passed, report.summary()
    assert report.num_positions == len(PROMPTS) * N


@pytest.mark.slow
def test_hybrid_two_level_through_a_head_equals_ar():
    params = hs.hybrid_params(hs.CFG, 0)
    want = ar.generate(hs.TARGET, params, hs.PROMPTS, N).tokens
    dcfg = dr.DrafterConfig.for_target(hs.CFG, num_layers=1, block_size=8)
    drafter, dparams = dr.BlockDrafter(dcfg, hs.CFG), dr.init(jax.random.key(1), dcfg, jnp.float32, 0.5)
    cfg = dataclasses.replace(HCFG, exit_layer=2, num_layers=hs.CFG.num_layers)
    head = exit_head.for_target(perturbed(cfg), IDS, params, hs.CFG)
    res = two_level.generate(hs.TARGET, params, drafter, dparams, hs.PROMPTS, N, nodes=12, depth=5, branching=3,
                             first="early_exit", keep=6, exit_layer=2, exit_head=head)
    np.testing.assert_array_equal(res.tokens, want)


def test_a_head_trained_here_loads_and_decodes_as_ar(tmp_path, target, ar_tokens, block_drafter):
    cfg = ExitHeadTrainConfig(exit_layer=1, rank=4, vocab=64, gen_len=12, gen_batch=4, feature_batch=4,
                              batch_size=32, steps=8, learning_rate=3e-2, warmup_steps=1, log_every=1,
                              eval_every=8, checkpoint_every=8)
    prompts = ([[3 + i, 7, 11 + 2 * i, 5] for i in range(8)], [[9, 4, 2], [30, 31, 32, 33]])
    _, ids, hcfg, metrics = train_exit_head(cfg, prompts, target, CFG, tmp_path, progress=False)
    log = [r for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert log[-1]["loss"] < log[0]["loss"]
    assert set(metrics) == {"untrained", "trained"} and 0 <= metrics["trained"]["heldout_top1"] <= 1
    params, loaded_ids, loaded_cfg = exit_head.load(tmp_path / "model", CFG, exit_layer=1)
    assert loaded_cfg == hcfg and loaded_ids.tolist() == ids.tolist() and len(ids) == 64
    assert float(jnp.abs(params["up"]).max()) > 0  # trained away from the untrained exit
    drafter, dparams = block_drafter
    res = two_level.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=12, depth=5, branching=3,
                             first="early_exit", keep=6, exit_layer=1,
                             exit_head=exit_head.for_target(params, loaded_ids, target, CFG))
    np.testing.assert_array_equal(res.tokens, ar_tokens)


# ---- bad heads ------------------------------------------------------------------------------------

@pytest.fixture()
def saved(tmp_path):
    path = tmp_path / "head"
    exit_head.save(path, perturbed(HCFG), HCFG, IDS)
    return path


def test_a_saved_head_round_trips(saved):
    params, ids, cfg = exit_head.load(saved, CFG, 1)
    assert cfg == HCFG and ids.tolist() == IDS.tolist()
    for k, v in perturbed(HCFG).items():
        np.testing.assert_array_equal(params[k], v)


def _rewrite(path, **tensors):
    raw = load_file(str(path / exit_head.WEIGHTS_FILE))
    raw.update(tensors)
    save_file(raw, str(path / exit_head.WEIGHTS_FILE))


def _config(path, **fields):
    raw = json.loads((path / exit_head.CONFIG_FILE).read_text())
    (path / exit_head.CONFIG_FILE).write_text(json.dumps({**raw, **fields}))


@pytest.mark.parametrize("breaks,match", [
    (lambda p: _rewrite(p, up=np.full((HCFG.rank, HCFG.hidden_size), np.nan, np.float32)),
     r"tensor up holds non-finite values \(512 NaN"),
    (lambda p: _rewrite(p, bias=np.zeros(3, np.float32)), r"tensor bias has shape \(3,\), config.json implies \(48,\)"),
    (lambda p: _rewrite(p, ids=IDS[::-1].copy()), r"ids must be sorted"),
    (lambda p: _rewrite(p, ids=np.full(HCFG.num_ids, 500, np.int32)), r"token id 500 is outside"),
    (lambda p: _rewrite(p, extra=np.zeros(2, np.float32)), r"unexpected \['extra'\]"),
    (lambda p: (p / exit_head.WEIGHTS_FILE).write_bytes(b"not safetensors"), r"not a readable safetensors"),
    (lambda p: (p / exit_head.WEIGHTS_FILE).unlink(), r"no model.safetensors in exit head folder"),
    (lambda p: (p / exit_head.CONFIG_FILE).unlink(), r"no config.json in exit head folder"),
    (lambda p: _config(p, kind="dflash"), r"is not an exit head's config"),
    (lambda p: _config(p, rank=0), r"rank must be a positive integer"),
    (lambda p: _config(p, hidden_size=32), r"trained for a target of hidden_size 32; this target's is 64"),
    (lambda p: _config(p, vocab_size=256), r"vocab_size 256; this target's is 128"),
    (lambda p: _config(p, num_layers=30), r"num_layers 30; this target's is 2"),
])
def test_a_bad_head_fails_naming_the_problem(saved, breaks, match):
    breaks(saved)
    with pytest.raises(exit_head.ExitHeadError, match=match):
        exit_head.load(saved, CFG, 1)


def test_a_head_read_at_another_layer_or_missing_is_refused(saved, tmp_path):
    _config(saved, num_layers=3)
    with pytest.raises(exit_head.ExitHeadError, match=r"reads layer 1's output; the plan's exit_layer is 2"):
        exit_head.load(saved, dataclasses.replace(CFG, num_layers=3), exit_layer=2)
    with pytest.raises(exit_head.ExitHeadError, match=r"no exit head at .*nowhere.*train one"):
        exit_head.load(tmp_path / "nowhere", CFG)


def test_the_deployment_names_the_plan_field_of_a_bad_head(saved, tmp_path, target):
    dep = Deployment(params=target, cfg=CFG, sampling=None, prompts=[], batch_size=1, new_tokens=1, cache_len=8,
                     key=None)
    tree = TreeShape(12, 5, 3)
    good = Plan(name="h", verify="two_level", block_size=12, tree=tree,
                two_level=TwoLevel("early_exit", 6, 1, str(saved)))
    head = dep.exit_head_for(good)
    assert head["rows"].shape == (HCFG.num_ids, CFG.hidden_size) and dep.exit_head_for(good) is head  # cached
    bad = dataclasses.replace(good, name="b", two_level=TwoLevel("early_exit", 6, 1, str(tmp_path / "gone")))
    with pytest.raises(ConfigValueError, match=r"decoding\.plans\.b\.two_level\.exit_head: no exit head at"):
        dep.exit_head_for(bad)


def test_arrays_that_are_not_a_head_are_refused(target, block_drafter):
    drafter, dparams = block_drafter
    head = exit_head.for_target(perturbed(HCFG), IDS, target, CFG)
    with pytest.raises(ValueError, match="exit_head must be a head's arrays"):
        two_level.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=12, depth=5, branching=3,
                           first="early_exit", keep=6, exit_layer=1, exit_head={"rows": head["rows"]})
    with pytest.raises(ValueError, match="belongs|scores for the early_exit"):
        two_level.generate(TARGET, target, drafter, dparams, PROMPTS, N, nodes=12, depth=5, branching=3,
                           first="drafter_confidence", keep=6, exit_head=head)
