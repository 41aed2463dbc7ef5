"""What the serving engine's host keeps per request and per step: a request's `Handle` (its tokens so
far, status and timestamps), a dispatched step whose tokens are still to be read (`PendingStep`) and the
engine's step counters (`EngineStats`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from specpilot.serving.request import Request

WAITING, PREFILL, DECODING, DONE = "waiting", "prefill", "decoding", "done"


@dataclasses.dataclass(eq=False)
class Handle:
    """One submitted request: its tokens so far, status and timestamps (time.perf_counter seconds)."""

    id: int
    request: Request
    submitted_s: float
    status: str = WAITING
    slot: int | None = None
    tokens: list = dataclasses.field(default_factory=list)
    token_s: list = dataclasses.field(default_factory=list)  # when each token reached the host
    finish_reason: str | None = None  # "length", "stop" or "cancelled"
    prefilled: int = 0  # prompt tokens fed so far
    admitted_s: float | None = None
    finished_s: float | None = None
    unread: collections.deque = dataclasses.field(default_factory=collections.deque, repr=False)

    @property
    def done(self) -> bool:
        return self.status == DONE

    @property
    def ttft_s(self) -> float | None:
        return self.token_s[0] - self.submitted_s if self.token_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_s) < 2:
            return None
        return (self.token_s[-1] - self.token_s[0]) / (len(self.token_s) - 1)


@dataclasses.dataclass(frozen=True)
class PendingStep:
    """A dispatched step: the handles it serves and its device outputs (None where it ran no such call)."""

    final: list  # handles whose prompt ended in this step's prefill (their first token is `first`)
    decoding: list  # handles this step's decode verified
    first: Any
    emitted: Any
    n_new: Any
    verified: Any
    overflow: Any = None  # a compact decode's flag: a row's writes ran past its window (never, by the host's choice)

    @property
    def live(self) -> bool:
        """Some request it serves is still open (else its tokens would all be dropped)."""
        return any(not h.done for h in self.final + self.decoding)


def _ratio(count: str, per: str, doc: str | None = None) -> property:
    """A statistic count / per, NaN before any `per` (no decode yet)."""
    def get(self) -> float:
        n = getattr(self, per)
        return getattr(self, count) / n if n else float("nan")
    return property(get, doc=doc)


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    decode_row_steps: int = 0  # (active row, decode step) pairs
    decode_tokens: int = 0  # tokens those row-steps emitted (kept or not)
    verify_tokens: int = 0  # tokens those row-steps sent to verification (last token + kept drafts; tree: nodes)
    forward_tokens: int = 0  # tokens the decode calls' verify forwards computed (padded: slots x block; tree:
    # slots x nodes)
    rows_drafted: int = 0  # (row, decode call) pairs drafted (overlap none: the verified rows themselves)
    both_halves_busy: int = 0  # overlap halves: decode calls that verified one half and drafted the other
    compact_calls: int = 0  # decode calls over the decoding rows and a window of the slots (`serving.compact`)
    page_row_steps: int = 0  # paged K/V: (row holding pages, step) pairs, sampled after each step's growth
    page_steps: int = 0  # paged K/V: pages held, summed over those steps
    peak_pages: int = 0  # paged K/V: the most pages held at once

    tokens_per_row_step = _ratio("decode_tokens", "decode_row_steps",
                                 "Mean tokens a decoding row gains per step (AR: 1; chain: the acceptance length tau).")
    tokens_per_decode = _ratio("decode_tokens", "decode_calls", "Mean tokens one decode call emits over the batch.")
    rows_verified_per_decode = _ratio("decode_row_steps", "decode_calls")
    rows_drafted_per_decode = _ratio("rows_drafted", "decode_calls")
    both_halves_busy_fraction = _ratio("both_halves_busy", "decode_calls", "The share of decode calls in which "
                                       "both halves had work (halves; 0 under overlap none).")
    verify_tokens_per_decode = _ratio("verify_tokens", "decode_calls",
                                      "Mean tokens one decode call sends to verification over the batch.")
    def add_pages(self, rows: int, pages: int) -> None:
        """Paged K/V after a step's growth: `rows` hold `pages` pages (a step with none is not counted)."""
        if rows:
            self.page_row_steps, self.page_steps = self.page_row_steps + rows, self.page_steps + pages
            self.peak_pages = max(self.peak_pages, pages)

    pages_per_row = _ratio("page_steps", "page_row_steps", "Paged K/V: mean pages a row held over the steps it "
                           "held any (NaN for contiguous K/V).")
