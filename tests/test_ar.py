"""AR generation: cached decoding against a cache-free recomputation, batching, capacity errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.decoding import ar
from specpilot.decoding.sampling import SamplingConfig
from specpilot.models import dense
from specpilot.state import CacheOverflowError

_BACKEND_COMPILES = []  # names of backend compile events, as jax reports them
jax.monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: _BACKEND_COMPILES.append(name) if "backend_compile" in name else None)


def generate(params, cfg, *args, **kw):
    return ar.generate(dense.target(cfg, params["embed"].dtype), params, *args, **kw)


def _greedy_by_recompute(params, cfg, prompt, n):
    """Reference: recompute the whole sequence every step with a fresh cache (no incremental state)."""
    total = len(prompt) + n
    forward = jax.jit(dense.chain_forward, static_argnames="cfg")
    seq = list(prompt)
    for _ in range(n):
        # causal attention: the zero padding after the sequence cannot change logits inside it
        padded = jnp.asarray([seq + [0] * (total - len(seq))])
        logits, _, _ = forward(params, cfg, padded, dense.init_state(cfg, 1, total, jnp.float32))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_matches_recompute(tiny_cfg, tiny_params):
    prompts = [[1, 2, 3], [5, 9, 11, 40, 7, 3, 2]]
    res = generate(tiny_params, tiny_cfg, prompts, 12)
    for i, p in enumerate(prompts):
        assert res.tokens[i].tolist() == _greedy_by_recompute(tiny_params, tiny_cfg, p, 12)


def test_batch_equals_single(tiny_cfg, tiny_params):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    batched = generate(tiny_params, tiny_cfg, prompts, 10).tokens
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(batched[i], generate(tiny_params, tiny_cfg, [p], 10).tokens[0])


def test_sampling_is_reproducible_and_key_dependent(tiny_cfg, tiny_params):
    cfg = SamplingConfig(temperature=1.0, top_p=0.9)
    a = generate(tiny_params, tiny_cfg, [[1, 2]], 16, cfg, key=jax.random.key(3)).tokens
    b = generate(tiny_params, tiny_cfg, [[1, 2]], 16, cfg, key=jax.random.key(3)).tokens
    c = generate(tiny_params, tiny_cfg, [[1, 2]], 16, cfg, key=jax.random.key(4)).tokens
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    with pytest.raises(ValueError, match="PRNG key"):
        generate(tiny_params, tiny_cfg, [[1, 2]], 4, cfg)


def test_prompt_longer_than_cache_is_rejected(tiny_cfg, tiny_params):
    with pytest.raises(CacheOverflowError, match="cache holds 16"):
        generate(tiny_params, tiny_cfg, [list(range(1, 15))], 4, cache_len=16)
    # exactly fitting is fine
    res = generate(tiny_params, tiny_cfg, [list(range(1, 13))], 4, cache_len=16)
    assert res.tokens.shape == (1, 4)


def test_bad_prompts(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="empty"):
        generate(tiny_params, tiny_cfg, [[1], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny_params, tiny_cfg, [[1]], 0)


def test_host_loop_equals_fori_loop(tiny_cfg, tiny_params):
    cfg = SamplingConfig(temperature=0.8, top_k=20)
    a = generate(tiny_params, tiny_cfg, [[1, 2], [3]], 9, cfg, key=jax.random.key(5), loop="fori")
    b = generate(tiny_params, tiny_cfg, [[1, 2], [3]], 9, cfg, key=jax.random.key(5), loop="host")
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_fused_projections_give_the_same_logits(tiny_cfg, tiny_params):
    fused = dense.fuse_projections(tiny_params)
    assert "qkv" in fused["layers"][0] and "q" not in fused["layers"][0]
    tokens = jnp.asarray([[5, 7, 1, 3]])
    fresh = lambda: dense.init_state(tiny_cfg, 1, 8, jnp.float32)  # noqa: E731
    want, _, _ = dense.chain_forward(tiny_params, tiny_cfg, tokens, fresh())
    got, _, _ = dense.chain_forward(fused, tiny_cfg, tokens, fresh())
    # float32: the same dot products, only grouped into one matrix (differences are rounding only)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(generate(fused, tiny_cfg, [[1, 2, 3]], 12).tokens,
                                  generate(tiny_params, tiny_cfg, [[1, 2, 3]], 12).tokens)


def test_per_request_values_do_not_recompile_and_budgets_hold(tiny_cfg, tiny_params):
    """Budgets and temperatures are arrays: a second run with other values compiles nothing, row b
    emits exactly budget[b] tokens, and a temperature-0 row of a sampled batch is greedy exactly."""
    prompts = [[1, 2, 3], [4, 5], [6]]
    full = generate(tiny_params, tiny_cfg, prompts, 10).tokens
    sampled = SamplingConfig(temperature=1.0, top_p=0.9)
    for loop in ar.LOOPS:
        runs = [(np.array([10, 3, 7]), np.array([0.0, 0.7, 1.3]), np.array([1.0, 0.9, 0.5])),
                (np.array([2, 10, 1]), np.array([1.1, 0.0, 0.4]), np.array([0.8, 1.0, 1.0]))]
        sizes, compiles = [], []
        for budgets, temperature, top_p in runs:
            res = generate(tiny_params, tiny_cfg, prompts, 10, sampled, key=jax.random.key(1), loop=loop,
                           budgets=budgets, temperature=temperature, top_p=top_p)
            sizes.append(len(ar._CACHE))
            compiles.append(len(_BACKEND_COMPILES))
            np.testing.assert_array_equal(res.num_generated, budgets)
            for b, n in enumerate(budgets):
                assert (res.tokens[b, :n] >= 0).all() and (res.tokens[b, n:] == -1).all()
                if temperature[b] == 0:
                    np.testing.assert_array_equal(res.tokens[b, :n], full[b, :n])
        assert sizes[1] == sizes[0], f"loop={loop}: a run with other per-request values compiled"
        assert compiles[1] == compiles[0], f"loop={loop}: jax compiled during the second run"
    greedy = generate(tiny_params, tiny_cfg, prompts, 10, budgets=[4, 10, 2])
    np.testing.assert_array_equal(greedy.tokens[1], full[1])
    np.testing.assert_array_equal(greedy.tokens[0, :4], full[0, :4])
    with pytest.raises(ValueError, match="budget"):
        generate(tiny_params, tiny_cfg, prompts, 10, budgets=[4, 11, 2])
    with pytest.raises(ValueError, match="temperatures"):
        generate(tiny_params, tiny_cfg, prompts, 10, sampled, key=jax.random.key(1),
                 temperature=[1.0, -1.0, 1.0])


def test_position_limit_is_refused_before_anything_runs(tiny_cfg, tiny_params):
    cfg = dataclasses.replace(tiny_cfg, max_position_embeddings=16)
    with pytest.raises(ar.PositionLimitError, match=r"14 tokens\) plus 4 new tokens .* 18 positions.*"
                                                    r"max_position_embeddings \(16\)"):
        generate(tiny_params, cfg, [[1, 2], list(range(1, 15))], 4)
    with pytest.raises(ar.PositionLimitError,
                       match=r"20 tokens, past the model's max_position_embeddings \(16\)"):
        ar.pack_prompts([list(range(20))], cache_len=64, max_positions=16)
    res = generate(tiny_params, cfg, [list(range(1, 13))], 4)  # exactly at the limit runs
    assert res.tokens.shape == (1, 4)
