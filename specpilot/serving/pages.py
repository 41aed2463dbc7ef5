"""Paged K/V for the serving engine (`batching.kv: paged`): the pool's layout, the host's page allocator
(a free list and each slot's page table) and the engine-facing bookkeeping that grows a row's pages before
each step and frees them when its request ends. Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.plan import Batching
from specpilot.serving.request import Request, RequestError
from specpilot.state import AttentionState, PagedAttentionState, TargetState, init_paged_attention_state


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """The pool's shape: num_pages pages of page_size slots; a row addresses pages_per_row of them."""

    num_pages: int
    page_size: int
    pages_per_row: int

    @classmethod
    def of(cls, batching: Batching, slots: int, max_len: int) -> "PageLayout":
        per_row = -(-max_len // batching.page_size)
        return cls(batching.pages or slots * per_row, batching.page_size, per_row)

    def pages_for(self, length: int) -> int:
        """Pages that hold slots 0 .. length-1."""
        return -(-max(int(length), 0) // self.page_size)


def check_pageable(batching: Batching, target, tree) -> None:
    """Paged K/V runs AR and padded chain steps (no halves) of an attention-only target on one device;
    anything else is refused, naming the field."""
    for field, plain in (("verify", "padded"), ("overlap", "none")):
        if getattr(batching, field) != plain:
            raise NotImplementedError(f"batching.kv: paged K/V is not implemented with batching.{field}="
                                      f"{getattr(batching, field)!r}; use {field}: {plain} or kv: contiguous")
    if tree is not None:
        raise NotImplementedError("batching.kv: paged K/V does not run tree plans yet; use kv: contiguous")
    if getattr(target, "mesh", None) is not None:
        raise NotImplementedError("batching.kv: paged K/V runs on one device; a sharded plan needs kv: contiguous")
    probe = jax.eval_shape(lambda: target.init_state(1, 8))
    if not all(isinstance(layer, AttentionState) for layer in probe.layers):
        raise NotImplementedError(f"batching.kv: paged K/V runs attention-only (dense) targets; "
                                  f"{type(target).__module__}.{type(target).__name__} needs kv: contiguous")


def init_paged_state(target, slots: int, layout: PageLayout) -> TargetState:
    """An empty target state whose attention layers are pools of `layout` (no page table: the slot state
    carries it)."""
    probe = jax.eval_shape(lambda: target.init_state(1, 8))
    layers = tuple(init_paged_attention_state(layout.num_pages, layout.page_size, layout.pages_per_row,
                                              layer.k.shape[1], layer.k.shape[3], layer.k.dtype)
                   for layer in probe.layers)
    return TargetState(layers, jnp.zeros((slots,), jnp.int32))


class PageAllocator:
    """The free list and the page table [slots, pages_per_row] (num_pages: no page). Each slot holds a
    reservation (pages its request may come to need, promised at admission) and the pages it holds so far;
    a slot grows only within its reservation, so growing never runs out of pages."""

    def __init__(self, layout: PageLayout, slots: int):
        self.layout = layout
        self.free = list(range(layout.num_pages - 1, -1, -1))  # a stack: the lowest page is taken first
        self.table = np.full((slots, layout.pages_per_row), layout.num_pages, np.int32)
        self.held = np.zeros(slots, np.int64)
        self.reserved = np.zeros(slots, np.int64)
        self.changed = True  # the table differs from the one on the device

    @property
    def unpromised(self) -> int:
        """Free pages no reservation has claimed."""
        return len(self.free) - int((self.reserved - self.held).sum())

    def reserve(self, slot: int, pages: int) -> bool:
        """Promise `pages` to an empty slot; False (nothing changes) when the pool cannot."""
        if self.reserved[slot] or self.held[slot]:
            raise RuntimeError(f"slot {slot} still holds pages; release it first")
        if pages > self.unpromised:
            return False
        self.reserved[slot] = pages
        return True

    def grow(self, slot: int, length: int) -> None:
        """Give the slot pages for its slots 0 .. length-1, up to its reservation."""
        want = min(self.layout.pages_for(length), int(self.reserved[slot]))
        while self.held[slot] < want:
            self.table[slot, self.held[slot]] = self.free.pop()
            self.held[slot] += 1
            self.changed = True

    def release(self, slot: int) -> None:
        """Every page of the slot back to the free list; its reservation ends."""
        n = int(self.held[slot])
        self.free.extend(int(p) for p in self.table[slot, :n][::-1])
        self.table[slot] = self.layout.num_pages
        self.held[slot] = self.reserved[slot] = 0
        self.changed = self.changed or n > 0

    def in_use(self) -> int:
        return int(self.held.sum())


class PagedKV:
    """The engine's paged K/V bookkeeping: a request's reservation at admission, its row's pages grown
    before each step to cover what the step may write, freed when it ends; the table for the device."""

    def __init__(self, layout: PageLayout, slots: int, block_size: int, max_len: int, margin: int):
        self.layout, self.block, self.max_len = layout, block_size, max_len
        self.margin = margin  # slots a decoding row may write past what the host has read
        self.alloc = PageAllocator(layout, slots)
        self.deferred = 0  # admissions put off for want of pages (a slot was free)

    @classmethod
    def of(cls, batching: Batching, setup, slots: int, tree=None) -> "PagedKV":
        """The paged K/V of an engine's batching and setup (`slots.EngineSetup`); refused as `check_pageable` says."""
        check_pageable(batching, setup.target, tree)
        # a decoding row may have committed a step the host has not read (pipelined), then writes a block
        margin = setup.block_size * (2 if batching.dispatch == "pipelined" else 1)
        return cls(PageLayout.of(batching, slots, setup.max_len), slots, setup.block_size, setup.max_len, margin)

    def pages_needed(self, request: Request) -> int:
        """The most pages the request's row can need: its prompt, budget and the block a step may accept past it."""
        return self.layout.pages_for(min(self.max_len, len(request.prompt_ids) + request.max_new_tokens + self.block))

    def check(self, request: Request) -> None:
        need = self.pages_needed(request)
        if need > self.layout.num_pages:
            raise RequestError("max_new_tokens", f"prompt + budget need {need} K/V pages of "
                               f"{self.layout.page_size} slots but the pool holds {self.layout.num_pages}; "
                               f"ask for fewer tokens or give the plan more batching.pages")

    def admit(self, slot: int, request: Request) -> bool:
        """Reserve the request's pages in `slot`; False (it stays queued) when the pool cannot yet."""
        if self.alloc.reserve(slot, self.pages_needed(request)):
            return True
        self.deferred += 1
        return False

    def grow(self, prefilling: list, decoding: list, chunk: int) -> tuple[int, int]:
        """Before a step: a prefilling row's pages cover the chunk it feeds, a decoding row's the slots it
        may have committed (what the host read plus the step in flight) and the block this step writes
        -> (rows holding pages, pages held)."""
        for h in prefilling:
            self.alloc.grow(h.slot, h.prefilled + min(chunk, len(h.request.prompt_ids) - h.prefilled))
        for h in decoding:
            self.alloc.grow(h.slot, h.prefilled + max(len(h.tokens) - 1, 0) + self.margin)
        return int((self.alloc.held > 0).sum()), self.alloc.in_use()

    def window(self) -> int:
        """Page-table columns a step must read: the smallest of `window_sizes` holding every row's pages.
        Columns past a row's held pages map no page, so a narrower table reads and writes the same K/V
        (the attention view gathers window x page_size slots instead of the whole context)."""
        need = max(int(self.alloc.held.max()), 1)
        return next(w for w in window_sizes(self.layout.pages_per_row) if w >= need)

    def table_window(self, window: int) -> jax.Array:
        """The host's page table, its first `window` columns, on the device."""
        return jnp.asarray(self.alloc.table[:, :window])

    def stage_windows(self) -> tuple[int, ...]:
        """Move a table of every window's shape to the device once (a new shape compiles there: at warm-up,
        not in a step) -> the windows narrower than the whole table (each its own executables)."""
        windows = window_sizes(self.layout.pages_per_row)
        for w in windows:
            self.table_window(w)
        return windows[:-1]

    def table_if_changed(self) -> np.ndarray | None:
        if not self.alloc.changed:
            return None
        self.alloc.changed = False
        return self.alloc.table.copy()

    def release(self, slot: int) -> None:
        self.alloc.release(slot)


def window_sizes(pages_per_row: int) -> tuple[int, ...]:
    """The page-table widths a paged engine compiles: an eighth, a quarter and a half of `pages_per_row`
    (rounded up), then all of it; a step reads the narrowest holding every row's pages."""
    return tuple(sorted({-(-pages_per_row // d) for d in (8, 4, 2, 1)}))


def kv_bytes_per_slot(state: TargetState) -> int:
    """Bytes of K and V one cache slot (one position of one row) takes over the attention layers of
    `state`, contiguous or paged (the drafter's context is not counted)."""
    total = 0
    for layer in state.layers:
        if isinstance(layer, PagedAttentionState):
            total += 2 * int(np.prod(layer.k.shape[1:])) // layer.page_size * layer.k.dtype.itemsize
        elif isinstance(layer, AttentionState):
            total += 2 * int(np.prod(layer.k.shape)) // (layer.k.shape[0] * layer.max_len) * layer.k.dtype.itemsize
    return total
