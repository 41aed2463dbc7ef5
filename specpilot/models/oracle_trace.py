"""Oracle acceptance from a recorded per-step trace: replays how many drafts each verification step of a
trained pair accepted, for chain and tree verification at real shapes, while the real drafter forward,
tree builder and verifier run. Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.models import tree_acceptance

STRIDE = 7919  # spreads the rows' start points over the trace
MODEL_STEPS, MODEL_SEED = 4096, 7  # a plan's trace sampled from the file's model (one seed: common draws)


ROOT = Path(__file__).resolve().parents[2]


def trace_path(path) -> Path:
    """A step trace's file: a relative path is read from the working directory, else the repository."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.is_file() else ROOT / p


def load_traces(path) -> dict:
    """A trace file's methods: name -> {"verify", "shape", "accepted": [per-step accepted drafts]}."""
    p = trace_path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no step trace at {p} (write one with experiments/bench/record_trace.py)")
    data = json.loads(p.read_text())
    methods = data.get("methods") if isinstance(data, dict) else None
    if not isinstance(methods, dict) or not methods:
        raise ValueError(f"{p}: a step trace holds {{'methods': {{name: {{'accepted': [...]}}}}}}")
    for name, m in methods.items():
        acc = m.get("accepted") if isinstance(m, dict) else None
        if not acc or not all(isinstance(a, int) and a >= 0 for a in acc):
            raise ValueError(f"{p}: method {name!r} needs a non-empty list of accepted drafts (integers >= 0)")
    return methods


def load_model(path):
    """A trace file's acceptance model (`tree_acceptance.ForkModel`), from which a trace is sampled for
    plans it has no recorded method for; None if the file holds none."""
    data = json.loads(trace_path(path).read_text())
    record = data.get("model") if isinstance(data, dict) else None
    if record is None:
        return None
    try:
        return tree_acceptance.from_record(record)
    except ValueError as e:
        raise ValueError(f"{trace_path(path)}: model: {e}") from None


def model_shape(plan, depth: int) -> tuple[int | None, int]:
    """(node budget, drafted depth) of `plan` under a model of `depth` positions: a chain (budget None)
    drafts block_size - 1 positions; a tree of N nodes drafts the top N - 1 paths by the drafter's marginals
    (branching 1: a chain of its depth); a two_level plan whose first level is the drafter's confidence
    keeps its `keep` best such paths, which is the tree of `keep` nodes."""
    if plan.tree is None:
        budget, drafted = None, plan.block_size - 1
    else:
        budget, drafted = plan.tree.nodes - 1, plan.tree.depth
        if plan.two_level is not None:
            if plan.two_level.first != "drafter_confidence":
                raise ValueError(f"plan {plan.name!r}: the acceptance model scores paths by the drafter's "
                                 f"marginals; a {plan.two_level.first!r} first level has no trace here")
            budget = plan.two_level.keep - 1
        if plan.tree.branching == 1:
            budget, drafted = None, min(drafted, budget)
    if drafted > depth:
        raise ValueError(f"plan {plan.name!r} drafts {drafted} positions; the acceptance model has {depth}")
    return budget, drafted


def sample_for_plan(model, plan, steps: int = MODEL_STEPS, seed: int = MODEL_SEED) -> np.ndarray:
    """Per-step accepted drafts of `plan`'s shape sampled from `model` (the same draws for every plan)."""
    budget, drafted = model_shape(plan, model.depth)
    return np.array(_sampled(model, budget, drafted, steps, seed))


@functools.lru_cache(maxsize=256)
def _sampled(model, budget, drafted: int, steps: int, seed: int) -> tuple[int, ...]:
    # a warm worker and the loop's predictions ask for the same shapes round after round (0.1-0.5 s each)
    return tuple(int(a) for a in tree_acceptance.sample_accepted(model, budget, steps, seed, max_depth=drafted))


def trace_label(path) -> str:
    """A trace file's label (what its acceptance is, e.g. "calibrated to DDTree (published)"), else ""."""
    data = json.loads(trace_path(path).read_text())
    return str(data.get("label") or "") if isinstance(data, dict) else ""


def trace_method(plan_name: str) -> str:
    """The recorded method a plan replays: its own name, less an `oracle_` prefix (which labels it)."""
    return plan_name[len("oracle_"):] if plan_name.startswith("oracle_") else plan_name


def trace_tau(accepted) -> float:
    """Tokens per step a trace gives: its mean accepted drafts plus the bonus token."""
    return float(np.mean(accepted)) + 1.0


@dataclasses.dataclass(frozen=True)
class OracleTraceDrafter:
    inner: Any  # the real drafter whose forward is timed and whose candidates fill the tree
    traces: tuple[tuple[str, tuple[int, ...]], ...]  # (method name, per-step accepted drafts)
    trace: tuple[int, ...] = ()  # the active plan's (`for_plan`)
    source: str = ""
    confidence: float = 30.0
    model: Any = None  # the file's acceptance model: plans with no recorded method get a sampled trace
    sampled: bool = False  # the active trace was sampled from `model` for the plan's shape

    @classmethod
    def from_traces(cls, inner, methods: dict, source: str = "", model=None) -> "OracleTraceDrafter":
        return cls(inner, tuple((k, tuple(int(a) for a in m["accepted"])) for k, m in methods.items()),
                   source=source, model=model)

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def vocab_size(self) -> int:
        return self.inner.cfg.vocab_size

    @property
    def trace_tau(self) -> float:
        return trace_tau(self.trace)

    def with_trace(self, accepted) -> "OracleTraceDrafter":
        return dataclasses.replace(self, trace=tuple(int(a) for a in accepted), sampled=False)

    def for_plan(self, plan) -> "OracleTraceDrafter":
        """This drafter replaying `plan`'s recorded trace (by name), checked against the plan's shape; a plan
        with none, a trace sampled for its shape from the file's model (if it has one)."""
        traces = dict(self.traces)
        name = trace_method(plan.name)
        if name not in traces:
            if self.model is None:
                raise ValueError(f"plan {plan.name!r}: the step trace {self.source} has no method {name!r} "
                                 f"and no acceptance model to sample one from; it has {sorted(traces)}")
            return dataclasses.replace(self.with_trace(sample_for_plan(self.model, plan)), sampled=True)
        trace = traces[name]
        longest = max(trace)
        if plan.tree is not None:
            room = min(plan.tree.depth, plan.tree.nodes - 1)
            if plan.two_level is not None:
                room = min(room, plan.two_level.keep - 1)
        else:
            room = plan.block_size - 1
        if longest > room:
            raise ValueError(f"plan {plan.name!r}: its trace accepts {longest} drafts in a step; the plan's "
                             f"shape holds paths of at most {room}")
        return self.with_trace(trace)

    def with_matmul(self, choice) -> "OracleTraceDrafter":
        return dataclasses.replace(self, inner=self.inner.with_matmul(choice))

    def with_mesh(self, mesh) -> "OracleTraceDrafter":
        return dataclasses.replace(self, inner=self.inner.with_mesh(mesh))

    @staticmethod
    def make_params(inner_params, reference: np.ndarray, seed: int = 0) -> dict:
        """reference [B, R]: each row's prompt then the target's greedy continuation, by position;
        seed: the batch's index (its rows start elsewhere in the trace)."""
        b = reference.shape[0]
        return {"inner": inner_params, "reference": jnp.asarray(reference, jnp.int32),
                "start": jnp.asarray((np.arange(b) + seed * b) * STRIDE, jnp.int32)}

    def init_state(self, params, batch_size: int, max_len: int, dtype=None):
        return {"inner": self.inner.init_state(params["inner"], batch_size, max_len, dtype),
                "extends": jnp.zeros((batch_size,), jnp.int32)}

    def extend(self, params, target_params, state, taps, n_new):
        inner = self.inner.extend(params["inner"], target_params, state["inner"], taps, n_new)
        return {"inner": inner, "extends": state["extends"] + (n_new > 0).astype(jnp.int32)}

    def propose(self, params, target_params, state, last_tokens, block_size: int):
        if not self.trace:
            raise ValueError("an oracle trace drafter needs a trace: for_plan(plan) or with_trace(...)")
        real, inner = self.inner.propose(params["inner"], target_params, state["inner"], last_tokens, block_size)
        real = jnp.nan_to_num(real.astype(jnp.float32), nan=0.0, posinf=0.0, neginf=0.0)  # [B, P, V]
        trace = jnp.asarray(self.trace, jnp.int32)
        step = jnp.maximum(state["extends"] - 1, 0)  # the prompt's extend comes first
        a = trace[(params["start"] + step) % trace.shape[0]]  # [B] drafts this step accepts
        ref = params["reference"]
        length = inner.lengths  # [B] committed; draft position k sits at length + k
        p = real.shape[1]
        pos = length[:, None] + 1 + jnp.arange(p, dtype=jnp.int32)[None, :]
        right = jnp.take_along_axis(ref, jnp.minimum(pos, ref.shape[1] - 1), axis=1)  # [B, P]
        is_right = jax.nn.one_hot(right, real.shape[-1], dtype=bool)
        k = jnp.arange(p, dtype=jnp.int32)[None, :]
        top = real.max(axis=-1, keepdims=True) + self.confidence
        bottom = real.min(axis=-1, keepdims=True) - self.confidence
        logits = jnp.where(is_right & (k < a[:, None])[..., None], top,
                           jnp.where(is_right & (k == a[:, None])[..., None], bottom, real))
        return logits, {"inner": inner, "extends": state["extends"]}
