"""Autoregressive (AR) generation: the baseline every speedup is measured against.

Design choices:
- The default decode loop is one jitted `lax.fori_loop` over decode steps (cache donated): no
  per-token dispatch, which on a CPU or a small model would otherwise dominate the baseline and flatter
  every speculative method. `loop="host"` keeps the one-jitted-step-per-token loop (`ar_step`); it never
  reads a token back until the end, so steps queue asynchronously.
- Every jitted piece is compiled ahead of time for the call's shapes, so timings exclude compiles.
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
from specpilot.decoding.aot import CompileCache
from specpilot.decoding.sampling import GREEDY, SamplingConfig, resolve_key, sample
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


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def ar_decode_loop(params, cfg: ModelConfig, sampling: SamplingConfig, first: jax.Array, cache: KVCache,
                   keys: jax.Array):
    """All decode steps in one `lax.fori_loop`: first [B], keys [N-1] -> (tokens [B, N-1], cache)."""
    n = keys.shape[0]

    def body(i, carry):
        tok, cache, out = carry
        logits, _, cache = dense.forward(params, cfg, tok[:, None], cache)
        tok = sample(keys[i], logits[:, 0], sampling)
        return tok, cache.commit(1), out.at[:, i].set(tok)

    out = jnp.zeros((first.shape[0], n), jnp.int32)
    _, cache, out = jax.lax.fori_loop(0, n, body, (first, cache, out))
    return out, cache


LOOPS = ("fori", "host")
_CACHE = CompileCache()


def _compiled(fn, static: tuple, *args):
    """Ahead-of-time compiled `fn` for these shapes (static arguments follow the first argument)."""
    return _CACHE.get(fn, static, args, lambda: fn.lower(*args[:1], *static, *args[1:]))


def generate(params, cfg: ModelConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig = GREEDY, key: jax.Array | None = None,
             cache_len: int | None = None, cache_dtype=None, loop: str = "fori") -> GenerationResult:
    """Generate `max_new_tokens` tokens after each prompt (a list of token-id lists).

    loop="fori" runs every decode step inside one jitted `lax.fori_loop` (no per-token dispatch);
    loop="host" dispatches one jitted step per token from Python (never syncing until the end).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    key = resolve_key(key, sampling)
    cache_len = cache_len or default_cache_len(prompts, max_new_tokens)
    tokens, lengths = pack_prompts(prompts, cache_len, needed_after=max_new_tokens)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    dtype = cache_dtype or params["embed"].dtype
    b = len(prompts)
    keys = jax.random.split(key, max_new_tokens)
    cache_shape = jax.eval_shape(lambda: init_cache(cfg, b, cache_len, dtype))
    static = (cfg, sampling)
    prefill = _compiled(ar_prefill, static, params, tokens, lengths, cache_shape, keys[0])
    tok_shape = jax.ShapeDtypeStruct((b,), jnp.int32)
    if loop == "fori":
        decode = _compiled(ar_decode_loop, static, params, tok_shape, cache_shape, keys[1:])
    else:
        step = _compiled(ar_step, static, params, tok_shape, cache_shape, keys[0])
    cache = init_cache(cfg, b, cache_len, dtype)

    t0 = time.perf_counter()
    tok, _, cache = prefill(params, tokens, lengths, cache, keys[0])
    tok.block_until_ready()
    t1 = time.perf_counter()
    if loop == "fori":
        rest, cache = decode(params, tok, cache, keys[1:])
        generated = np.concatenate([np.asarray(tok)[:, None], np.asarray(rest)], axis=1)
    else:
        out = [tok]
        for i in range(1, max_new_tokens):
            tok, cache = step(params, tok, cache, keys[i])
            out.append(tok)
        generated = np.asarray(jnp.stack(out, axis=1))  # the loop's only device -> host transfer
    t2 = time.perf_counter()
    return GenerationResult(tokens=generated, prompt_lengths=np.asarray(lengths), prefill_s=t1 - t0,
                            decode_s=t2 - t1)
