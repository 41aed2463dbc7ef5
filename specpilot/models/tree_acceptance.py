"""A few-parameter model of how many drafts a chain and a best-first top-B tree accept per step, calibrated
to a published drafter (DFlash + DDTree on Qwen3-8B): it fits, predicts tau by node budget, and samples
seeded per-step accepted depths that `drafter=oracle_trace` replays at real shapes. Design notes:
docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
from pathlib import Path

import numpy as np

DEPTH = 15  # DFlash block 16: the bonus token and 15 draft positions
CONFIDENCE_CAP = 1.0 - 1e-9  # q < 1 keeps every top-B set prefix-closed (a child scores below its parent)


@dataclasses.dataclass(frozen=True)
class ForkModel:
    """Per position, the drafter's top-1 confidence p in [1/2, 1), the rest of its mass on one alternative
    (rank 2); the target takes rank 1 with probability p and rank 2 with 1 - p, until its path has taken a
    rank 2: from the next position on both are scaled by `coherence` (the drafter's later marginals were
    drawn for the rank-1 context), the rest a token no tree holds. 1 - p = x / 2 with
    x ~ Kumaraswamy(spread, b_d), b_d set so E[p] = hazard[d]."""
    hazard: tuple[float, ...]  # the chain's per-depth acceptance given the depth is reached
    spread: float  # Kumaraswamy shape: small = positions either sure or a near 50/50 fork
    coherence: float  # per-position factor on the target's match once its path left the rank-1 chain

    @property
    def depth(self) -> int:
        return len(self.hazard)


def chain_hazard(hist_percent, tau: float) -> np.ndarray:
    """Per-depth chain acceptance from an acceptance-length histogram (lengths 1..D+1, bonus counted),
    its miss rates scaled by one factor so the chain's tau is `tau` exactly."""
    h = np.asarray(hist_percent, float) / np.sum(hist_percent)
    surv = np.cumsum(h[::-1])[::-1]
    miss = 1.0 - surv[1:] / surv[:-1]
    lo, hi = 0.0, 1.0 / miss.max()
    for _ in range(100):  # chain tau falls as the miss rates grow
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_tau(1.0 - miss * mid) > tau else (lo, mid)
    return 1.0 - miss * (lo + hi) / 2


def chain_tau(hazard) -> float:
    return 1.0 + float(np.cumprod(hazard).sum())


def _kumaraswamy_mean(a: float, b: float) -> float:
    return math.exp(math.log(b) + math.lgamma(1 + 1 / a) + math.lgamma(b) - math.lgamma(1 + 1 / a + b))


def _kumaraswamy_b(a: float, mean: float) -> float:
    """The b with Kumaraswamy(a, b) mean `mean` (the mean falls as b grows)."""
    lo, hi = -30.0, 30.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _kumaraswamy_mean(a, math.exp(mid)) > mean else (lo, mid)
    return math.exp((lo + hi) / 2)


def confidences(model: ForkModel, uniforms: np.ndarray) -> np.ndarray:
    """uniforms [S, D] -> the drafter's top-1 confidence per step and position [S, D] (inverse CDF)."""
    b = np.array([_kumaraswamy_b(model.spread, 2.0 * (1.0 - a)) for a in model.hazard])
    x = (1.0 - (1.0 - uniforms) ** (1.0 / b[None])) ** (1.0 / model.spread)
    return np.clip(1.0 - x / 2.0, 0.5, CONFIDENCE_CAP)


def uniforms(steps: int, depth: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((steps, depth))


def top_tree(p: np.ndarray, budget: int):
    """The budget highest-scoring rank paths (score = the product of the drafter's marginals, p for rank 1
    and 1 - p for rank 2) per step: the best-first top-B tree, by a per-depth beam of width B (a depth-d
    path in the top B has its parent in the depth-(d-1) top B). -> (depth [S, B], code [S, B]: the ranks
    taken as bits, bit i = rank 2 at depth i + 1), or None entries where a step has fewer paths."""
    s, d_max = p.shape
    logq = np.stack([np.log(p), np.log1p(-p)], -1)  # [S, D, 2]
    score, code = np.zeros((s, 1)), np.zeros((s, 1), np.int64)
    scores, codes, depths = [], [], []
    for d in range(d_max):
        cand = (score[:, :, None] + logq[:, d, None, :]).reshape(s, -1)
        ccode = (code[:, :, None] + (np.arange(2, dtype=np.int64) << d)[None, None]).reshape(s, -1)
        if cand.shape[1] > budget:
            keep = np.argpartition(-cand, budget - 1, axis=1)[:, :budget]
            cand, ccode = np.take_along_axis(cand, keep, 1), np.take_along_axis(ccode, keep, 1)
        score, code = cand, ccode
        scores.append(cand), codes.append(ccode), depths.append(np.full(cand.shape, d + 1))
    scores, codes, depths = (np.concatenate(x, 1) for x in (scores, codes, depths))
    if scores.shape[1] > budget:
        keep = np.argpartition(-scores, budget - 1, axis=1)[:, :budget]
        codes, depths = np.take_along_axis(codes, keep, 1), np.take_along_axis(depths, keep, 1)
    return depths, codes


def _truth_prefix(p: np.ndarray, coherence: float, depths: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The probability that the target's continuation starts with each tree node's path [S, B]."""
    s, d_max = p.shape
    out = np.ones(depths.shape)
    for d in range(d_max):
        bit = (codes >> d) & 1
        off = (codes & ((1 << d) - 1)) != 0  # the path took a rank 2 above depth d + 1
        q = np.where(bit == 1, 1.0 - p[:, d, None], p[:, d, None]) * np.where(off, coherence, 1.0)
        out *= np.where(depths > d, q, 1.0)
    return out


def survival(model: ForkModel, budget: int | None, steps: int = 1024, seed: int = 0) -> np.ndarray:
    """Expected P(accepted >= d) for d = 1..D, averaged over `steps` seeded steps (each step's tree is exact
    given its confidences): budget None is the chain (the rank-1 path), else the top-`budget` tree."""
    if budget is None:
        return np.cumprod(model.hazard)
    p = confidences(model, uniforms(steps, model.depth, seed))
    depths, codes = top_tree(p, budget)
    truth = _truth_prefix(p, model.coherence, depths, codes)
    return np.array([(truth * (depths == d)).sum(1).mean() for d in range(1, model.depth + 1)])


def tau(model: ForkModel, budget: int | None, steps: int = 1024, seed: int = 0) -> float:
    return 1.0 + float(survival(model, budget, steps, seed).sum())


def length_histogram(model: ForkModel, budget: int | None, steps: int = 1024, seed: int = 0) -> np.ndarray:
    """Fractions of steps by acceptance length 1..D+1 (bonus counted)."""
    surv = np.concatenate([[1.0], survival(model, budget, steps, seed), [0.0]])
    return surv[:-1] - surv[1:]


def sample_accepted(model: ForkModel, budget: int | None, steps: int, seed: int,
                    max_depth: int | None = None) -> np.ndarray:
    """Seeded per-step accepted drafts [steps]: each step draws its confidences and the target's ranks,
    then accepts the longest prefix of that path the chain (budget None) or the top-`budget` tree holds.
    `max_depth`: the chain or tree drafts only the first max_depth positions (a shorter block, a tree of
    that depth); the draws are the same for every budget and depth (common random numbers)."""
    rng = np.random.default_rng(seed)
    p = confidences(model, rng.random((steps, model.depth)))
    r, kept = rng.random((steps, model.depth)), rng.random((steps, model.depth))
    rank = np.where(r < p, 0, 1)
    off = np.concatenate([np.zeros((steps, 1), bool), np.cumsum(rank, axis=1)[:, :-1] > 0], 1)
    rank = np.where(off & (kept >= model.coherence), 2, rank)  # 2: a token no tree holds
    depth = model.depth if max_depth is None else max_depth
    if not 1 <= depth <= model.depth:
        raise ValueError(f"max_depth must be in 1..{model.depth} (the model's positions), got {max_depth}")
    p, rank = p[:, :depth], rank[:, :depth]
    if budget is None:
        return np.argmax(np.concatenate([rank, np.ones((steps, 1), int)], 1) != 0, axis=1)
    depths, codes = top_tree(p, budget)
    room = 1 << depth
    held = np.sort((np.arange(steps)[:, None] * (depth + 1) + depths) * room + codes, axis=None)
    path = np.cumsum(np.minimum(rank, 1) << np.arange(depth), axis=1)  # prefix codes [S, D]
    keys = (np.arange(steps)[:, None] * (depth + 1) + np.arange(1, depth + 1)) * room + path
    pos = np.minimum(np.searchsorted(held, keys), held.size - 1)
    inside = (held[pos] == keys) & np.cumprod(rank < 2, axis=1).astype(bool)
    return np.cumprod(inside, axis=1).sum(1)


def to_record(model: ForkModel) -> dict:
    """The model as plain data (a step trace file's `model`)."""
    return {"kind": "ForkModel", "hazard": [float(h) for h in model.hazard], "spread": float(model.spread),
            "coherence": float(model.coherence)}


def from_record(record) -> ForkModel:
    """A ForkModel from `to_record`'s data; a clear error naming what is wrong otherwise."""
    if not isinstance(record, dict) or record.get("kind") != "ForkModel":
        raise ValueError(f"a tree acceptance model record has kind 'ForkModel', got {record!r:.80}")
    hazard = record.get("hazard")
    if not isinstance(hazard, list) or not hazard or not all(isinstance(h, (int, float)) and 0 < h < 1
                                                              for h in hazard):
        raise ValueError("a ForkModel's hazard is a non-empty list of probabilities in (0, 1)")
    spread, coherence = record.get("spread"), record.get("coherence")
    if not isinstance(spread, (int, float)) or spread <= 0:
        raise ValueError(f"a ForkModel's spread is a positive number, got {spread!r}")
    if not isinstance(coherence, (int, float)) or not 0 <= coherence <= 1:
        raise ValueError(f"a ForkModel's coherence is in [0, 1], got {coherence!r}")
    return ForkModel(tuple(float(h) for h in hazard), float(spread), float(coherence))


def fit(hazard, budget: int, tree_tau: float, tree_hist_percent, spreads=None, steps: int = 512,
        seed: int = 0) -> tuple[ForkModel, dict]:
    """Fit spread and coherence at ONE budget: for each spread, coherence solves tau(budget) = tree_tau (tau
    grows with it); the spread kept is the one whose acceptance-length histogram at that budget is nearest
    (squared error) to tree_hist_percent. -> (model, {spread: histogram error}) ."""
    target = np.asarray(tree_hist_percent, float) / np.sum(tree_hist_percent)
    spreads = spreads if spreads is not None else np.geomspace(0.15, 4.0, 12)
    best, errors = None, {}
    for a in spreads:
        lo, hi = 0.0, 1.0
        base = ForkModel(tuple(float(h) for h in hazard), float(a), 1.0)
        if tau(base, budget, steps, seed) < tree_tau:
            errors[float(a)] = math.inf  # even a lossless tree falls short
            continue
        for _ in range(30):
            mid = (lo + hi) / 2
            m = dataclasses.replace(base, coherence=mid)
            lo, hi = (lo, mid) if tau(m, budget, steps, seed) > tree_tau else (mid, hi)
        m = dataclasses.replace(base, coherence=(lo + hi) / 2)
        err = float(((length_histogram(m, budget, steps, seed) - target) ** 2).sum())
        errors[float(a)] = err
        if best is None or err < errors[best.spread]:
            best = m
    if best is None:
        raise ValueError(f"no spread reaches tau {tree_tau} at budget {budget}; widen the spreads tried")
    return best, errors


def load_published(path) -> dict:
    return json.loads(Path(path).read_text())


# A reference for the tests: the best-first heap over rank tuples, and exhaustive enumeration.

def best_first_tree(marginals, budget: int) -> set[tuple[int, ...]]:
    """marginals [D][K] (each sorted descending, every entry in (0, 1)) -> the top-`budget` rank tuples by
    product score, popping the best and pushing its next sibling and first child."""
    heap = [(-marginals[0][0], (0,))]
    tree = set()
    while heap and len(tree) < budget:
        neg, ranks = heapq.heappop(heap)
        tree.add(ranks)
        d, k = len(ranks) - 1, ranks[-1]
        if k + 1 < len(marginals[d]):
            heapq.heappush(heap, (neg / marginals[d][k] * marginals[d][k + 1], ranks[:-1] + (k + 1,)))
        if d + 1 < len(marginals):
            heapq.heappush(heap, (neg * marginals[d + 1][0], ranks + (0,)))
    return tree


def enumerate_acceptance(truth, tree: set[tuple[int, ...]]) -> float:
    """Expected accepted drafts of `tree` over every target continuation (ranks per depth; truth [D][K]
    the target's rank probabilities, a row summing to < 1 leaves the rest on tokens outside every tree)."""
    total = 0.0
    for path in itertools.product(*(range(len(row)) for row in truth)):
        prob = math.prod(row[k] for row, k in zip(truth, path))
        total += prob * max((d for d in range(1, len(path) + 1) if path[:d] in tree), default=0)
    return total
