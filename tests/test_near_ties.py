"""Cross-dtype token forcing (experiments/bench/near_ties.py, forcing.force_paired) on a tiny random target:
the mismatches are exactly those a per-position comparison of the two dtypes' argmax finds, margins are
the top-1 minus top-2 gaps, and the failure rule splits at the stated margin."""

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import forcing
from specpilot.decoding import ar
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from helpers import random_params

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, qk_norm=True)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11, 12], [5, 60, 33, 2], [40, 41]]
N = 16
# Weights ~ N(0, 0.15), seed 1: logits spread thinly enough that bf16 and float32 part at a few positions.
STD, SEED = 0.15, 1


def _load_script():
    spec = importlib.util.spec_from_file_location("near_ties", ROOT / "experiments" / "bench" / "near_ties.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


near_ties = _load_script()


@pytest.fixture(scope="module")
def models():
    p32 = random_params(dense.param_shapes(CFG), STD, SEED)
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    return {"float32": (p32, dense.target(CFG, jnp.float32)),
            "bfloat16": (p16, dense.target(CFG, jnp.bfloat16))}


@pytest.fixture(scope="module")
def f32_tokens(models):
    return ar.generate(models["float32"][1], models["float32"][0], PROMPTS, N).tokens


def _logits(model, forced):
    tokens, lengths = ar.pack_prompts(PROMPTS, cache_len=max(map(len, PROMPTS)))
    return np.asarray(forcing.chunked_scorer(*model, chunk=1)(tokens, lengths, forced), np.float64)


def test_cross_dtype_mismatches_are_the_brute_force_argmax_disagreements(models, f32_tokens):
    paired = near_ties.force_direction(models["float32"], models["bfloat16"], PROMPTS, f32_tokens, 1.0)
    ref, cand = _logits(models["float32"], f32_tokens), _logits(models["bfloat16"], f32_tokens)
    want, agree = [], 0
    for b in range(len(PROMPTS)):
        for i in range(N):
            r, c = ref[b, i].tolist(), cand[b, i].tolist()
            r_tok, c_tok = r.index(max(r)), c.index(max(c))
            assert r_tok == f32_tokens[b, i]  # the float32 reference reproduces its own output
            if r_tok != c_tok:
                top = sorted(r)
                want.append((b, i, r_tok, c_tok, top[-1] - top[-2]))
            else:
                agree += 1
    assert want and agree, "the case must hold both disagreements and agreements"
    got = paired.mismatch_rows()
    assert [(m["prompt"], m["position"], m["reference_token"], m["candidate_token"]) for m in got] == \
        [w[:4] for w in want]
    for m, w in zip(got, want):
        assert m["reference_margin"] == pytest.approx(w[4], rel=1e-9, abs=1e-12)
        top = sorted(cand[m["prompt"], m["position"]].tolist())
        assert m["candidate_margin"] == pytest.approx(top[-1] - top[-2], rel=1e-9, abs=1e-12)
        assert m["near_tie"]
    assert paired.report.num_positions == len(PROMPTS) * N
    assert near_ties.self_mismatches(paired, f32_tokens) == []
    np.testing.assert_allclose(paired.max_abs_diff, np.abs(cand - ref).max(-1), rtol=1e-12)
    np.testing.assert_allclose(paired.reference_top, ref.max(-1), rtol=1e-12)


def test_failure_rule_splits_at_the_margin(models, f32_tokens):
    paired = near_ties.force_direction(models["float32"], models["bfloat16"], PROMPTS, f32_tokens, 1.0)
    margins = sorted(m["reference_margin"] for m in paired.mismatch_rows())
    assert margins
    assert near_ties.failures(paired, f32_tokens, margins[-1] * 1.001) == []
    at_largest = near_ties.failures(paired, f32_tokens, margins[-1])  # a margin equal to the threshold fails
    assert [f["reference_margin"] for f in at_largest] == [margins[-1]]
    assert len(near_ties.failures(paired, f32_tokens, margins[0] / 2)) == len(margins)


def _fixed(logits):
    return lambda tokens, lengths, forced: logits


def test_failure_rule_on_constructed_logits():
    """One flip at a reference margin of 0.3, one position of NaN logits: a near-tie under margin 0.5,
    a failure under 0.2; the NaN fails under any margin."""
    forced = np.array([[0, 1, 2, -1]])
    ref = np.full((1, 4, 5), -1.0, np.float32)
    ref[0, [0, 1, 2], [0, 1, 2]] = 2.0
    ref[0, 1, 3] = 1.7  # margin 0.3 between tokens 1 and 3
    cand = ref.copy()
    cand[0, 1, 3] = 2.1  # the candidate picks token 3
    paired = forcing.force_paired(_fixed(ref), _fixed(cand), [[4]], forced, tie_margin=0.5)
    assert paired.report.num_positions == 3 and not paired.checked[0, 3]
    (m,) = paired.mismatch_rows()
    assert (m["position"], m["reference_token"], m["candidate_token"]) == (1, 1, 3)
    assert m["reference_margin"] == pytest.approx(0.3, abs=1e-6) and m["near_tie"]
    assert m["candidate_margin"] == pytest.approx(0.1, abs=1e-6)
    assert near_ties.failures(paired, forced, 0.5) == []
    (f,) = near_ties.failures(paired, forced, 0.2)
    assert (f["kind"], f["position"]) == ("mismatch", 1)
    cand[0, 2, 4] = np.nan
    paired = forcing.force_paired(_fixed(ref), _fixed(cand), [[4]], forced, tie_margin=0.5)
    assert [(f["kind"], f["position"], f["side"]) for f in near_ties.failures(paired, forced, 10.0)] == \
        [("non_finite", 2, "candidate")]


def test_force_paired_rejects_choices_and_bad_shapes():
    forced = np.array([[0, 1]])
    logits = np.zeros((1, 2, 3), np.float32)
    with pytest.raises(ValueError, match="logits of one shape"):
        forcing.force_paired(_fixed(logits), _fixed(np.array([[0, 1]])), [[1]], forced)
    with pytest.raises(ValueError, match=r"forced tokens must be \[prompts, N\]"):
        forcing.force_paired(_fixed(logits), _fixed(logits), [[1], [2]], forced)


def test_measure_both_directions_with_a_stop_token(models, f32_tokens, tmp_path):
    stop = int(f32_tokens[0, 5])  # row 0 ends at its sixth token (or earlier), others where it appears
    result = near_ties.measure(models, PROMPTS, N, stop, margin=1.0)
    json.dumps(result)  # the report is JSON as it is
    want_lengths = ar.stop_lengths(f32_tokens, np.full(len(PROMPTS), N), stop)
    assert want_lengths[0] <= 6 and result["generated"]["float32"] == int(want_lengths.sum())
    forward = result["directions"]["bfloat16 forced on float32 tokens"]
    backward = result["directions"]["float32 forced on bfloat16 tokens"]
    assert forward["positions"] == result["generated"]["float32"]
    assert backward["positions"] == result["generated"]["bfloat16"]
    assert not result["failed"] and forward["failures"] == [] == backward["failures"]
    for d in (forward, backward):
        hist = list(d["margin_histogram"].values())
        assert hist == sorted(hist) and hist[-1] <= d["positions"]
        assert d["near_ties"] == d["mismatches"] == len(d["mismatch_list"])
    # The histogram counts every checked position: recount the forward direction's from its logits.
    ref = _logits(models["float32"], np.where(np.arange(N) < want_lengths[:, None], f32_tokens, -1))
    margins = np.concatenate([forcing.top2_margin(ref[b, :n]) for b, n in enumerate(want_lengths)])
    assert forward["margin_histogram"] == {f"<{t:g}": int((margins < t).sum()) for t in near_ties.MARGIN_BINS}
    assert "bfloat16 forced on float32 tokens" in near_ties.format_summary(result)
