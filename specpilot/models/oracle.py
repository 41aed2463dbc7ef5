"""Oracle-acceptance drafter: wraps a real drafter, whose forward still runs at its real shape (timing is
real), and makes its drafts follow a stated acceptance profile against the target's own greedy
continuation, for speed work with random target weights. Results made with it are labelled oracle
acceptance. Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specpilot import atomic_io
from specpilot.models.confidence_trace import sample


def constant_acceptance_for_tau(tau: float, block_size: int) -> float:
    """c with sum_{k=0}^{Bs-1} c^k = tau (bisection; tau in [1, Bs])."""
    if not 1.0 <= tau <= block_size:
        raise ValueError(f"tau {tau} is impossible with block size {block_size} (needs 1 <= tau <= Bs)")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(mid ** k for k in range(block_size)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def conditional_profile(block_size: int, acceptance=None, tau: float | None = None) -> np.ndarray:
    """[Bs-1] conditional acceptance probabilities from a given profile or a target tau."""
    if acceptance is not None:
        c = np.asarray(list(acceptance), np.float64)
        if c.ndim != 1 or c.size == 0 or ((c < 0) | (c > 1)).any():
            raise ValueError(f"acceptance profile must be probabilities in [0, 1], got {list(c)}")
        # shorter profiles repeat their last value; longer ones are cut to the block
        return np.resize(np.concatenate([c, np.full(max(0, block_size - 1 - c.size), c[-1])]),
                         block_size - 1)
    if tau is None:
        raise ValueError("an oracle drafter needs an acceptance profile or a tau")
    return np.full(block_size - 1, constant_acceptance_for_tau(tau, block_size))


def conditional_from_marginal(marginal) -> np.ndarray:
    """Per-position acceptance as a run records it (a_k = fraction of verification steps that accepted
    draft k, k = 1..Bs-1) -> conditional probabilities c_k = a_k / a_{k-1} (a_0 = 1; 0 after a 0)."""
    a = np.asarray(list(marginal), np.float64)
    if a.ndim != 1 or a.size == 0 or ((a < 0) | (a > 1)).any() or (np.diff(a) > 1e-12).any():
        raise ValueError(f"a recorded acceptance trace must be non-increasing probabilities, got {list(a)}")
    prev = np.concatenate([[1.0], a[:-1]])
    return np.where(prev > 0, a / np.where(prev > 0, prev, 1.0), 0.0).clip(0.0, 1.0)


def load_trace(path, method: str = "stock") -> np.ndarray:
    """The per-position acceptance recorded by a run (`results.jsonl`, or the folder holding it) for
    `method`, averaged over its records, as conditional probabilities."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "results.jsonl"
    if not p.is_file():
        raise FileNotFoundError(f"no acceptance trace at {p} (expected a run's results.jsonl)")
    rows = atomic_io.read_jsonl(p)
    traces = [r["stats"]["acceptance_per_position"] for r in rows
              if r.get("method") == method and (r.get("stats") or {}).get("acceptance_per_position")]
    if not traces:
        raise ValueError(f"{p} has no {method!r} record with a per-position acceptance")
    if len({len(t) for t in traces}) != 1:
        raise ValueError(f"{p}: {method!r} records disagree on the block size")
    return conditional_from_marginal(np.mean(np.asarray(traces, np.float64), axis=0))


def expected_tau(conditional: np.ndarray) -> float:
    return float(1.0 + np.cumprod(conditional).sum())


def reference_salt(reference: jax.Array) -> jax.Array:
    """[B] uint32: a hash of each row of reference tokens (position-weighted sum of its ids, wrapping)."""
    ref = reference.astype(jnp.uint32)
    weights = jnp.arange(ref.shape[1], dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(ref * weights[None, :], axis=1, dtype=jnp.uint32)


CONFIDENCE_STREAM = 0x636F6E66  # folded into a step's key for the confidence draw ("conf")


def step_uniforms(key_data: jax.Array, lengths: jax.Array, n: int, salt: jax.Array | None = None,
                  stream: int | None = None) -> jax.Array:
    """[B, n] uniforms from `fold_in(fold_in(key, salt), committed length)` (salt [B], default 0), with
    `stream` folded in last when given (an independent draw from the same step key)."""
    key = jax.random.wrap_key_data(key_data)
    salt = jnp.zeros(lengths.shape, jnp.uint32) if salt is None else salt
    keys = jax.vmap(lambda r, m: jax.random.fold_in(jax.random.fold_in(key, r), m))(salt, lengths)
    if stream is not None:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)
    return jax.vmap(lambda k: jax.random.uniform(k, (n,)))(keys)


def leading_right(key_data: jax.Array, lengths: jax.Array, conditional, salt: jax.Array | None = None) -> jax.Array:
    """[B, Bs-1] bool: which drafts are right, a leading run drawn with P(draft k right | drafts < k
    right) = conditional[k - 1], from `fold_in(fold_in(key, salt), committed length)` (one draw per
    verification; salt [B], default 0)."""
    c = jnp.asarray(conditional, jnp.float32)
    u = step_uniforms(key_data, lengths, c.shape[0], salt)  # [B, Bs-1]
    return jnp.cumprod(u < c[None, :], axis=1).astype(bool)


def draft_outcomes(right: jax.Array) -> jax.Array:
    """right [B, K] (a leading run) -> [B, K] int32: 0 accepted, 1 first rejected, 2 after (OUTCOMES order)."""
    n_right = jnp.sum(right.astype(jnp.int32), axis=1, keepdims=True)
    k = jnp.arange(right.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(k < n_right, 0, jnp.where(k == n_right, 1, 2))


def top1_logit(p: jax.Array, vocab_size: int) -> jax.Array:
    """The logit L of one token, every other logit 0, whose softmax probability is p (clipped to
    [(1 + 1e-3)/V, 1 - 1e-6], where L > 0: the token stays the argmax)."""
    p = jnp.clip(p.astype(jnp.float32), (1.0 + 1e-3) / vocab_size, 1.0 - 1e-6)
    return jnp.log(p) + jnp.log(jnp.float32(vocab_size - 1)) - jnp.log1p(-p)


@dataclasses.dataclass(frozen=True)
class OracleDrafter:
    inner: Any  # the real drafter whose forward is timed
    conditional: tuple[float, ...]  # [Bs-1]
    confidence: float = 30.0  # one-hot height without a calibration
    calibration: Any = None  # models.confidence_trace.Calibration: top-1 probabilities by outcome

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    def with_matmul(self, choice) -> "OracleDrafter":
        """The same oracle over its inner drafter multiplied by `choice` (a plan's kernels)."""
        return dataclasses.replace(self, inner=self.inner.with_matmul(choice))

    def with_mesh(self, mesh) -> "OracleDrafter":
        """The same oracle over its inner drafter sharded over `mesh`."""
        return dataclasses.replace(self, inner=self.inner.with_mesh(mesh))

    @property
    def vocab_size(self) -> int:
        return self.inner.cfg.vocab_size

    @staticmethod
    def make_params(inner_params, reference: np.ndarray, seed: int = 0) -> dict:
        """reference [B, R]: each row's prompt then the target's greedy continuation, by position."""
        return {"inner": inner_params, "reference": jnp.asarray(reference, jnp.int32),
                "key": jax.random.key_data(jax.random.key(seed))}

    def draft_confidence(self, key_data, lengths, salt, right) -> jax.Array:
        """[B, K] float32: each draft's top-1 probability, drawn from its outcome's table."""
        u = step_uniforms(key_data, lengths, right.shape[1], salt, stream=CONFIDENCE_STREAM)
        tables = self.calibration.tables()  # [3, G]
        return sample(tables[draft_outcomes(right)], u)

    def draft_logit(self, key_data, lengths, salt, right) -> jax.Array:
        """[B, K] float32: the chosen token's logit giving each draft its drawn confidence."""
        return top1_logit(self.draft_confidence(key_data, lengths, salt, right), self.vocab_size)

    def init_state(self, params, batch_size: int, max_len: int, dtype=None):
        return self.inner.init_state(params["inner"], batch_size, max_len, dtype)

    def extend(self, params, target_params, state, taps, n_new):
        return self.inner.extend(params["inner"], target_params, state, taps, n_new)

    def propose(self, params, target_params, state, last_tokens, block_size: int):
        real_logits, state = self.inner.propose(params["inner"], target_params, state, last_tokens,
                                                block_size)
        ref = params["reference"]
        length = state.lengths  # [B] committed; the block's first token sits at this position
        positions = length[:, None] + 1 + jnp.arange(block_size - 1, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(ref, jnp.minimum(positions, ref.shape[1] - 1), axis=1)
        salt = reference_salt(tokens)
        right = leading_right(params["key"], length, self.conditional[: block_size - 1], salt)
        tokens = jnp.where(right, tokens, (tokens + 1) % self.vocab_size)
        height = self.confidence
        if self.calibration is not None:
            height = self.draft_logit(params["key"], length, salt, right)[..., None]  # [B, Bs-1, 1]
        logits = height * jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32)
        # Keep the real forward alive (an unused result would be removed, optimization barriers
        # included) without letting its values in: non-finite logits are zeroed before the zero weight.
        alive = jnp.nan_to_num(real_logits.max(axis=-1, keepdims=True), nan=0.0, posinf=0.0, neginf=0.0)
        return logits + 0.0 * alive, state
