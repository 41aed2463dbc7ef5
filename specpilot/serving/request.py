"""A serving request and its validation: every bad field is refused on its own, naming the field.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

MAX_SEED = 2**31 - 1  # seeds become int32 keys inside the jitted reset (jax.random.key)


class RequestError(ValueError):
    """A request the engine refuses; `field` names what is wrong with it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"request.{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    seed: int = 0  # the PRNG seed of a sampled request (jax.random.key(seed))
    stop_token: int | None = None  # the request ends right after emitting it (kept as its last token)
    draft_reference: Sequence[int] | None = None  # replaying drafters only: prompt + continuation


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def _token_ids(field: str, ids, vocab_size: int) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise RequestError(field, f"must be a sequence of token ids, got {type(ids).__name__}")
    ids = list(np.asarray(ids).tolist()) if isinstance(ids, np.ndarray) else list(ids)
    if not ids:
        raise RequestError(field, "is empty; a request needs at least one token")
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise RequestError(field, f"token {i} is {t!r} ({type(t).__name__}), not an integer id")
        if not 0 <= int(t) < vocab_size:
            raise RequestError(field, f"token {i} is {int(t)}, outside the vocabulary [0, {vocab_size})")
    return tuple(int(t) for t in ids)


def check_request(request: Request, *, vocab_size: int, context_len: int, sampling: bool = True,
                  greedy_only_reason: str = "the engine was built without sampling") -> Request:
    """The request with its ids as ints, or `RequestError` naming the first bad field."""
    if not isinstance(request, Request):
        raise RequestError("type", f"expected a Request, got {type(request).__name__}")
    prompt = _token_ids("prompt_ids", request.prompt_ids, vocab_size)
    budget = request.max_new_tokens
    if not _is_int(budget) or budget < 1:
        raise RequestError("max_new_tokens", f"must be an integer >= 1, got {budget!r}")
    if len(prompt) + budget > context_len:
        raise RequestError("max_new_tokens", f"the prompt ({len(prompt)} tokens) plus {budget} new tokens "
                           f"is {len(prompt) + budget} positions, past the engine's context of {context_len}")
    temp = request.temperature
    if not _is_number(temp) or not math.isfinite(temp) or temp < 0:
        raise RequestError("temperature", f"must be a finite number >= 0, got {temp!r}")
    if temp > 0 and not sampling:
        raise RequestError("temperature", f"{temp} asks for sampling, but {greedy_only_reason}; use 0")
    top_p = request.top_p
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise RequestError("top_p", f"must be in (0, 1], got {top_p!r}")
    if not _is_int(request.seed) or not 0 <= request.seed <= MAX_SEED:
        raise RequestError("seed", f"must be an integer in [0, {MAX_SEED}], got {request.seed!r}")
    stop = request.stop_token
    if stop is not None and (not _is_int(stop) or not 0 <= stop < vocab_size):
        raise RequestError("stop_token", f"must be None or a token id in [0, {vocab_size}), got {stop!r}")
    reference = None
    if request.draft_reference is not None:
        reference = _token_ids("draft_reference", request.draft_reference, vocab_size)
        if reference[: len(prompt)] != prompt:
            raise RequestError("draft_reference", "must start with the prompt (it is indexed by position)")
    return dataclasses.replace(request, prompt_ids=prompt, max_new_tokens=int(budget), temperature=float(temp),
                               top_p=float(top_p), seed=int(request.seed),
                               stop_token=None if stop is None else int(stop), draft_reference=reference)
