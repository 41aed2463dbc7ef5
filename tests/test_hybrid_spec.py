"""Speculative decoding on a hybrid target: verification commits per-position recurrent states.

Same strength as the dense tests (tests/test_spec.py, tests/test_rejection.py, tests/test_forcing.py):
greedy output equals AR token for token at every acceptance pattern; the block drafter taps the
hybrid's layers; speculative sampling matches the exact target distribution (chi-square, ALPHA);
token forcing at block size Bs agrees with AR-step forcing at every position.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import forcing
from specpilot import state as st
from specpilot.decoding import ar, spec
from specpilot.decoding.sampling import SamplingConfig, probabilities
from specpilot.models import drafter as dr
from specpilot.models import hybrid
from specpilot.models.hybrid_config import HybridConfig
from test_rejection import assert_distributed_as

CFG = HybridConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=16, partial_rotary_factor=0.5,
                   layer_types=("linear_attention", "full_attention", "linear_attention"),
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                   linear_value_head_dim=12, tap_layers=(0, 2))
TARGET = hybrid.target(CFG, jnp.float32)
PROMPTS = [[1, 2, 3], [5, 9, 11, 40, 7, 3, 2, 8, 8, 1, 60], [17, 4, 99, 23, 5, 6] * 4]  # 24 > 16
N = 24
EXTRA = 17


def hybrid_params(cfg, seed, std=0.5):
    """hybrid.init with a slow decay (A = e^-2 ~ 0.14 per softplus unit): state is carried over many
    tokens, so a wrongly committed recurrent state changes later tokens."""
    params = hybrid.init(jax.random.key(seed), cfg, jnp.float32, std)
    layers = tuple(dict(p, A_log=jnp.full_like(p["A_log"], -2.0)) if "A_log" in p else p
                   for p in params["layers"])
    return dict(params, layers=layers)


@pytest.fixture(scope="module")
def target():
    return hybrid_params(CFG, 0)


@pytest.fixture(scope="module")
def ar_tokens(target):
    return ar.generate(TARGET, target, PROMPTS, N + EXTRA).tokens


@pytest.fixture(scope="module")
def reference(ar_tokens):
    return jnp.asarray(dr.replay_reference(PROMPTS, ar_tokens.tolist()))


def test_the_recurrent_state_matters(target, ar_tokens):
    """Greedy decoding from a state whose recurrent layers are reset to zero after the prompt diverges:
    the tests below would catch a dropped or wrong recurrent commit."""
    # jitted: one compile per program instead of one per op (eager dispatch of the hybrid is slow on CPU)
    prompt_forward = jax.jit(lambda p, t, n, s: st.prompt_forward(TARGET, p, t, n, s))
    chain_forward = jax.jit(lambda p, t, s: st.chain_forward(TARGET, p, t, s)[0])
    tokens, lengths = ar.pack_prompts(PROMPTS, 64)
    _, _, state = prompt_forward(target, jnp.asarray(tokens), jnp.asarray(lengths), TARGET.init_state(3, 64))
    zeroed = st.TargetState(tuple(dataclasses.replace(l, matrix=jnp.zeros_like(l.matrix))
                                  if isinstance(l, st.RecurrentState) else l for l in state.layers),
                            state.lengths)
    first = jnp.asarray(ar_tokens[:, :1])  # greedy AR's first token after each prompt
    good = chain_forward(target, first, state)
    bad = chain_forward(target, first, zeroed)
    assert (np.asarray(good).argmax(-1) == ar_tokens[:, 1:2]).all()
    assert (np.asarray(bad).argmax(-1) != ar_tokens[:, 1:2]).any()


@pytest.mark.parametrize("block_size", [1, 3, 8, 16]
                         + [pytest.param(b, marks=pytest.mark.slow) for b in (2, 4, 5, 6, 7, 11, 13)])
def test_greedy_equals_ar(target, ar_tokens, reference, block_size):
    # Every third position drafted wrong: acceptance lengths vary inside a run and across the batch.
    drafter = dr.ReplayDrafter(CFG.vocab_size, 16, shift=1, wrong_every=3)
    res = spec.generate(TARGET, target, drafter, reference, PROMPTS, N, block_size=block_size)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    if block_size > 2:
        assert 1.0 < res.stats.tau < block_size


@pytest.mark.parametrize("block_size", [2, 7, 16])
def test_block_drafter_taps_the_hybrid_and_greedy_equals_ar(target, ar_tokens, block_size):
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=16)
    assert dcfg.target_tap_layers == CFG.tap_layers
    drafter = dr.BlockDrafter(dcfg, CFG)
    dparams = dr.init(jax.random.key(1), dcfg, jnp.float32, 0.5)
    res = spec.generate(TARGET, target, drafter, dparams, PROMPTS, N, block_size=block_size)
    np.testing.assert_array_equal(res.tokens, ar_tokens[:, :N])
    assert res.stats.tau >= 1.0


@pytest.mark.slow  # over ~12 s on 2 cores; the default suite keeps its faster siblings
def test_oracle_and_always_wrong_drafters(target, ar_tokens, reference):
    oracle = spec.generate(TARGET, target, dr.ReplayDrafter(CFG.vocab_size, 8), reference, PROMPTS, 17)
    np.testing.assert_array_equal(oracle.tokens, ar_tokens[:, :17])
    assert oracle.stats.tau == 8 and oracle.stats.num_steps == 2
    wrong = spec.generate(TARGET, target, dr.ReplayDrafter(CFG.vocab_size, 6, shift=1), reference,
                          PROMPTS, N)
    np.testing.assert_array_equal(wrong.tokens, ar_tokens[:, :N])
    assert wrong.stats.tau == 1.0


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_loops_agree(target, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 7, shift=1, wrong_every=4)
    runs = [spec.generate(TARGET, target, drafter, reference, PROMPTS, N, loop=loop) for loop in spec.LOOPS]
    runs.append(spec.generate(TARGET, target, drafter, reference, PROMPTS, N, profile=True))
    for r in runs[1:]:
        np.testing.assert_array_equal(r.tokens, runs[0].tokens)
        np.testing.assert_array_equal(r.stats.accept_hist, runs[0].stats.accept_hist)


def test_block_past_the_targets_snapshots_is_refused(target, reference):
    small = hybrid.target(CFG, jnp.float32, max_block_size=4)
    with pytest.raises(ValueError, match="block size 5 exceeds the target's max_block_size 4"):
        spec.generate(small, target, dr.ReplayDrafter(CFG.vocab_size, 5), reference, PROMPTS, 4)


def test_forcing_at_block_size_agrees_with_ar_steps(target, ar_tokens):
    """Forced AR output scored one token at a time and Bs at a time (verification numerics). The
    prompts are padded to the longest (11 <= max_block_size tokens: the recurrent form, which keeps
    every per-token state, so the shorter prompt ends on its own state)."""
    forced = ar_tokens[:2, :N]
    reference = forcing.chunked_scorer(target, TARGET, chunk=1)
    for bs in (4, 16):
        report = forcing.force(reference, forcing.chunked_scorer(target, TARGET, chunk=bs), PROMPTS[:2],
                               forced)
        assert report.passed, report.summary()
        assert report.num_positions == 2 * N


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_forcing_long_prompts_of_unequal_length(target, ar_tokens):
    report = forcing.force(forcing.chunked_scorer(target, TARGET, chunk=1),
                           forcing.chunked_scorer(target, TARGET, chunk=4), PROMPTS, ar_tokens[:, :N])
    assert report.passed, report.summary()


# --------------------------------------------------------------------------------------------------
# Rejection sampling keeps the hybrid target's distribution


SMALL = HybridConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=16, layer_types=("linear_attention", "full_attention"),
                     linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                     linear_value_head_dim=8, tap_layers=(0, 1))


def _exact_joint(target, params, prompt, sampling):
    """p(t1, t2, t3 | prompt) under the sampling transform, by scoring every 2-token continuation."""
    v = SMALL.vocab_size
    t1, t2 = np.divmod(np.arange(v * v), v)
    seqs = np.concatenate([np.tile(prompt, (v * v, 1)), t1[:, None], t2[:, None]], 1)
    logits, _, _ = st.chain_forward(target, params, jnp.asarray(seqs, jnp.int32),
                                    target.init_state(v * v, seqs.shape[1]))
    p = np.asarray(probabilities(logits[:, len(prompt) - 1:], sampling), np.float64)  # [V*V, 3, V]
    joint = p[0, 0][:, None, None] * p[np.arange(v) * v, 1][:, :, None] * p.reshape(v, v, 3, v)[:, :, 2]
    return joint.reshape(-1)


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_spec_sampling_matches_the_hybrid_distribution_end_to_end():
    params = hybrid_params(SMALL, 3, std=0.3)
    target = hybrid.target(SMALL, jnp.float32, max_block_size=3)
    dcfg = dr.DrafterConfig.for_target(SMALL, num_layers=1, block_size=3)
    drafter = dr.BlockDrafter(dcfg, SMALL)
    dparams = dr.init(jax.random.key(4), dcfg, jnp.float32, 0.3)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    prompt, n = [1, 2, 3], 4000
    want = _exact_joint(target, params, prompt, sampling)
    res = spec.generate(target, params, drafter, dparams, [prompt] * n, 3, sampling=sampling,
                        key=jax.random.key(5), cache_len=7)
    assert_distributed_as(res.tokens @ np.array([64, 8, 1]), want, "speculative (t1, t2, t3)")
    assert res.stats.accept_hist[0] > 0 and res.stats.accept_hist[1:].sum() > 0
    ar_res = ar.generate(target, params, [prompt] * n, 3, sampling, key=jax.random.key(6), cache_len=6)
    assert_distributed_as(ar_res.tokens @ np.array([64, 8, 1]), want, "AR (t1, t2, t3)")


def test_params_that_do_not_fit_the_target_are_refused(target, reference):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4)
    with pytest.raises(ValueError, match="for float32 activations but the params' embedding is bfloat16"):
        ar.generate(TARGET, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), target), PROMPTS, 2)
    swapped = dict(target, layers=(target["layers"][1], target["layers"][0], target["layers"][2]))
    with pytest.raises(ValueError, match=r"layer 0 \(linear_attention\) params"):
        spec.generate(TARGET, swapped, drafter, reference, PROMPTS, 4)
    with pytest.raises(ValueError, match="params have 2 layers, the config 3"):
        ar.generate(TARGET, dict(target, layers=target["layers"][:2]), PROMPTS, 2)
