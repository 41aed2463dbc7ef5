"""Decode steps over a compact view of the engine's slots: only the rows that decode, and only the first
`window` cache slots. The view is gathered before the step and only the slots the step wrote are put back
after it, so one stream in a many-slot engine with a long context costs about what a batch of one over its
own length costs. Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specpilot.decoding.sampling import RequestSampling
from specpilot.models.drafter import BlockDrafter
from specpilot.serving import slots as sl
from specpilot.state import AttentionState, RecurrentState, TargetState

WINDOW_MIN = 128  # the smallest window; windows double from here up to the state's slots


@dataclasses.dataclass(frozen=True)
class CompactShape:
    """What is static about a compact decode (a jit static argument): the engine's setup, the rows it
    computes and the cache slots it attends over."""

    setup: sl.EngineSetup
    rows: int
    window: int


def supported(setup: sl.EngineSetup, target, drafter) -> bool:
    """Whether `decode_compact` can run this engine's decode: AR or a fixed, padded chain on one device,
    with an attention-only target and a drafter whose context is an attention cache."""
    if getattr(target, "mesh", None) is not None or setup.overlap != "none":
        return False
    if setup.uses_drafter and (setup.draft_budget != "fixed" or setup.verify != "padded"):
        return False
    probe = jax.eval_shape(lambda: target.init_state(1, 8))
    if not all(isinstance(layer, AttentionState) for layer in probe.layers):
        return False
    return drafter is None or isinstance(drafter, BlockDrafter)


def buckets(slots: int) -> list[int]:
    """Row counts a compact decode is compiled for: powers of two below `slots`."""
    out, a = [], 1
    while a < slots:
        out.append(a)
        a *= 2
    return out


def windows(max_len: int) -> list[int]:
    """Window sizes: WINDOW_MIN doubling, up to 3/4 of `max_len` (past that the whole state costs little
    more)."""
    out, w = [], WINDOW_MIN
    while 4 * w <= 3 * max_len:
        out.append(w)
        w *= 2
    return out


def shapes(slots: int, max_len: int) -> list[tuple[int, int]]:
    """Every (rows, window) `choose` may return: the compact decodes an engine compiles."""
    return [(a, w) for a in buckets(slots) + [slots] for w in windows(max_len) + [max_len]
            if (a, w) != (slots, max_len)]


def choose(n_rows: int, need: int, slots: int, max_len: int) -> tuple[int, int] | None:
    """(rows, window) of the smallest compact decode for n_rows decoding rows whose writes end before slot
    `need`; None when only the whole state fits (the plain decode)."""
    rows = next((a for a in buckets(slots) if a >= n_rows), slots)
    window = next((w for w in windows(max_len) if w >= need), max_len)
    return None if (rows, window) == (slots, max_len) else (rows, window)


def _view(x, rows: jax.Array | None, window: int):
    """Rows [A] of a part of the slot state (None: every row, in order); attention caches cut to their
    first `window` slots."""
    take = (lambda a: a) if rows is None else (lambda a: a[rows])  # noqa: E731
    if x is None:
        return None
    if isinstance(x, TargetState):
        return TargetState(tuple(_view(layer, rows, window) for layer in x.layers), take(x.lengths))
    if isinstance(x, AttentionState):
        return AttentionState(take(x.k)[:, :, :window], take(x.v)[:, :, :window])
    return jax.tree.map(take, x)


def _put_row(full: jax.Array, part: jax.Array, a: int, row, valid, start=None, span: int = 0) -> jax.Array:
    """full with part's row a written at row `row` where `valid` (an attention cache [S, KVH, M, D]: only
    slots start .. start+span-1, the ones a step writes)."""
    if start is None:
        at, size = (row,) + (0,) * (full.ndim - 1), (1,) + full.shape[1:]
        src = (a,) + (0,) * (full.ndim - 1)
    else:
        at, size = (row, 0, start, 0), (1, full.shape[1], span, full.shape[3])
        src = (a, 0, start, 0)
    new = jax.lax.dynamic_slice(part, src, size).astype(full.dtype)
    cur = jax.lax.dynamic_slice(full, at, size)
    return jax.lax.dynamic_update_slice(full, jnp.where(valid, new, cur), at)


def _put_back(full, part, rows: jax.Array, valid: jax.Array, starts: jax.Array | None, span: int):
    """full with each valid row a of part put back at rows[a], one row after the other (a padding entry
    repeats a valid row and writes back what is there)."""
    if full is None:
        return None
    if isinstance(full, TargetState):
        layers = tuple(_put_back(f, p, rows, valid, full.lengths[rows], span)
                       for f, p in zip(full.layers, part.layers))
        return TargetState(layers, _put_back(full.lengths, part.lengths, rows, valid, None, span))
    if isinstance(full, AttentionState):
        k, v = full.k, full.v
        for a in range(rows.shape[0]):
            k = _put_row(k, part.k, a, rows[a], valid[a], starts[a], span)
            v = _put_row(v, part.v, a, rows[a], valid[a], starts[a], span)
        return AttentionState(k, v)

    def whole(f, p):
        for a in range(rows.shape[0]):
            f = _put_row(f, p, a, rows[a], valid[a])
        return f

    return jax.tree.map(whole, full, part)


def decode_compact(static: CompactShape, target_params, draft_params, state: sl.SlotState, rows: jax.Array,
                   valid: jax.Array, sampling: RequestSampling):
    """The plain decode (`slots.decode_chain` / `decode_ar`) of rows [A] only (valid [A]: the entry is a
    decoding row; the others repeat one and commit nothing; A = S: rows are every slot in order, valid
    the decoding ones, and nothing is gathered), attending over the first `window` slots ->
    (state, emitted tokens [S, Bs], emitted [S], verified [S], overflow: a valid row's writes ran past
    the window, which the host's choice of window rules out)."""
    setup, window = static.setup, static.window
    s = state.last.shape[0]
    span = setup.block_size
    view = None if static.rows == s else rows
    part = sl.SlotState(*(_view(x, view, window) for x in (state.target_state, state.draft_state, state.last,
                                                           state.n_out, state.key)))
    part_sampling = RequestSampling(sampling.temperature[rows], sampling.top_p[rows], greedy=sampling.greedy,
                                    top_k=sampling.top_k)
    decode = sl.decode_chain if setup.uses_drafter else sl.decode_ar
    new, emit, n_new, verified = decode(setup, target_params, draft_params, part, valid, part_sampling)
    overflow = jnp.any(valid & (part.target_state.lengths + span > window))
    if setup.uses_drafter:
        overflow |= jnp.any(valid & (part.draft_state.lengths + span > window))
    state = sl.SlotState(_put_back(state.target_state, new.target_state, rows, valid, None, span),
                         _put_back(state.draft_state, new.draft_state, rows, valid, None, span),
                         *(_put_back(f, p, rows, valid, None, span)
                           for f, p in ((state.last, new.last), (state.n_out, new.n_out), (state.key, new.key))))

    def spread(x):  # [A, ...] -> [S, ...]; padding entries add nothing
        mask = valid.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.zeros((s,) + x.shape[1:], x.dtype).at[rows].add(jnp.where(mask, x, 0))

    return state, spread(emit), spread(n_new), spread(verified), overflow


decode_compact_jit = jax.jit(decode_compact, static_argnums=0, donate_argnames=("state",))
