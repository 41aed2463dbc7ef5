"""A reduced draft vocabulary (`specpilot.models.draft_vocab`): the drafter scores a subset of ids and floors
the rest; chain, tree and engine outputs stay AR's, the sampled chain keeps the target's distribution, and
bad sizes or rankings fail naming the field."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from omegaconf import OmegaConf

from specpilot.decoding import ar, spec, tree
from specpilot.decoding.sampling import SamplingConfig
from specpilot.harness import deploy
from specpilot.harness.config_errors import ConfigValueError
from specpilot.models import dense, draft_vocab
from specpilot.models import drafter as dr
from specpilot.serving import Engine, Request
from engine_helpers import run_staggered
from helpers import random_params
from test_rejection import SMALL, _exact_joint, assert_distributed_as

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 2, 3, 4], [9, 40, 7, 3, 2, 8], [17, 4, 99], [64, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def pair():
    """A tiny target, a random block drafter (block 4) and the target's greedy reference."""
    cfg = dense.ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
    params = random_params(dense.param_shapes(cfg), 0.5, 0)
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    target = dense.target(cfg, jnp.float32)
    reference = ar.generate(target, params, PROMPTS, 16).tokens
    return cfg, params, target, dr.BlockDrafter(dcfg, cfg), random_params(dr.param_shapes(dcfg), 0.5, 1), reference


def subset(reference, k, vocab):
    """The reference's tokens first (the recipe: the target's own replies), then others up to k."""
    seen = list(dict.fromkeys(np.asarray(reference).ravel().tolist()))
    rest = [i for i in range(vocab) if i not in seen]
    return np.array((seen + rest)[:k])


@pytest.mark.parametrize("tied", [False, True])
def test_reduced_logits_are_the_full_heads_on_the_subset_and_floored_elsewhere(pair, tied):
    cfg, params, _, drafter, dparams, reference = pair
    if tied:  # the head is the embedding's rows (SmolLM2's case), not lm_head's columns
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
        drafter = dr.BlockDrafter(drafter.cfg, cfg)
    ids = subset(reference, 20, cfg.vocab_size)
    reduced = draft_vocab.with_draft_vocab(dparams, params, cfg, ids)
    assert reduced["draft_head"].shape == (20, cfg.hidden_size)  # gathered once, here
    state = drafter.init_state(dparams, 2, 32)
    last = jnp.array([3, 7], jnp.int32)
    full, _ = drafter.propose(dparams, params, state, last, 4)
    part, _ = drafter.propose(reduced, params, state, last, 4)
    assert part.shape == full.shape and part.dtype == jnp.float32
    inside = np.zeros(cfg.vocab_size, bool)
    inside[ids] = True
    np.testing.assert_allclose(np.asarray(part)[..., inside], np.asarray(full)[..., inside], rtol=1e-5, atol=1e-5)
    assert (np.asarray(part)[..., ~inside] == draft_vocab.OUTSIDE_LOGIT).all()
    assert np.isin(np.asarray(jnp.argmax(part, -1)), ids).all()
    assert np.isfinite(np.asarray(jax.nn.log_softmax(part, -1))).all()  # tree scores add these


def test_chain_tree_and_engine_greedy_outputs_are_ar(pair):
    cfg, params, target, drafter, dparams, reference = pair
    reduced = draft_vocab.with_draft_vocab(dparams, params, cfg, subset(reference, 24, cfg.vocab_size))
    chain = spec.generate(target, params, drafter, reduced, PROMPTS, 16)
    np.testing.assert_array_equal(chain.tokens, reference)
    treed = tree.generate(target, params, drafter, reduced, PROMPTS, 16, nodes=6, depth=3, branching=2)
    np.testing.assert_array_equal(treed.tokens, reference)
    engine = Engine(target, params, drafter, reduced, slots=2, context_len=32, prefill_chunk=8, sampling=False)
    handles = run_staggered(engine, [Request(p, 16) for p in PROMPTS], [0, 0, 1, 3])
    assert [h.tokens for h in handles] == [row.tolist() for row in reference]


def test_sampled_chain_with_a_reduced_drafter_keeps_the_target_distribution():
    params = random_params(dense.param_shapes(SMALL), 0.3, 3)
    dcfg = dr.DrafterConfig.for_target(SMALL, num_layers=1, block_size=3)
    drafter = dr.BlockDrafter(dcfg, SMALL)
    dparams = draft_vocab.with_draft_vocab(random_params(dr.param_shapes(dcfg), 0.3, 4), params, SMALL, [1, 4, 6])
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt, n = [1, 2, 3], 4000
    want = _exact_joint(params, prompt, sampling)
    res = spec.generate(dense.target(SMALL, jnp.float32), params, drafter, dparams, [prompt] * n, 3,
                        sampling=sampling, key=jax.random.key(5), cache_len=7)
    assert_distributed_as(res.tokens @ np.array([64, 8, 1]), want, "speculative (t1, t2, t3), 3 of 8 ids drafted")
    # drafts were accepted and rejected: both branches of the rejection step ran on the reduced q
    assert res.stats.accept_hist[0] > 0 and res.stats.accept_hist[1:].sum() > 0


@pytest.mark.parametrize("k, match", [(0, "drafter.draft_vocab: must be an integer in"),
                                      (129, "drafter.draft_vocab: must be an integer in"),
                                      (True, "drafter.draft_vocab: must be an integer in"),
                                      (11, "drafter.draft_vocab: 11 tokens asked, the ranking holds 10")])
def test_bad_sizes_name_the_field(k, match):
    with pytest.raises(draft_vocab.DraftVocabError, match=match):
        draft_vocab.select(np.arange(10), k, 128)


@pytest.mark.parametrize("ids, match", [([3, 128], "token id 128 is outside the target's vocabulary"),
                                        ([-1, 2], "token id -1 is outside"), ([2, 2], "repeat"),
                                        ([], "non-empty"), ([[1, 2]], "1-d"), ([0.5], "integer")])
def test_bad_rankings_name_the_field(ids, match):
    with pytest.raises(draft_vocab.DraftVocabError, match=f"drafter.draft_vocab_ids: .*{match}"):
        draft_vocab.check_ids(np.array(ids), 128)


def test_ranking_orders_by_count_then_tiebreak_then_id():
    np.testing.assert_array_equal(draft_vocab.ranking_from_counts([0, 5, 2, 5, 0]), [1, 3, 2, 0, 4])
    np.testing.assert_array_equal(draft_vocab.ranking_from_counts([0, 5, 2, 5, 0], [1, 0, 9, 3, 2]), [3, 1, 2, 4, 0])


def test_the_deployment_reads_the_drafter_folders_ranking_or_the_named_one(pair, tmp_path):
    cfg, params, _, _, dparams, _ = pair
    np.save(tmp_path / draft_vocab.RANKING_FILE, np.arange(127, -1, -1, dtype=np.uint16))
    conf = OmegaConf.create({"source": "packaged", "draft_vocab": 8, "draft_vocab_ids": None})
    out, notes = deploy.reduce_draft_vocab(conf, dparams, params, cfg, tmp_path)
    np.testing.assert_array_equal(out["draft_ids"], np.arange(120, 128))
    head = np.asarray(params["embed"]) if cfg.tie_word_embeddings else np.asarray(params["lm_head"]).T
    np.testing.assert_array_equal(out["draft_head"], head[120:])
    assert "the first 8 ids" in notes[0]
    unchanged, none = deploy.reduce_draft_vocab(OmegaConf.create({"source": "packaged", "draft_vocab": None}),
                                                dparams, params, cfg, tmp_path)
    assert unchanged is dparams and none == []
    np.save(tmp_path / "bad.npy", np.array([1, 500]))
    with pytest.raises(ConfigValueError, match="drafter.draft_vocab_ids: token id 500 is outside"):
        deploy.reduce_draft_vocab(OmegaConf.create({"source": "random", "draft_vocab": 2,
                                                    "draft_vocab_ids": str(tmp_path / "bad.npy")}),
                                  dparams, params, cfg, None)
    with pytest.raises(ConfigValueError, match="drafter.draft_vocab_ids: a 'random' drafter has no folder"):
        deploy.reduce_draft_vocab(OmegaConf.create({"source": "random", "draft_vocab": 2}), dparams, params,
                                  cfg, None)
    with pytest.raises(ConfigValueError, match="drafter.draft_vocab: must be an integer in"):
        deploy.reduce_draft_vocab(OmegaConf.merge(conf, {"draft_vocab": 129}), dparams, params, cfg, tmp_path)


def test_the_shipped_ranking_covers_smollm2s_vocabulary():
    path = dr.PACKAGED / "smollm2-135m-instruct-dflash-b16" / draft_vocab.RANKING_FILE
    ranking = draft_vocab.load_ranking(path, 49152)
    assert ranking.size == 49152  # every id, so any K in [1, 49152] is a prefix


def _run(*overrides, cwd):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "target=tiny_random",
                           "bench=default", *overrides], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("overrides, line", [
    (("drafter=random", "decoding=stock", "drafter.draft_vocab=0"),
     "config error: drafter.draft_vocab: must be >= 1 (or null for the full vocabulary), got 0"),
    (("drafter=oracle", "decoding=stock", "drafter.tau=2", "drafter.block_size=4", "drafter.draft_vocab=64"),
     "config error: drafter.draft_vocab: a 'oracle' drafter has no draft head to reduce (oracle drafters replay "
     "the target's tokens); set drafter.draft_vocab=null"),
    (("drafter=random", "decoding=stock", "drafter.draft_vocab_ids=x.npy"),
     "config error: drafter.draft_vocab_ids: names a ranking, but drafter.draft_vocab is null; set it, e.g. 8192")])
def test_bad_settings_fail_in_one_line_at_the_entry_point(overrides, line, tmp_path):
    proc = _run(*overrides, f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [line]


def test_a_reduced_vocabulary_run_is_checked_by_token_forcing(tmp_path):
    ranking = tmp_path / "ranking.npy"
    np.save(ranking, np.random.default_rng(0).permutation(512).astype(np.int32))
    out = tmp_path / "out"
    proc = _run("drafter=random", "decoding=stock", "drafter.num_layers=1", "drafter.block_size=4",
                "drafter.draft_vocab=64", f"drafter.draft_vocab_ids={ranking}", "bench.num_prompts=2",
                "bench.new_tokens=12", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}["stock"]
    assert stock["forcing"]["positions"] == 24 and stock["mismatches"] == 0
    assert stock["forcing"]["outputs_differ"] == 0 and "reduced draft vocabulary: the first 64 ids" in stock["notes"]
