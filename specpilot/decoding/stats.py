"""Speculative-decoding statistics, with the definitions of DESIGN.md.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SpecStats:
    block_size: int
    steps: np.ndarray  # [B] verification steps per sequence
    emitted: np.ndarray  # [B] tokens emitted by verification steps (bonus included, truncation applied)
    accept_hist: np.ndarray  # [Bs] (sequence, step) pairs that accepted exactly k drafts, k = 0..Bs-1
    prefill_s: float = float("nan")
    decode_s: float = float("nan")
    new_tokens: int = 0  # tokens of the longest sequence (prefill's first token included)
    draft_s: float | None = None
    verify_s: float | None = None
    bookkeeping_s: float | None = None
    accepted: np.ndarray | None = None  # [B] accepted drafts + 1 summed over steps, untruncated
    accepted_per_step: np.ndarray | None = None  # [steps, B] accepted drafts (-1: no step), if recorded
    draft_top1_per_step: np.ndarray | None = None  # [steps, B, depth] drafter top-1 probabilities, if recorded

    @property
    def num_steps(self) -> int:
        """Verification steps of the loop (the longest-running sequence's count)."""
        return int(self.steps.max()) if self.steps.size else 0

    @property
    def tau(self) -> float:
        total = int(self.steps.sum())
        return float(self.emitted.sum()) / total if total else float("nan")

    @property
    def acceptance_length_upstream(self) -> float:
        """Upstream DFlash's mean acceptance length: accepted + 1 per step, untruncated."""
        if self.accepted is None:
            raise ValueError("these statistics carry no untruncated accepted counts")
        total = int(self.steps.sum())
        return float(self.accepted.sum()) / total if total else float("nan")

    @property
    def tau_per_sequence(self) -> np.ndarray:
        return self.emitted / np.maximum(self.steps, 1)

    @property
    def acceptance_rate(self) -> np.ndarray:
        """[Bs-1]: P(draft k accepted) for k = 1..Bs-1."""
        total = self.accept_hist.sum()
        at_least = np.cumsum(self.accept_hist[::-1])[::-1]  # at_least[k] = pairs with >= k accepted
        return at_least[1:] / total if total else np.full(self.block_size - 1, np.nan)

    @property
    def conditional_acceptance(self) -> np.ndarray:
        """[Bs-1]: P(draft k accepted | draft k-1 accepted); draft 0 (the last token) always is."""
        at_least = np.cumsum(self.accept_hist[::-1])[::-1].astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return at_least[1:] / at_least[:-1]

    @property
    def decode_time_per_token(self) -> float:
        steps = self.new_tokens - 1
        return self.decode_s / steps if steps > 0 else float("nan")

    @property
    def bookkeeping_fraction(self) -> float | None:
        if self.bookkeeping_s is None:
            return None
        return self.bookkeeping_s / (self.draft_s + self.verify_s + self.bookkeeping_s)

    def summary(self) -> dict:
        out = {"block_size": self.block_size, "tau": self.tau, "steps": self.num_steps,
               "acceptance_rate": [round(float(x), 4) for x in self.acceptance_rate],
               "prefill_s": self.prefill_s, "decode_s": self.decode_s,
               "decode_time_per_token": self.decode_time_per_token}
        if self.accepted is not None:
            out["acceptance_length_upstream"] = self.acceptance_length_upstream
        if self.draft_s is not None:
            out.update(draft_s=self.draft_s, verify_s=self.verify_s, bookkeeping_s=self.bookkeeping_s)
        return out


def speedup_over_ar(ar_time_per_token: float, method_time_per_token: float) -> float:
    """AR decode time per output token / the method's (same prompts, tokens, device and run)."""
    return ar_time_per_token / method_time_per_token
