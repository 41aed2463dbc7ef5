"""Hybrid target (Qwen3.5) against transformers, and its two recurrence forms against each other.

Reference: tiny random `Qwen3_5ForCausalLM` models (tests/hf_tiny_hybrid.py) on the torch CPU
fallbacks, float32. Written tolerances:
- LOGITS_ATOL = 3e-4 absolute on float32 logits of magnitude ~5-8 (measured worst 6.4e-5 over the
  cases at 150 tokens): ours and transformers' sum the same products in other orders.
- FORMS_ATOL = 1e-4 between our own chunked and recurrent forms (outputs and states of unit scale).
- BF16_FACTOR = 1.25: in bfloat16 our mean logit error against transformers' float32 run may be at
  most 1.25 x that of transformers' own bfloat16 run (both are rounding noise of similar size).
- Greedy tokens and the argmax of every position must be identical.
"""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_tiny_hybrid as hth
from specpilot import state as st
from specpilot.decoding import ar
from specpilot.models import checkpoint, hybrid
from specpilot.models import gated_deltanet as gdn

LOGITS_ATOL = 3e-4
FORMS_ATOL = 1e-4
BF16_FACTOR = 1.25


_LOADED = {}
FIRST, *OTHERS = hth.CASES


def _load(name, tmp_path_factory):
    """(name, transformers model, our target, our params) loaded from the saved checkpoint."""
    if name not in _LOADED:
        model = hth.build(name)
        path = hth.save(model, tmp_path_factory.mktemp(name))
        _LOADED[name] = (name, model, *checkpoint.load_target(path, jnp.float32))
    return _LOADED[name]


@pytest.fixture(scope="module", params=list(hth.CASES))
def any_case(request, tmp_path_factory):
    """Every case: the cheap checks run on all of them by default."""
    return _load(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[FIRST] + [pytest.param(n, marks=pytest.mark.slow) for n in OTHERS])
def case(request, tmp_path_factory):
    """The first case by default, the others under -m slow (each costs ~10 s of compiles)."""
    return _load(request.param, tmp_path_factory)


@functools.partial(jax.jit, static_argnums=0)
def _chain(target, params, tokens, state):
    return st.chain_forward(target, params, tokens, state)


@functools.partial(jax.jit, static_argnums=0)
def _prompt(target, params, tokens, lengths, state):
    """`st.prompt_forward` with the logits at every position (it keeps each prompt's last only)."""
    positions = st.chain_positions(state, tokens.shape[1])
    logits, taps, state = target.forward(params, tokens, positions, state, st.prompt_mask(state, positions, lengths))
    return logits, taps, state.commit(lengths)


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, hth.VOCAB, size=shape).astype(np.int32)


def test_loaded_config_matches_transformers(any_case):
    name, model, target, params = any_case
    cfg, hf = target.cfg, model.config
    assert isinstance(target, hybrid.Target) and target.dtype == "float32"
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"])
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head" in params) != cfg.tie_word_embeddings


@pytest.mark.parametrize("length", [1, 7, 150])  # 150: the chunked form over three chunks of 64
def test_prefill_logits_match_transformers(any_case, length):
    _, model, target, params = any_case
    tokens = _tokens((2, length))
    logits, _, _ = _chain(target, params, jnp.asarray(tokens), target.init_state(2, length + 8))
    ref = _hf_logits(model, tokens)
    np.testing.assert_allclose(np.asarray(logits), ref, atol=LOGITS_ATOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(logits).argmax(-1), ref.argmax(-1))


def test_padded_prompts_of_several_lengths_match_transformers(case):
    """One right-padded batch (prefill through the chunked form: T = 100 > max_block_size): each row's
    logits and next-step logits equal transformers' run of that prompt alone."""
    _, model, target, params = case
    lengths = np.array([100, 37, 70, 1], np.int32)
    tokens = _tokens((4, 100), seed=1)
    nxt = _tokens((4, 1), seed=2)
    logits, _, state = _prompt(target, params, jnp.asarray(tokens), jnp.asarray(lengths),
                               target.init_state(4, 128))
    step, _, _ = _chain(target, params, jnp.asarray(nxt), state)
    last, _, _ = jax.jit(st.prompt_forward, static_argnums=0)(target, params, jnp.asarray(tokens), jnp.asarray(lengths),
                                                              target.init_state(4, 128))
    for b, n in enumerate(lengths):
        ref = _hf_logits(model, tokens[b:b + 1, :n])
        np.testing.assert_allclose(np.asarray(last[b]), ref[0, n - 1], atol=LOGITS_ATOL, rtol=0)  # its head's one row
    for b, n in enumerate(lengths):
        ref = _hf_logits(model, np.concatenate([tokens[b:b + 1, :n], nxt[b:b + 1]], axis=1))
        np.testing.assert_allclose(np.asarray(logits[b, :n]), ref[0, :n], atol=LOGITS_ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(step[b, 0]), ref[0, n], atol=LOGITS_ATOL, rtol=0)


def test_a_prefill_in_chunks_matches_transformers(case):
    """Prompts fed 64 tokens a row per pass (`tokens_per_pass` small: three passes, rows ending in each,
    one in the first): each prompt's last logits and the next step's equal transformers' run of that
    prompt alone, so attention K/V and recurrent state carry across the passes and padding commits
    nothing."""
    _, model, target, params = case
    lengths = np.array([150, 37, 100, 70], np.int32)
    tokens = _tokens((4, 150), seed=4)
    nxt = _tokens((4, 1), seed=5)
    assert st.prefill_chunk(4, 150, 256, tokens_per_pass=64) == 64
    last, _, state = jax.jit(st.prompt_forward, static_argnums=(0, 5))(
        target, params, jnp.asarray(tokens), jnp.asarray(lengths), target.init_state(4, 256), 64)
    assert np.array_equal(np.asarray(state.lengths), lengths)
    step, _, _ = _chain(target, params, jnp.asarray(nxt), state)
    for b, n in enumerate(lengths):
        ref = _hf_logits(model, np.concatenate([tokens[b:b + 1, :n], nxt[b:b + 1]], axis=1))
        np.testing.assert_allclose(np.asarray(last[b]), ref[0, n - 1], atol=LOGITS_ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(step[b, 0]), ref[0, n], atol=LOGITS_ATOL, rtol=0)


def test_cached_decode_step_by_step_equals_the_full_forward(case):
    """Prefill 70 tokens (chunked), then 1-token steps (recurrent form, commit(1) each) reproduce the
    full forward's logits at every later position, ours and transformers'."""
    _, model, target, params = case
    tokens = _tokens((2, 90), seed=3)
    full, _, _ = _chain(target, params, jnp.asarray(tokens), target.init_state(2, 96))
    _, _, state = _chain(target, params, jnp.asarray(tokens[:, :70]), target.init_state(2, 96))
    state = state.commit(70)
    steps = []
    for i in range(70, 90):
        logits, _, state = _chain(target, params, jnp.asarray(tokens[:, i:i + 1]), state)
        state = state.commit(1)
        steps.append(np.asarray(logits[:, 0]))
    steps = np.stack(steps, axis=1)
    np.testing.assert_allclose(steps, np.asarray(full[:, 70:]), atol=FORMS_ATOL, rtol=0)
    np.testing.assert_allclose(steps, _hf_logits(model, tokens)[:, 70:], atol=LOGITS_ATOL, rtol=0)


def test_verification_snapshots_commit_any_prefix(case):
    """A 6-token forward then commit(n) leaves the state a forward of those n tokens leaves: the next
    token's logits agree for every n (per-row n too), with no re-run of the accepted tokens."""
    _, model, target, params = case
    tokens = _tokens((2, 40), seed=4)
    _, _, base = _prompt(target, params, jnp.asarray(tokens[:, :30]), jnp.asarray([30, 30]),
                         target.init_state(2, 48))
    _, _, verified = _chain(target, params, jnp.asarray(tokens[:, 30:36]), base)
    probe = jnp.asarray(tokens[:, 39:40])
    for n in ([1, 1], [3, 6], [6, 2], [0, 4]):
        n = jnp.asarray(n, jnp.int32)
        got, _, _ = _chain(target, params, probe, verified.commit(n))
        for b in range(2):
            k = int(n[b])
            ref = _hf_logits(model, np.concatenate([tokens[b:b + 1, :30 + k], tokens[b:b + 1, 39:40]], 1))
            np.testing.assert_allclose(np.asarray(got[b, 0]), ref[0, -1], atol=LOGITS_ATOL, rtol=0)


def test_greedy_generation_matches_transformers(case):
    _, model, target, params = case
    prompts = [[5, 17, 2, 99, 3], list(_tokens((1, 80), seed=5)[0])]  # 80: a padded, chunked prefill
    n = 40
    ours = ar.generate(target, params, prompts, n)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([prompt], dtype=torch.long)  # explicit mask: token 0 is no padding here
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, min_new_tokens=n)[0, len(prompt):].tolist()
        assert ours.tokens[b].tolist() == ref, f"prompt {b}"


# --------------------------------------------------------------------------------------------------
# The two forms of the gated delta rule, on random inputs


def _rule_inputs(b, t, h, dk, dv, seed):
    rng = np.random.default_rng(seed)
    q = gdn.l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) * dk ** -0.5
    k = gdn.l2_normalize(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32))
    v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 0.5, size=(b, t, h)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, size=(b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("t, chunk", [(1, 64), (37, 8), (64, 16), (130, 64)])
def test_chunked_form_equals_recurrent_form(t, chunk):
    q, k, v, g, beta, s0 = _rule_inputs(2, t, 3, 8, 12, seed=t)
    o_rec, states = jax.jit(gdn.recurrent_gated_delta_rule)(q, k, v, g, beta, s0)
    o_chunk, final = jax.jit(gdn.chunk_gated_delta_rule, static_argnums=6)(q, k, v, g, beta, s0, chunk)
    np.testing.assert_allclose(np.asarray(o_chunk), np.asarray(o_rec), atol=FORMS_ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(final), np.asarray(states[:, -1]), atol=FORMS_ATOL, rtol=0)


def test_recurrent_form_is_the_rule_as_written():
    """Brute force in float64 numpy: S_t = e^g S + beta k (v - (e^g S)^T k)^T, o_t = S_t^T q_t."""
    q, k, v, g, beta, s0 = _rule_inputs(1, 9, 2, 4, 5, seed=0)
    o, states = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0))
    for t in range(9):
        for h in range(2):
            decayed = np.exp(g[0, t, h]) * s[0, h]
            s[0, h] = decayed + beta[0, t, h] * np.outer(k[0, t, h], v[0, t, h] - decayed.T @ k[0, t, h])
            np.testing.assert_allclose(np.asarray(o[0, t, h]), s[0, h].T @ q[0, t, h], atol=1e-5)
        np.testing.assert_allclose(np.asarray(states[0, t]), s[0], atol=1e-5)


def test_skipped_tokens_leave_the_state_unchanged():
    """beta = g = 0 (how padding is skipped) is the identity on S in both forms."""
    q, k, v, g, beta, s0 = _rule_inputs(1, 20, 2, 4, 5, seed=1)
    live = (jnp.arange(20) < 11)[None, :, None]
    g, beta = jnp.where(live, g, 0.0), jnp.where(live, beta, 0.0)
    _, states = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    _, final = gdn.chunk_gated_delta_rule(q, k, v, g, beta, s0, 8)
    np.testing.assert_array_equal(np.asarray(states[:, 19]), np.asarray(states[:, 10]))
    np.testing.assert_allclose(np.asarray(final), np.asarray(states[:, 10]), atol=FORMS_ATOL, rtol=0)


def test_bfloat16_is_as_accurate_as_transformers_bfloat16(case):
    """At bf16, our logits' mean error against transformers' float32 logits is within BF16_FACTOR of
    transformers' own bf16 run's (measured: 0.056 vs 0.058 at logits ~7); state dtypes as designed."""
    _, model, target, params = case
    tokens = _tokens((2, 100), seed=6)
    ref32 = _hf_logits(model, tokens)
    with torch.no_grad():
        ref16 = copy.deepcopy(model).to(torch.bfloat16)(torch.tensor(tokens, dtype=torch.long))
    ref16 = ref16.logits.float().numpy()
    target16 = hybrid.target(target.cfg, jnp.bfloat16)
    params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
    state = target16.init_state(2, 104)
    logits, _, out = _chain(target16, params16, jnp.asarray(tokens), state)
    rec = next(layer for layer in out.layers if isinstance(layer, st.RecurrentState))
    assert rec.conv.dtype == jnp.bfloat16 and rec.matrix.dtype == jnp.float32
    ours = np.abs(np.asarray(logits, np.float32) - ref32).mean()
    theirs = np.abs(ref16 - ref32).mean()
    assert ours <= BF16_FACTOR * theirs, (ours, theirs)
