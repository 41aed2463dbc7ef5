"""Token forcing: check a candidate method against the reference's output, position by position.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.decoding.ar import pack_prompts
from specpilot.decoding.token_tree import build_tree, root_path
from specpilot.decoding.two_level import check_exit_head, first_level_scores, select_subtree, with_exit_head
from specpilot.sharding import host_array
from specpilot.state import chain_forward, prompt_forward, tree_mask

Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
DEFAULT_TIE_MARGIN = 1e-3  # float32 logits; state the margin used in every report


@functools.partial(jax.jit, static_argnames=("target",), donate_argnames=("state",))
def _prefill(params, target, tokens, lengths, state):
    # prompt_forward hides each row's padding (a recurrent layer would otherwise feed it to its state)
    last, _, state = prompt_forward(target, params, tokens, lengths, state)
    return last, state


@functools.partial(jax.jit, static_argnames=("target",), donate_argnames=("state",))
def _chunk(params, target, tokens, state):
    logits, _, state = chain_forward(target, params, tokens, state)  # [B, k, V]
    return logits, state.commit(tokens.shape[1])


@functools.partial(jax.jit, static_argnames=("target", "shape"), donate_argnames=("state",))
def _tree_chunk(params, target, shape, tokens, state):
    # tokens [B, D+1]: the root and the forced path. Drafted scores put the path first at every depth
    # (log-probability ~0) and spread the other candidates below it, so the path is the tree's first
    # root path of depth D and every other node is a real sibling in the same forward.
    nodes, depth, branching = shape
    b, k = tokens.shape
    v = target.vocab_size
    spread = jnp.arange(v, dtype=jnp.float32)[None, None, :] * (1.0 / v)  # distinct off-path scores
    logits = 30.0 * jax.nn.one_hot(tokens[:, 1:], v, dtype=jnp.float32) + spread
    t = build_tree(jax.nn.log_softmax(logits, axis=-1), tokens[:, 0], nodes, depth, branching)
    last = jnp.argmax(t.depths == depth, axis=1).astype(jnp.int32)  # the path's node at depth D
    path = root_path(t, last, k)
    positions = state.lengths[:, None] + t.depths
    out, _, state = target.forward(params, t.tokens, positions, state, tree_mask(state, t.ancestors),
                                   parents=t.parents)
    return jnp.take_along_axis(out, path[:, :, None], axis=1), state.gather_path(path, jnp.full((b,), k, jnp.int32))


@functools.partial(jax.jit, static_argnames=("target", "shape", "level"), donate_argnames=("state",))
def _two_level_chunk(params, target, shape, level, tokens, state):
    # The forced path inside an N-node tree as in _tree_chunk; the first level scores every node (the
    # early-exit forward runs), the path's scores are raised to the top so it survives, and the target
    # verifies the `keep` kept nodes, compacted and remapped as a two-level step does.
    nodes, depth, branching = shape
    first, keep, exit_layer, exit_head = level
    b, k = tokens.shape
    v = target.vocab_size
    spread = jnp.arange(v, dtype=jnp.float32)[None, None, :] * (1.0 / v)
    logprobs = jax.nn.log_softmax(30.0 * jax.nn.one_hot(tokens[:, 1:], v, dtype=jnp.float32) + spread, axis=-1)
    full = build_tree(logprobs, tokens[:, 0], nodes, depth, branching)
    end = jnp.argmax(full.depths == depth, axis=1).astype(jnp.int32)
    on_path = jnp.take_along_axis(full.ancestors, end[:, None, None], axis=1)[:, 0]  # [B, N]
    scores = first_level_scores(first, exit_layer, depth, target, params, state, full, logprobs, exit_head)
    t, kept = select_subtree(full, jnp.where(on_path, jnp.inf, scores), keep)
    last = jnp.argmax(kept == end[:, None], axis=1).astype(jnp.int32)
    path = root_path(t, last, k)
    positions = state.lengths[:, None] + t.depths
    out, _, state = target.forward(params, t.tokens, positions, state, tree_mask(state, t.ancestors),
                                   parents=t.parents)
    return jnp.take_along_axis(out, path[:, :, None], axis=1), state.gather_path(path, jnp.full((b,), k, jnp.int32))


def _score_in_chunks(params, target, prompt_tokens, prompt_lengths, forced, k: int, extra_slots: int,
                     cache_dtype, run_chunk):
    """Logits [B, n, V]: the prompt's prediction, then `run_chunk(tokens [B, k], state)` over the forced
    tokens k at a time (forced token i-1 is the input whose output predicts forced token i; the tail
    chunk is padded). `extra_slots`: cache slots a chunk's forward writes beyond its k tokens."""
    b, n = forced.shape
    n_chunks = -(-max(n - 1, 0) // k)
    state = target.init_state(b, prompt_tokens.shape[1] + n_chunks * k + extra_slots, cache_dtype)
    first, state = _prefill(params, target, jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths), state)
    inputs = np.zeros((b, n_chunks * k), np.int32)
    inputs[:, : n - 1] = np.maximum(forced[:, : n - 1], 0)
    out = [first[:, None]]
    for c in range(n_chunks):
        logits, state = run_chunk(jnp.asarray(inputs[:, c * k:(c + 1) * k]), state)
        out.append(logits)
    return host_array(jnp.concatenate(out, axis=1)[:, :n])


def tree_scorer(params, target, nodes: int, depth: int, branching: int, cache_dtype=None) -> Scorer:
    """Scorer running the prompt, then the forced tokens depth + 1 at a time, each chunk the first root
    path of an `nodes`-node tree forward (module docstring). Needs nodes >= depth + 1."""
    if nodes < depth + 1:
        raise ValueError(f"a {nodes}-node tree cannot hold a root path of depth {depth}")
    k = depth + 1

    def score(prompt_tokens, prompt_lengths, forced):
        return _score_in_chunks(params, target, prompt_tokens, prompt_lengths, forced, k, nodes, cache_dtype,
                                lambda tokens, state: _tree_chunk(params, target, (nodes, depth, branching),
                                                                  tokens, state))

    return score


def two_level_scorer(params, target, nodes: int, depth: int, branching: int, first: str, keep: int,
                     exit_layer=None, cache_dtype=None, exit_head: dict | None = None) -> Scorer:
    """Scorer as `tree_scorer` through a two-level step: an `nodes`-node tree carrying the forced path,
    scored by the first level (`exit_head`: a trained head's arrays for the early exit), cut to `keep`
    nodes (the path kept) and verified. Needs keep >= depth + 1."""
    if keep < depth + 1:
        raise ValueError(f"{keep} kept nodes cannot hold a root path of depth {depth}")
    if exit_head is not None:
        check_exit_head(exit_head, target)
        params = with_exit_head(params, exit_head)
    k = depth + 1
    level = (first, keep, exit_layer, exit_head is not None)

    def score(prompt_tokens, prompt_lengths, forced):
        return _score_in_chunks(params, target, prompt_tokens, prompt_lengths, forced, k, nodes, cache_dtype,
                                lambda tokens, state: _two_level_chunk(params, target, (nodes, depth, branching),
                                                                       level, tokens, state))

    return score


def chunked_scorer(params, target, chunk: int | None = 1, cache_dtype=None) -> Scorer:
    """Scorer running `target.forward` over the prompt, then over the forced tokens `chunk` at a time.

    chunk=None feeds all forced tokens in one forward (a teacher-forced prefill).
    """

    def score(prompt_tokens, prompt_lengths, forced):
        k = forced.shape[1] if chunk is None else chunk
        return _score_in_chunks(params, target, prompt_tokens, prompt_lengths, forced, k, 0, cache_dtype,
                                lambda tokens, state: _chunk(params, target, tokens, state))

    return score


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit over the last axis (NaN where a row holds a NaN)."""
    top2 = np.partition(np.asarray(logits, np.float64), -2, axis=-1)[..., -2:]  # NaN sorts last
    return top2[..., 1] - top2[..., 0]


@dataclasses.dataclass
class Mismatch:
    position: int  # index into the generated tokens
    reference_token: int
    candidate_token: int
    reference_margin: float  # reference's top-1 minus top-2 logit here (nan if it gave no logits)
    near_tie: bool


@dataclasses.dataclass
class NonFinite:
    position: int  # index into the generated tokens
    side: str  # "reference", "candidate" or "both": whose logits there hold a NaN or an infinity


@dataclasses.dataclass
class PromptForcing:
    num_positions: int
    mismatches: list[Mismatch]
    reference_self_mismatches: int
    non_finite: list[NonFinite] = dataclasses.field(default_factory=list)

    @property
    def first_mismatch(self) -> int | None:
        return self.mismatches[0].position if self.mismatches else None

    @property
    def num_mismatches(self) -> int:
        return len(self.mismatches)

    @property
    def num_near_ties(self) -> int:
        return sum(m.near_tie for m in self.mismatches)

    @property
    def num_hard_mismatches(self) -> int:
        return self.num_mismatches - self.num_near_ties

    @property
    def margins(self) -> list[float]:
        return [m.reference_margin for m in self.mismatches]


@dataclasses.dataclass
class ForcingReport:
    prompts: list[PromptForcing]
    tie_margin: float

    @property
    def num_positions(self) -> int:
        return sum(p.num_positions for p in self.prompts)

    @property
    def num_mismatches(self) -> int:
        return sum(p.num_mismatches for p in self.prompts)

    @property
    def num_near_ties(self) -> int:
        return sum(p.num_near_ties for p in self.prompts)

    @property
    def num_hard_mismatches(self) -> int:
        return sum(p.num_hard_mismatches for p in self.prompts)

    @property
    def reference_self_mismatches(self) -> int:
        return sum(p.reference_self_mismatches for p in self.prompts)

    @property
    def num_non_finite(self) -> int:
        """Positions whose reference or candidate logits are not finite (each fails)."""
        return sum(len(p.non_finite) for p in self.prompts)

    @property
    def passed(self) -> bool:
        """Every position agrees on finite logits and the reference reproduces its own output."""
        return (self.num_mismatches == 0 and self.reference_self_mismatches == 0
                and self.num_non_finite == 0)

    @property
    def passed_up_to_ties(self) -> bool:
        return (self.num_hard_mismatches == 0 and self.reference_self_mismatches == 0
                and self.num_non_finite == 0)

    def summary(self) -> str:
        lines = [f"token forcing: {self.num_positions} positions, {self.num_mismatches} mismatches "
                 f"({self.num_hard_mismatches} hard, {self.num_near_ties} near-ties with reference "
                 f"margin < {self.tie_margin:g}); reference self-mismatches "
                 f"{self.reference_self_mismatches}; non-finite logits at {self.num_non_finite} "
                 f"positions"]
        if self.reference_self_mismatches:  # e.g. a bfloat16 target whose choice depends on the forward's length
            lines.append(f"  the reference disagrees with itself at {self.reference_self_mismatches} positions: its "
                         "forward over the forced tokens chooses other tokens than its output, so the plan's "
                         "mismatches cannot be told from the reference's own (a bfloat16 target: run it in float32 "
                         "with target.matmul_precision=highest, docs/plans.md)")
        for i, p in enumerate(self.prompts):
            if p.non_finite:
                shown = ", ".join(f"@{n.position} ({n.side})" for n in p.non_finite[:5])
                more = f" (+{len(p.non_finite) - 5} more)" if len(p.non_finite) > 5 else ""
                lines.append(f"  prompt {i}: non-finite logits (NaN or inf) at {shown}{more}")
            if p.mismatches:
                shown = ", ".join(f"@{m.position}: ref {m.reference_token} cand {m.candidate_token} "
                                  f"margin {m.reference_margin:.4g}" for m in p.mismatches[:5])
                more = f" (+{p.num_mismatches - 5} more)" if p.num_mismatches > 5 else ""
                lines.append(f"  prompt {i}: first mismatch at {p.first_mismatch}; {shown}{more}")
        return "\n".join(lines)


def _choices(out: np.ndarray) -> np.ndarray:
    out = np.asarray(out)
    return out.argmax(-1) if out.ndim == 3 else out.astype(np.int64)


def _non_finite(out: np.ndarray, shape) -> np.ndarray:
    """[B, N] bool: positions whose logits hold a NaN or an infinity (choices-only outputs: none)."""
    out = np.asarray(out)
    return ~np.isfinite(out).all(-1) if out.ndim == 3 else np.zeros(shape, bool)


def compare(reference_out: np.ndarray, candidate_out: np.ndarray, forced: np.ndarray,
            tie_margin: float = DEFAULT_TIE_MARGIN) -> ForcingReport:
    """Compare two scorers' outputs ([B, N, V] logits or [B, N] choices) on the forced tokens [B, N]."""
    forced = np.asarray(forced)
    ref_choice, cand_choice = _choices(reference_out), _choices(candidate_out)
    margins = (top2_margin(reference_out) if np.ndim(reference_out) == 3
               else np.full(forced.shape, np.nan))
    bad_ref = _non_finite(reference_out, forced.shape)
    bad_cand = _non_finite(candidate_out, forced.shape)
    prompts = []
    for b in range(forced.shape[0]):
        unfilled = np.flatnonzero(forced[b] < 0)
        n = int(unfilled[0]) if unfilled.size else forced.shape[1]
        wrong = np.flatnonzero(cand_choice[b, :n] != forced[b, :n])
        mismatches = [Mismatch(int(i), int(forced[b, i]), int(cand_choice[b, i]), float(margins[b, i]),
                               bool(margins[b, i] < tie_margin)) for i in wrong]
        non_finite = [NonFinite(int(i), "both" if bad_ref[b, i] and bad_cand[b, i]
                                else "reference" if bad_ref[b, i] else "candidate")
                      for i in np.flatnonzero(bad_ref[b, :n] | bad_cand[b, :n])]
        prompts.append(PromptForcing(n, mismatches, int((ref_choice[b, :n] != forced[b, :n]).sum()),
                                     non_finite))
    return ForcingReport(prompts, tie_margin)


def _packed(prompts: Sequence[Sequence[int]], forced) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens, lengths = pack_prompts(prompts, cache_len=max(len(p) for p in prompts))
    forced = np.asarray(forced)
    if forced.ndim != 2 or forced.shape[0] != len(prompts):
        raise ValueError(f"forced tokens must be [prompts, N] = [{len(prompts)}, N], got shape {forced.shape}")
    return tokens, lengths, forced


def force(reference: Scorer, candidate: Scorer, prompts: Sequence[Sequence[int]], forced,
          tie_margin: float = DEFAULT_TIE_MARGIN) -> ForcingReport:
    """Run both scorers with the reference's output tokens `forced` ([B, N]) forced, and compare."""
    tokens, lengths, forced = _packed(prompts, forced)
    return compare(reference(tokens, lengths, forced), candidate(tokens, lengths, forced), forced,
                   tie_margin)


@dataclasses.dataclass
class PairedForcing:
    """A forcing report with both sides' per-position numbers, each [B, N]; positions past a row's end
    (`checked` False) hold -1 (choices) or NaN (the rest)."""

    report: ForcingReport
    checked: np.ndarray  # bool: the position was compared
    reference_choice: np.ndarray  # int64: argmax of the reference's logits
    candidate_choice: np.ndarray
    reference_margin: np.ndarray  # float64: top-1 minus top-2 logit
    candidate_margin: np.ndarray
    reference_top: np.ndarray  # float64: the reference's top-1 logit
    max_abs_diff: np.ndarray  # float64: max over the vocabulary of |candidate - reference| logits

    def mismatch_rows(self) -> list[dict]:
        """One dict per mismatch: prompt, position, both tokens, both sides' margins, near-tie or not."""
        return [dict(prompt=b, position=m.position, reference_token=m.reference_token,
                     candidate_token=m.candidate_token, reference_margin=m.reference_margin,
                     candidate_margin=float(self.candidate_margin[b, m.position]),
                     max_abs_logit_diff=float(self.max_abs_diff[b, m.position]), near_tie=m.near_tie)
                for b, p in enumerate(self.report.prompts) for m in p.mismatches]


def force_paired(reference: Scorer, candidate: Scorer, prompts: Sequence[Sequence[int]], forced,
                 tie_margin: float = DEFAULT_TIE_MARGIN) -> PairedForcing:
    """`force`, keeping both sides' choices, margins and logit differences at every position.

    Both scorers must return logits ([B, N, V]): margins need them."""
    tokens, lengths, forced = _packed(prompts, forced)
    ref, cand = np.asarray(reference(tokens, lengths, forced)), np.asarray(candidate(tokens, lengths, forced))
    if ref.ndim != 3 or cand.shape != ref.shape:
        raise ValueError(f"force_paired needs logits of one shape [B, N, V] from both scorers, got {ref.shape} "
                         f"and {cand.shape}")
    report = compare(ref, cand, forced, tie_margin)
    shape = forced.shape
    checked = np.zeros(shape, bool)
    choice = {k: np.full(shape, -1, np.int64) for k in ("ref", "cand")}
    num = {k: np.full(shape, np.nan) for k in ("ref_margin", "cand_margin", "top", "diff")}
    for b, p in enumerate(report.prompts):
        n = p.num_positions
        checked[b, :n] = True
        r, c = ref[b, :n], cand[b, :n]  # [n, V], the scorers' own dtype
        choice["ref"][b, :n], choice["cand"][b, :n] = r.argmax(-1), c.argmax(-1)
        num["ref_margin"][b, :n], num["cand_margin"][b, :n] = top2_margin(r), top2_margin(c)
        num["top"][b, :n] = r.max(-1)
        num["diff"][b, :n] = np.abs(c.astype(np.float64) - r).max(-1)
    return PairedForcing(report, checked, choice["ref"], choice["cand"], num["ref_margin"],
                         num["cand_margin"], num["top"], num["diff"])
