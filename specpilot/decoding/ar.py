"""Autoregressive (AR) generation: the baseline every speedup is measured against.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.profiler import TraceAnnotation

from specpilot.decoding.aot import CompileCache
from specpilot.sharding import host_array
from specpilot.decoding.sampling import GREEDY, RequestSampling, SamplingConfig, resolve_key, sample
from specpilot.state import TargetState, chain_forward, check_capacity, prompt_forward

PREFILL_BUCKET = 64


@dataclasses.dataclass
class GenerationResult:
    tokens: np.ndarray  # [B, N] generated token ids (prompt excluded)
    prompt_lengths: np.ndarray  # [B]
    prefill_s: float
    decode_s: float
    budgets: np.ndarray | None = None  # [B] new-token budget per request (None: N for every row)
    num_generated: np.ndarray | None = None  # [B] tokens generated per row (the rest read -1)
    stop_token: int | None = None  # the id that ended rows early, if the call had one

    @property
    def num_new_tokens(self) -> int:
        return self.tokens.shape[1]

    @property
    def decode_steps(self) -> int:
        """Output tokens of the longest row after prefill's first: its budget - 1, or with a stop token
        its num_generated - 1 (the longest row may stop before its budget)."""
        if self.stop_token is not None and self.num_generated is not None:
            longest = int(np.max(self.num_generated))
        else:
            longest = self.num_new_tokens if self.budgets is None else int(np.max(self.budgets))
        return longest - 1

    @property
    def decode_time_per_token(self) -> float:
        """Decode time / decode steps of the longest request (`decode_steps`)."""
        steps = self.decode_steps
        return self.decode_s / steps if steps > 0 else float("nan")

    def as_lists(self, eos_token_id: int | None = None) -> list[list[int]]:
        """Generated tokens per sequence (unfilled -1 dropped), cut after the first EOS if one is given."""
        out = []
        for row in self.tokens.tolist():
            row = [t for t in row if t >= 0]
            if eos_token_id is not None and eos_token_id in row:
                row = row[: row.index(eos_token_id) + 1]
            out.append(row)
        return out


class PositionLimitError(ValueError):
    """A prompt or a generation would run past the model's max_position_embeddings."""


def pack_prompts(prompts: Sequence[Sequence[int]], cache_len: int, needed_after: int = 0,
                 bucket: int = PREFILL_BUCKET, max_positions: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token-id prompts to a bucketed length -> (tokens [B, T] int32, lengths [B] int32).

    Raises a clear error for an empty prompt, when a prompt plus `needed_after` positions exceeds
    `cache_len`, or when a prompt is longer than `max_positions` (the model's position limit).
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompts], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty; every prompt needs >= 1 token")
    longest = int(lengths.max())
    if max_positions is not None and longest > max_positions:
        raise PositionLimitError(
            f"prompt {int(np.argmax(lengths))} has {longest} tokens, past the model's "
            f"max_position_embeddings ({max_positions})")
    check_capacity(cache_len, longest + needed_after,
                   f"the longest prompt ({longest} tokens) plus {needed_after} generated positions")
    padded = min(-(-longest // bucket) * bucket, cache_len)
    tokens = np.zeros((len(prompts), padded), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = np.asarray(p, np.int32)
    return tokens, lengths


def check_position_limit(prompts: Sequence[Sequence[int]], budgets: np.ndarray, max_positions: int) -> None:
    """Refuse, on the host, a request whose prompt plus new tokens exceeds max_positions."""
    total = np.array([len(p) for p in prompts]) + np.asarray(budgets)
    if (total > max_positions).any():
        b = int(np.argmax(total))
        raise PositionLimitError(
            f"prompt {b} ({len(prompts[b])} tokens) plus {int(budgets[b])} new tokens is a sequence of "
            f"{int(total[b])} positions, past the model's max_position_embeddings ({max_positions})")


def request_budgets(budgets, max_new_tokens: int, batch_size: int) -> np.ndarray:
    """[B] int32 new-token budgets (default: max_new_tokens each), each in [1, max_new_tokens]."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if budgets is None:
        return np.full((batch_size,), max_new_tokens, np.int32)
    out = np.asarray(budgets, np.int32)
    if out.shape != (batch_size,):
        raise ValueError(f"budgets must have shape ({batch_size},), got {out.shape}")
    if (out < 1).any() or (out > max_new_tokens).any():
        raise ValueError(f"every budget must be in [1, max_new_tokens={max_new_tokens}], got {out.tolist()}")
    return out


def default_cache_len(prompts: Sequence[Sequence[int]], max_new_tokens: int, extra: int = 0,
                      multiple: int = 128) -> int:
    need = max(len(p) for p in prompts) + max_new_tokens + extra
    return -(-need // multiple) * multiple


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("state",))
def ar_step(target, params, sampling: RequestSampling, tokens: jax.Array, state: TargetState,
            key: jax.Array):
    """tokens [B] -> (next tokens [B], state committed by one)."""
    logits, _, state = chain_forward(target, params, tokens[:, None], state)
    return sample(key, logits[:, 0], sampling), state.commit(1)


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("state",))
def ar_prefill(target, params, sampling: RequestSampling, tokens: jax.Array, lengths: jax.Array,
               state: TargetState, key: jax.Array):
    """Prompt pass + first token: -> (first tokens [B], taps [B, T, n*H], committed state)."""
    last, taps, state = prompt_forward(target, params, tokens, lengths, state)
    return sample(key, last, sampling), taps, state


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("state",))
def ar_decode_loop(target, params, sampling: RequestSampling, first: jax.Array, state: TargetState,
                   keys: jax.Array, num_steps: jax.Array):
    """num_steps (<= N-1, traced) decode steps in one `lax.fori_loop`: first [B], keys [N-1]
    -> (tokens [B, N-1], state); columns past num_steps stay 0."""

    def body(i, carry):
        tok, state, out = carry
        logits, _, state = chain_forward(target, params, tok[:, None], state)
        tok = sample(keys[i], logits[:, 0], sampling)
        return tok, state.commit(1), out.at[:, i].set(tok)

    out = jnp.zeros((first.shape[0], keys.shape[0]), jnp.int32)
    _, state, out = jax.lax.fori_loop(0, num_steps, body, (first, state, out))
    return out, state


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("state",))
def ar_decode_until_stop(static, params, sampling: RequestSampling, first: jax.Array, state: TargetState,
                         keys: jax.Array, budgets: jax.Array):
    """Decode steps in one `lax.while_loop` until every row has emitted the stop token or reached its
    budget: static (target, stop_token), first [B], keys [N-1], budgets [B] -> (tokens [B, N-1], state).
    A finished row keeps stepping with the batch; its later tokens are the caller's to discard
    (`stop_lengths`); columns past the last step stay -1."""
    target, stop_token = static

    def cond(carry):
        i, _, _, _, done = carry
        return (i < keys.shape[0]) & ~jnp.all(done)

    def body(carry):
        i, tok, state, out, done = carry
        logits, _, state = chain_forward(target, params, tok[:, None], state)
        tok = sample(keys[i], logits[:, 0], sampling)
        done = done | (tok == stop_token) | (i + 2 >= budgets)  # i + 2 tokens generated after this step
        return i + 1, tok, state.commit(1), out.at[:, i].set(tok), done

    out = jnp.full((first.shape[0], keys.shape[0]), -1, jnp.int32)
    done = (first == stop_token) | (budgets <= 1)
    _, _, state, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), first, state, out, done))
    return out, state


def stop_lengths(tokens: np.ndarray, budgets: np.ndarray, stop_token: int | None) -> np.ndarray:
    """[B] tokens each row keeps: its budget, or up to and including its first `stop_token` within it."""
    budgets = np.asarray(budgets)
    if stop_token is None:
        return budgets.copy()
    hit = (np.asarray(tokens) == stop_token) & (np.arange(tokens.shape[1])[None, :] < budgets[:, None])
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, budgets).astype(budgets.dtype)


def check_stop_token(stop_token, vocab_size: int) -> int | None:
    """The stop token as an int in [0, vocab_size), or None; anything else is refused."""
    if stop_token is None:
        return None
    if isinstance(stop_token, bool) or not isinstance(stop_token, (int, np.integer)):
        raise ValueError(f"stop_token must be one token id (an int) or None, got {stop_token!r}")
    if not 0 <= int(stop_token) < vocab_size:
        raise ValueError(f"stop_token {int(stop_token)} is not a token id of this target "
                         f"(vocabulary of {vocab_size})")
    return int(stop_token)


LOOPS = ("fori", "host")
_CACHE = CompileCache()


def _compiled(fn, static, *args):
    """Ahead-of-time compiled `fn` for these shapes (the static argument comes first)."""
    return _CACHE.get(fn, static, args, lambda *a: fn.lower(static, *a))


def generate(target, params, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             sampling: SamplingConfig = GREEDY, key: jax.Array | None = None,
             cache_len: int | None = None, cache_dtype=None, loop: str = "fori", *,
             budgets=None, temperature=None, top_p=None, stop_token: int | None = None
             ) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens after each prompt (a list of token-id lists).

    `budgets` [B]: new tokens per request (default max_new_tokens each); `temperature` / `top_p` [B]:
    per-request values in place of `sampling`'s (its top_k applies to all). Changing any of them
    reuses the compiled steps. loop="fori" runs every decode step inside one jitted `lax.fori_loop`
    (no per-token dispatch); loop="host" dispatches one jitted step per token from Python (never
    syncing until the end). `stop_token`: a row ends right after emitting this id (kept as its last
    token); the decode ends when every row has (a while loop, or read-backs one step behind).
    """
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    b = len(prompts)
    budgets = request_budgets(budgets, max_new_tokens, b)
    requests = sampling.for_requests(b, temperature, top_p)
    key = resolve_key(key, requests)
    target.check_params(params)
    stop_token = check_stop_token(stop_token, target.vocab_size)
    check_position_limit(prompts, budgets, target.max_positions)
    cache_len = cache_len or default_cache_len(prompts, max_new_tokens)
    tokens, lengths = pack_prompts(prompts, cache_len, needed_after=max_new_tokens,
                                   max_positions=target.max_positions)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    dtype = cache_dtype or target.dtype
    keys = jax.random.split(key, max_new_tokens)
    num_steps = int(budgets.max()) - 1
    state_shape = jax.eval_shape(lambda: target.init_state(b, cache_len, dtype))
    prefill = _compiled(ar_prefill, target, params, requests, tokens, lengths, state_shape, keys[0])
    tok_shape = jax.ShapeDtypeStruct((b,), jnp.int32)
    steps_arg = jnp.int32(num_steps)
    if loop == "fori" and stop_token is not None:
        decode = _compiled(ar_decode_until_stop, (target, stop_token), params, requests, tok_shape,
                           state_shape, keys[1:], jnp.asarray(budgets))
    elif loop == "fori":
        decode = _compiled(ar_decode_loop, target, params, requests, tok_shape, state_shape, keys[1:],
                           steps_arg)
    else:
        step = _compiled(ar_step, target, params, requests, tok_shape, state_shape, keys[0])
    state = target.init_state(b, cache_len, dtype)

    t0 = time.perf_counter()
    with TraceAnnotation("specpilot.prefill"):
        tok, _, state = prefill(params, requests, tokens, lengths, state, keys[0])
        tok.block_until_ready()
    t1 = time.perf_counter()
    with TraceAnnotation("specpilot.decode"):  # a profiler trace's window of the decode steps
        if loop == "fori":
            bound = steps_arg if stop_token is None else jnp.asarray(budgets)
            rest, state = decode(params, requests, tok, state, keys[1:], bound)
            generated = np.concatenate([host_array(tok)[:, None], host_array(rest)], axis=1)
        else:
            out = [tok]
            done = None if stop_token is None else (host_array(tok) == stop_token) | (budgets <= 1)
            for i in range(1, num_steps + 1):
                if done is not None and done.all():
                    break  # every row was done after token i - 2 or earlier: step i - 1 was the extra one
                tok, state = step(params, requests, tok, state, keys[i])
                out.append(tok)
                if done is not None and i >= 2:  # read token i - 1 back while step i runs
                    done |= (host_array(out[i - 1]) == stop_token) | (i >= budgets)
            out += [jnp.full_like(tok, -1)] * (max_new_tokens - len(out))
            generated = host_array(jnp.stack(out, axis=1)).copy()  # without a stop token, the only device -> host copy
    t2 = time.perf_counter()
    num_generated = stop_lengths(generated, budgets, stop_token)
    generated[np.arange(max_new_tokens)[None, :] >= num_generated[:, None]] = -1
    return GenerationResult(tokens=generated, prompt_lengths=np.asarray(lengths), prefill_s=t1 - t0,
                            decode_s=t2 - t1, budgets=budgets, num_generated=num_generated,
                            stop_token=stop_token)
