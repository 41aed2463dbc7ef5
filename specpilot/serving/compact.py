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
from specpilot.state import AttentionState, TargetState

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
        return AttentionState(take(x.k[:, :, :window]), take(x.v[:, :, :window]))
    return jax.tree.map(take, x)


def _written(new, old, span: int):
    """What a step changed in a view: each attention cache's block of `span` slots from the row's committed
    length before the step (`old`'s), every other leaf whole."""
    if new is None:
        return None
    if isinstance(new, TargetState):
        blocks = tuple(_written(n, old.lengths, span) for n in new.layers)
        return TargetState(blocks, new.lengths)
    if isinstance(new, AttentionState):
        def block(cache):
            return jax.vmap(lambda c, at: jax.lax.dynamic_slice_in_dim(c, at, span, axis=1))(cache, old)
        return AttentionState(block(new.k), block(new.v))
    return new


def _put_back(full, written, rows: jax.Array, starts: jax.Array | None = None):
    """full with each entry a of `written` put at row rows[a] (attention caches: its block at slot
    starts[a], the row's committed length), last entry first: a padding entry repeats the first row,
    which is written after it. An entry that decoded nothing changed only uncommitted slots."""
    if full is None:
        return None
    if isinstance(full, TargetState):
        layers = tuple(_put_back(f, w, rows, full.lengths[rows]) for f, w in zip(full.layers, written.layers))
        return TargetState(layers, _put_back(full.lengths, written.lengths, rows))
    if isinstance(full, AttentionState):
        return AttentionState(_put_back(full.k, written.k, rows, starts), _put_back(full.v, written.v, rows, starts))
    for a in range(rows.shape[0] - 1, -1, -1):
        at = (rows[a],) + (0,) * (full.ndim - 1) if starts is None else (rows[a], 0, starts[a], 0)
        full = jax.lax.dynamic_update_slice(full, written[a:a + 1].astype(full.dtype), at)
    return full


def decode_compact(static: CompactShape, target_params, draft_params, state: sl.SlotState, rows: jax.Array,
                   valid: jax.Array, sampling: RequestSampling):
    """The plain decode (`slots.decode_chain` / `decode_ar`) of rows [A] only (valid [A]: the entry is a
    decoding row; the others repeat one and commit nothing; A = S: rows are every slot in order, valid
    the decoding ones, and nothing is gathered), attending over the first `window` slots. The state is
    only read: `put_back_jit` writes what changed -> (what changed (`_written`), emitted tokens [S, Bs],
    emitted [S], verified [S], overflow: a valid row's writes ran past the window, which the host's
    choice of window rules out)."""
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
    written = sl.SlotState(_written(new.target_state, part.target_state, span),
                           _written(new.draft_state, part.draft_state, span), new.last, new.n_out, new.key)

    def spread(x):  # [A, ...] -> [S, ...]; padding entries add nothing
        mask = valid.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.zeros((s,) + x.shape[1:], x.dtype).at[rows].add(jnp.where(mask, x, 0))

    return written, spread(emit), spread(n_new), spread(verified), overflow


def put_back(state: sl.SlotState, written: sl.SlotState, rows: jax.Array) -> sl.SlotState:
    """The state with a compact decode's changes written at rows [A] (in place: nothing else reads it)."""
    return sl.SlotState(*(_put_back(f, w, rows) for f, w in zip(
        (state.target_state, state.draft_state, state.last, state.n_out, state.key),
        (written.target_state, written.draft_state, written.last, written.n_out, written.key))))


decode_compact_jit = jax.jit(decode_compact, static_argnums=0)
put_back_jit = jax.jit(put_back, donate_argnames=("state",))
