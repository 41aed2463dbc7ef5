"""Token forcing: agreeing methods pass; a perturbed candidate is flagged at the right positions;
non-finite logits fail however the tokens agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import forcing
from specpilot.decoding import ar
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from helpers import random_params

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=16, qk_norm=True)
TARGET = dense.target(CFG, jnp.float32)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11, 12]]
N = 12
PERTURBED_POSITION = 9  # absolute position whose logits the perturbed candidate corrupts


@pytest.fixture(scope="module")
def target():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    return ar.generate(TARGET, target, PROMPTS, N).tokens


@dataclasses.dataclass(frozen=True)
class PerturbedTarget(dense.Target):
    """The dense target, except logits at one absolute position are negated (argmax becomes argmin)."""

    def forward(self, params, tokens, positions, state, mask, logits_at=None):
        logits, taps, state = super().forward(params, tokens, positions, state, mask, logits_at=logits_at)
        at = dense.at_positions(positions, logits_at)  # the positions the logits are at
        return jnp.where((at == PERTURBED_POSITION)[..., None], -logits, logits), taps, state


def test_block_verification_numerics_agree_with_ar(target, ar_tokens):
    reference = forcing.chunked_scorer(target, TARGET, chunk=1)
    for chunk in (4, None):
        report = forcing.force(reference, forcing.chunked_scorer(target, TARGET, chunk=chunk), PROMPTS,
                               ar_tokens)
        assert report.passed, report.summary()
        assert report.num_positions == len(PROMPTS) * N


def test_perturbed_candidate_is_flagged_at_the_right_position(target, ar_tokens):
    reference = forcing.chunked_scorer(target, TARGET, chunk=1)
    ref_logits = reference(*ar.pack_prompts(PROMPTS, 6), ar_tokens)
    candidate = forcing.chunked_scorer(target, PerturbedTarget(CFG, "float32"), chunk=4)
    report = forcing.force(reference, candidate, PROMPTS, ar_tokens, tie_margin=1e-3)
    assert not report.passed and report.reference_self_mismatches == 0
    assert "disagrees with itself" not in report.summary()
    for b, prompt in enumerate(PROMPTS):
        # Logits at absolute position P - 1 + i predict generated token i.
        want = PERTURBED_POSITION - len(prompt) + 1
        p = report.prompts[b]
        assert (p.first_mismatch, p.num_mismatches) == (want, 1), report.summary()
        m = p.mismatches[0]
        assert m.reference_token == ar_tokens[b, want]
        assert m.candidate_token == int(np.argmin(ref_logits[b, want]))
        assert m.reference_margin == pytest.approx(forcing.top2_margin(ref_logits[b, want]))
        assert m.reference_margin > 1e-3 and not m.near_tie
    assert "first mismatch at" in report.summary()


def test_near_ties_are_counted_separately_never_dropped():
    forced = np.array([[0, 1, 2, 3, -1, -1]])  # -1: unfilled output ends the check
    ref = np.zeros((1, 6, 4), np.float32)
    ref[0, np.arange(4), [0, 1, 2, 3]] = 1.0
    ref[0, 1, 2] = 1.0 - 1e-5  # a near-tie between tokens 1 and 2 at position 1
    choices = np.array([[0, 2, 2, 1, 3, 3]])  # a choices-only candidate (no logits)
    report = forcing.compare(ref, choices, forced, tie_margin=1e-4)
    p = report.prompts[0]
    assert p.num_positions == 4
    assert [m.position for m in p.mismatches] == [1, 3]
    assert (p.num_near_ties, p.num_hard_mismatches) == (1, 1)
    assert p.margins[0] == pytest.approx(1e-5, rel=1e-2) and p.margins[1] == pytest.approx(1.0)
    assert not report.passed and not report.passed_up_to_ties
    report = forcing.compare(ref, np.array([[0, 2, 2, 3, 0, 0]]), forced, tie_margin=1e-4)
    assert report.passed_up_to_ties and not report.passed and report.num_near_ties == 1


def test_reference_inconsistent_with_forced_tokens_is_reported(target, ar_tokens):
    scorer = forcing.chunked_scorer(target, TARGET, chunk=4)
    wrong = ar_tokens.copy()
    wrong[:, 5] = (wrong[:, 5] + 1) % CFG.vocab_size
    report = forcing.force(scorer, scorer, PROMPTS, wrong)
    # Later positions are conditioned on the altered token, so they may disagree too.
    assert report.reference_self_mismatches >= 2 and report.num_mismatches >= 2
    assert [p.first_mismatch for p in report.prompts] == [5, 5] and not report.passed
    assert (f"the reference disagrees with itself at {report.reference_self_mismatches} positions"
            in report.summary().splitlines()[1])


def test_non_finite_logits_fail_even_when_tokens_agree(target):
    """A NaN weight makes every logit NaN: generation emits token 0 and both sides agree on it, yet
    forcing must fail, naming the positions and that the logits were not finite."""
    broken = jax.tree.map(lambda x: x, target)
    broken["layers"] = (dict(broken["layers"][0], o=broken["layers"][0]["o"].at[0, 0].set(jnp.nan)),
                        *broken["layers"][1:])
    tokens = ar.generate(TARGET, broken, PROMPTS, N).tokens
    assert (tokens == 0).all()  # what a NaN model emits: the argmax of all-NaN logits
    scorer = forcing.chunked_scorer(broken, TARGET, chunk=4)
    report = forcing.force(forcing.chunked_scorer(broken, TARGET, chunk=1), scorer, PROMPTS, tokens)
    assert report.num_mismatches == 0 and report.reference_self_mismatches == 0  # tokens agree
    assert not report.passed and not report.passed_up_to_ties
    assert report.num_non_finite == len(PROMPTS) * N
    assert [n.position for n in report.prompts[0].non_finite] == list(range(N))
    assert {n.side for p in report.prompts for n in p.non_finite} == {"both"}
    assert "non-finite logits (NaN or inf) at @0 (both)" in report.summary()


def test_non_finite_on_one_side_is_named():
    forced = np.array([[0, 1, 2]])
    ref = np.eye(3, dtype=np.float32)[None]  # [1, 3, 3]: argmax 0, 1, 2
    cand = ref.copy()
    cand[0, 1, 2] = np.inf  # candidate's logits at position 1 hold an infinity
    ref_bad = ref.copy()
    ref_bad[0, 2, 0] = np.nan
    report = forcing.compare(ref_bad, cand, forced)
    p = report.prompts[0]
    assert [(n.position, n.side) for n in p.non_finite] == [(1, "candidate"), (2, "reference")]
    assert not report.passed
    assert forcing.compare(ref, ref.copy(), forced).passed
