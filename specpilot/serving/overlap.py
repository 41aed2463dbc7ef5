"""Drafting off the critical path (mechanism 3): verify one half of the slots while drafting the other.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.decoding.sampling import RequestSampling
from specpilot.models.drafter import ReplayDrafter
from specpilot.models.oracle import OracleDrafter
from specpilot.plan import OVERLAPS
from specpilot.serving import slots as sl


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
    drafts: jax.Array  # [S, Bs-1] int32: each row's drafts of its committed state
    logits: jax.Array  # [S, Bs-1, V] float32: their draft logits


def check_overlap(overlap: str, slots: int, block_size: int, target) -> int:
    """-> the rows one decode verifies (slots, or slots / 2 under halves); a setting halves cannot run
    raises ValueError (NotImplementedError for a sharded target) naming the field."""
    if overlap not in OVERLAPS:
        raise ValueError(f"batching.overlap: {overlap!r} is not one of {OVERLAPS}")
    if overlap == "none":
        return slots
    if block_size < 2:
        raise ValueError("batching.overlap: 'halves' needs a drafter (block_size >= 2)")
    if slots < 2 or slots % 2:
        raise ValueError(f"batching.overlap: 'halves' splits the slots in two equal halves, got {slots} slots")
    if getattr(target, "mesh", None) is not None:
        raise NotImplementedError("batching.overlap: 'halves' runs on one device; a sharded plan needs "
                                  "overlap: none")
    return slots // 2


def init_prepared(setup: sl.EngineSetup, slots: int) -> Prepared:
    k = setup.block_size - 1
    return Prepared(jnp.zeros((slots, k), jnp.int32),
                    jnp.zeros((slots, k, setup.target.vocab_size), jnp.float32))


def _rows(x, lo: int, hi: int):
    return jax.tree.map(lambda a: a[lo:hi], x)


def _put_rows(full, part, lo: int):
    return jax.tree.map(lambda a, p: jax.lax.dynamic_update_slice_in_dim(a, p.astype(a.dtype), lo, 0), full, part)


def _half_sampling(sampling: RequestSampling, lo: int, hi: int) -> RequestSampling:
    return RequestSampling(sampling.temperature[lo:hi], sampling.top_p[lo:hi], greedy=sampling.greedy,
                           top_k=sampling.top_k)


def _half_draft_params(drafter, params, lo: int, hi: int):
    """A replaying drafter reads a per-row reference from its params: that half's rows of it."""
    if isinstance(drafter, ReplayDrafter):
        return params[lo:hi]
    if isinstance(drafter, OracleDrafter):
        return dict(params, reference=params["reference"][lo:hi])
    return params


def decode_halves(static, target_params, draft_params, state: sl.SlotState, prepared: Prepared,
                  verify_active: jax.Array, draft_active: jax.Array, sampling: RequestSampling):
    """static = (setup, parity): verify half `parity` with its prepared drafts and draft the other half,
    in one program -> (state, prepared, emitted tokens [S, Bs], emitted [S], verified [S]); the drafted
    half's rows emit nothing. verify_active / draft_active [S] bool: the rows each half takes."""
    setup, parity = static
    s = state.last.shape[0]
    h = s // 2
    v, d = (0, h) if parity == 0 else (h, 0)
    # verification of half v: reads only v's rows and the drafts prepared for them
    vs = sl.verify_drafts(setup, target_params, _half_draft_params(setup.drafter, draft_params, v, v + h),
                          _rows(state, v, v + h), prepared.drafts[v:v + h], prepared.logits[v:v + h],
                          verify_active[v:v + h], _half_sampling(sampling, v, v + h))
    v_state, v_emit, v_new, v_verified = vs
    # drafting of half d: its committed state from before this call, independent of the verification
    d_state, drafts, logits = sl.draft_rows(setup, target_params,
                                            _half_draft_params(setup.drafter, draft_params, d, d + h),
                                            _rows(state, d, d + h), draft_active[d:d + h],
                                            _half_sampling(sampling, d, d + h))
    state = _put_rows(_put_rows(state, v_state, v), d_state, d)
    prepared = Prepared(jax.lax.dynamic_update_slice_in_dim(prepared.drafts, drafts, d, 0),
                        jax.lax.dynamic_update_slice_in_dim(prepared.logits, logits.astype(jnp.float32), d, 0))
    put = lambda x: jax.lax.dynamic_update_slice_in_dim(jnp.zeros((s,) + x.shape[1:], x.dtype), x, v, 0)  # noqa: E731
    return state, prepared, put(v_emit), put(v_new), put(v_verified)


decode_halves_jit = jax.jit(decode_halves, static_argnums=0, donate_argnames=("state", "prepared"))


class Overlap:
    """The host side of `halves`: which half the next call verifies and which rows hold a prepared draft."""

    def __init__(self, slots: int):
        self.slots, self.half = slots, slots // 2
        self.parity = 0  # the half the next decode call verifies
        self.prepared = np.zeros(slots, bool)  # the row holds a draft of its current committed state

    def half_of(self, parity: int) -> range:
        return range(parity * self.half, (parity + 1) * self.half)

    def plan_call(self, decoding: list[int], drafting: list[int]) -> tuple[int, np.ndarray, np.ndarray]:
        """decoding: the slots whose rows decode; drafting: those plus the rows whose prompt ended this
        step -> (parity, verify_active [S], draft_active [S]) of the next call. A decoding row of the
        verified half without a prepared draft raises RuntimeError (the invariant above broke)."""
        p = self.parity
        verify = np.zeros(self.slots, bool)
        draft = np.zeros(self.slots, bool)
        verify[[i for i in decoding if i in self.half_of(p)]] = True
        draft[[i for i in drafting if i in self.half_of(1 - p)]] = True
        missing = np.flatnonzero(verify & ~self.prepared)
        if missing.size:
            raise RuntimeError(f"overlap halves: slot(s) {missing.tolist()} would verify without a prepared draft")
        return p, verify, draft

    def called(self, verify: np.ndarray, draft: np.ndarray) -> None:
        """After the call: the verified rows' drafts are spent, the drafted rows hold one; swap halves."""
        self.prepared &= ~verify
        self.prepared |= draft
        self.parity = 1 - self.parity

    def reset(self, mask: np.ndarray) -> None:
        """Rows taking a new request hold no draft."""
        self.prepared &= ~mask
