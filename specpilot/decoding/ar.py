"""Autoregressive (AR) generation: the baseline every speedup is measured against.

Design choices:
- One jitted `ar_step` = target decode step + token choice, cache donated. The host loop only
  dispatches; it never reads a token back until the loop ends, so steps queue asynchronously and the
  loop costs no host-device round trip per token.
- Prompts are right-padded to a bucketed length (`pack_prompts`) so a new prompt length does not
  recompile prefill; padding positions are written but never committed.
- Capacity is checked on the host before anything runs: prompt + new tokens must fit the cache.
- Timings: prefill (until its first token is ready) and decode (the remaining steps) separately; decode
  time per output token = decode time / (new tokens - 1), since the first token comes from prefill.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.cache import KVCache, check_capacity, init_cache
from specpilot.decoding.sampling import GREEDY, SamplingConfig, sample
from specpilot.models import dense
from specpilot.models.config import ModelConfig

PREFILL_BUCKET = 64


@dataclasses.dataclass
class GenerationResult:
    tokens: np.ndarray  # [B, N] generated token ids (prompt excluded)
    prompt_lengths: np.ndarray  # [B]
    prefill_s: float
    decode_s: float

    @property
    def num_new_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def decode_time_per_token(self) -> float:
        steps = self.num_new_tokens - 1
        return self.decode_s / steps if steps > 0 else float("nan")

    def as_lists(self, eos_token_id: int | None = None) -> list[list[int]]:
        """Generated tokens per sequence, cut after the first EOS if one is given."""
        out = []
        for row in self.tokens.tolist():
            if eos_token_id is not None and eos_token_id in row:
                row = row[: row.index(eos_token_id) + 1]
            out.append(row)
        return out


def pack_prompts(prompts: Sequence[Sequence[int]], cache_len: int, needed_after: int = 0,
                 bucket: int = PREFILL_BUCKET) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token-id prompts to a bucketed length -> (tokens [B, T] int32, lengths [B] int32).

    Raises a clear error for an empty prompt or when a prompt plus `needed_after` positions exceeds
    `cache_len`.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty; every prompt needs >= 1 token")
    longest = int(lengths.max())
    check_capacity(cache_len, longest + needed_after,
                   f"the longest prompt ({longest} tokens) plus {needed_after} generated positions")
    padded = min(-(-longest // bucket) * bucket, cache_len)
    tokens = np.zeros((len(prompts), padded), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = np.asarray(p, np.int32)
    return tokens, lengths


def default_cache_len(prompts: Sequence[Sequence[int]], max_new_tokens: int, extra: int = 0,
                      multiple: int = 128) -> int:
    need = max(len(p) for p in prompts) + max_new_tokens + extra
    return -(-need // multiple) * multiple


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def ar_step(params, cfg: ModelConfig, sampling: SamplingConfig, tokens: jax.Array, cache: KVCache,
            key: jax.Array):
    """tokens [B] -> (next tokens [B], cache committed by one)."""
    logits, _, cache = dense.forward(params, cfg, tokens[:, None], cache)
    return sample(key, logits[:, 0], sampling), cache.commit(1)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def ar_prefill(params, cfg: ModelConfig, sampling: SamplingConfig, tokens: jax.Array,
               lengths: jax.Array, cache: KVCache, key: jax.Array):
    """Prompt pass + first token: -> (first tokens [B], taps [B, T, n*H], committed cache)."""
    logits, taps, cache = dense.prefill(params, cfg, tokens, lengths, cache)
    return sample(key, logits, sampling), taps, cache


_WARM: set = set()


def _warm_up(params, cfg, sampling, tokens, lengths, cache_len, dtype):
    """Compile prefill and step once per signature on a throwaway cache, so timings exclude compiles."""
    sig = (cfg, sampling, tokens.shape, cache_len, jnp.dtype(dtype).name,
           tuple((x.shape, x.dtype.name) for x in jax.tree.leaves(params)))
    if sig in _WARM:
        return
    cache = init_cache(cfg, tokens.shape[0], cache_len, dtype)
    key = jax.random.key(0)
    tok, _, cache = ar_prefill(params, cfg, sampling, jnp.asarray(tokens), jnp.asarray(lengths), cache,
                               key)
    tok, cache = ar_step(params, cfg, sampling, tok, cache, key)
    tok.block_until_ready()
    _WARM.add(sig)


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig = GREEDY, key: jax.Array | None = None,
             cache_len: int | None = None, cache_dtype=None) -> GenerationResult:
    """Generate `max_new_tokens` tokens after each prompt (a list of token-id lists)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if key is None:
        if not sampling.greedy:
            raise ValueError("sampling needs an explicit PRNG key (key=jax.random.key(seed))")
        key = jax.random.key(0)
    cache_len = cache_len or default_cache_len(prompts, max_new_tokens)
    tokens, lengths = pack_prompts(prompts, cache_len, needed_after=max_new_tokens)
    dtype = cache_dtype or params["embed"].dtype
    cache = init_cache(cfg, len(prompts), cache_len, dtype)
    keys = jax.random.split(key, max_new_tokens)
    _warm_up(params, cfg, sampling, tokens, lengths, cache_len, dtype)

    t0 = time.perf_counter()
    tok, _, cache = ar_prefill(params, cfg, sampling, jnp.asarray(tokens), jnp.asarray(lengths),
                               cache, keys[0])
    tok.block_until_ready()
    t1 = time.perf_counter()
    out = [tok]
    for i in range(1, max_new_tokens):
        tok, cache = ar_step(params, cfg, sampling, tok, cache, keys[i])
        out.append(tok)
    generated = np.asarray(jnp.stack(out, axis=1))  # the loop's only device -> host transfer
    t2 = time.perf_counter()
    return GenerationResult(tokens=generated, prompt_lengths=lengths, prefill_s=t1 - t0,
                            decode_s=t2 - t1)
