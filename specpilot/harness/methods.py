"""Running a plan on a deployment: one runner per verification kind, and its token-forcing scorer.

What runs is decided by the plan's fields alone (`verify` picks the runner; weights, kernels and block
size come from the plan); each run covers the whole prompt set, batch by batch, and `median_run` repeats it
and keeps the median. Design notes: docs/design/harness.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from specpilot.decoding import ar, spec, tree, two_level
from specpilot.forcing import chunked_scorer, tree_scorer, two_level_scorer
from specpilot.models.drafter import replay_reference
from specpilot.models.oracle import OracleDrafter
from specpilot.models.oracle_trace import OracleTraceDrafter
from specpilot.plan import Plan

# `on_batch(decode_s, decode_tokens)`, called by a runner as each batch ends (progress)
BatchCallback = Callable[[float, int], None]


@dataclasses.dataclass
class MethodRun:
    tokens: list[list[int]]  # generated tokens per prompt (prompt order)
    prefill_s: float  # total over batches
    decode_s: float  # total over batches
    # output tokens per sequence produced after prefill, summed over batches: decode time per output
    # token is then per-sequence latency (TPOT), and throughput is batch_size / TPOT
    decode_tokens: int
    stats: dict = dataclasses.field(default_factory=dict)  # verification-specific (tau, acceptance, ...)
    batch_times: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (decode_s, decode_tokens)
    # decode time per output token of every repeat `median_run` made (this run is their median)
    repeat_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def decode_time_per_token(self) -> float:
        # every row may stop at prefill's token (stop_at_eos): no decode step, no time per token
        return self.decode_s / self.decode_tokens if self.decode_tokens else float("nan")


def run_ar(dep, plan: Plan, on_batch: BatchCallback | None = None) -> MethodRun:
    params, target = dep.params_for(plan), dep.target_for(plan)
    tokens, prefill_s, decode_s, decode_tokens, batch_times = [], 0.0, 0.0, 0, []
    for batch in dep.batches():
        res = ar.generate(target, params, batch, dep.new_tokens, dep.sampling, key=dep.key,
                          cache_len=dep.cache_len, stop_token=dep.stop_token)
        tokens.extend(res.tokens.tolist())
        prefill_s += res.prefill_s
        decode_s += res.decode_s
        decode_tokens += res.decode_steps
        batch_times.append((res.decode_s, res.decode_steps))
        if on_batch:
            on_batch(res.decode_s, res.decode_steps)
    return MethodRun(tokens, prefill_s, decode_s, decode_tokens, batch_times=batch_times)


def replays_reference(drafter) -> bool:
    """Whether `drafter` is an oracle that replays the AR baseline's tokens (its runs need them first)."""
    return isinstance(drafter, (OracleDrafter, OracleTraceDrafter))


def _draft_params(dep, drafter, base, batch_index: int, batch):
    """The drafter's params for one batch: an oracle drafter replays the AR baseline's tokens."""
    if not replays_reference(drafter):
        return base
    if dep.reference_tokens is None:
        raise RuntimeError("an oracle drafter needs the AR baseline's tokens; run AR first")
    n = len(batch)
    continuation = dep.reference_tokens[batch_index * dep.batch_size:batch_index * dep.batch_size + n]
    return type(drafter).make_params(base, replay_reference(batch, continuation), seed=batch_index)


def _run_speculative(dep, plan: Plan, generate, on_batch: BatchCallback | None = None) -> MethodRun:
    """Every batch through `generate(target, params, drafter, draft_params, batch)` (a speculative
    loop's), with the tau / acceptance statistics summed over batches."""
    params, target = dep.params_for(plan), dep.target_for(plan)
    drafter, base = dep.drafter_for(plan)
    tokens, prefill_s, decode_s, decode_tokens, batch_times = [], 0.0, 0.0, 0, []
    steps, loop_steps, emitted, accepted, hist = 0, 0, 0, 0, None
    for i, batch in enumerate(dep.batches()):
        res = generate(target, params, drafter, _draft_params(dep, drafter, base, i, batch), batch)
        tokens.extend(res.tokens.tolist())
        prefill_s += res.prefill_s
        decode_s += res.decode_s
        decode_tokens += res.decode_steps
        batch_times.append((res.decode_s, res.decode_steps))
        if on_batch:
            on_batch(res.decode_s, res.decode_steps)
        st = res.stats
        steps += int(st.steps.sum())
        loop_steps += int(st.steps.max())  # a batch's loop runs until its longest row is done
        emitted += int(st.emitted.sum())
        accepted += int(st.accepted.sum())
        hist = st.accept_hist if hist is None else hist + st.accept_hist
    # per-position acceptance: fraction of verification steps that accepted draft k (k = 1..Bs-1)
    at_least = hist[::-1].cumsum()[::-1] / max(1, hist.sum())
    # tau counts the tokens a step emitted within the budget; upstream DFlash's mean acceptance length also
    # counts what the budget cut off in a sequence's last step (accepted drafts + 1, every step)
    stats = {"tau": emitted / max(1, steps), "acceptance_length_upstream": accepted / max(1, steps), "steps": steps,
             "loop_steps": loop_steps,
             "acceptance_per_position": [float(a) for a in at_least[1:]]}
    if hasattr(drafter, "trace_tau"):
        stats["trace_tau"] = drafter.trace_tau  # oracle acceptance: the tau its recorded trace gives
        stats["trace_sampled"] = bool(getattr(drafter, "sampled", False))  # sampled from the file's model
    return MethodRun(tokens, prefill_s, decode_s, decode_tokens, stats, batch_times)


def _chain_generate(dep, plan: Plan):
    def generate(target, params, drafter, draft_params, batch, **kw):
        return spec.generate(target, params, drafter, draft_params, batch, dep.new_tokens,
                             block_size=plan.block_size, sampling=dep.sampling, key=dep.key,
                             cache_len=dep.cache_len, stop_token=dep.stop_token, **kw)

    return generate


def profiled_chain_pass(dep, plan: Plan):
    """The chain plan's first batch through the profiled driver (each phase its own synced call, inside a
    "specpilot.draft" / ".verify" / ".accept" profiler span) -> its `SpecStats` (phase times filled)."""
    batch = dep.batches()[0]
    drafter, base = dep.drafter_for(plan)
    return _chain_generate(dep, plan)(dep.target_for(plan), dep.params_for(plan), drafter,
                                      _draft_params(dep, drafter, base, 0, batch), batch, profile=True).stats


def run_chain(dep, plan: Plan, on_batch: BatchCallback | None = None) -> MethodRun:
    """Block drafter + chain verification (greedy prefix match, or rejection sampling) with the plan's
    weights and kernels for target and drafter."""
    run = _run_speculative(dep, plan, _chain_generate(dep, plan), on_batch)
    if dep.profile_split:
        # A separate, profiled pass over the first batch (phases jitted apart and synced): it gives the
        # draft / verify / bookkeeping split without touching the timed runs above.
        prof = profiled_chain_pass(dep, plan)
        total = prof.draft_s + prof.verify_s + prof.bookkeeping_s
        if total > 0:  # zero only if every row stopped at prefill's token: no step to split
            run.stats["time_split"] = {"draft": prof.draft_s / total, "verify": prof.verify_s / total,
                                       "bookkeeping": prof.bookkeeping_s / total}
    return run


def run_tree(dep, plan: Plan, on_batch: BatchCallback | None = None) -> MethodRun:
    """Block drafter + tree verification (`decoding.tree`) at the plan's tree shape; acceptance per
    position counts accepted depth (k = 1..depth). No profiled split: the tree loop runs as one
    while loop."""
    shape = plan.tree

    def generate(target, params, drafter, draft_params, batch):
        return tree.generate(target, params, drafter, draft_params, batch, dep.new_tokens, nodes=shape.nodes,
                             depth=shape.depth, branching=shape.branching, sampling=dep.sampling, key=dep.key,
                             cache_len=dep.cache_len, stop_token=dep.stop_token)

    return _run_speculative(dep, plan, generate, on_batch)


def run_two_level(dep, plan: Plan, on_batch: BatchCallback | None = None) -> MethodRun:
    """Block drafter + two-level tree verification (`decoding.two_level`): the plan's tree cut to
    `two_level.keep` nodes by its first level, then verified; stats add the nodes each step verifies
    (and, for early exit, the nodes the first level's layers see)."""
    shape, level, head = plan.tree, plan.two_level, dep.exit_head_for(plan)

    def generate(target, params, drafter, draft_params, batch):
        return two_level.generate(target, params, drafter, draft_params, batch, dep.new_tokens,
                                  nodes=shape.nodes, depth=shape.depth, branching=shape.branching,
                                  first=level.first, keep=level.keep, exit_layer=level.exit_layer,
                                  exit_head=head, sampling=dep.sampling, key=dep.key, cache_len=dep.cache_len,
                                  stop_token=dep.stop_token)

    run = _run_speculative(dep, plan, generate, on_batch)
    run.stats["nodes_verified"] = level.keep
    if level.first == "early_exit":
        run.stats["first_level"] = {"nodes": shape.nodes, "layers": level.exit_layer,
                                    "target_layers": dep.cfg.num_layers,
                                    "head": "trained" if head is not None else "the target's"}
    return run


RUNNERS: dict[str, Callable] = {"ar": run_ar, "chain": run_chain, "tree": run_tree, "two_level": run_two_level}


def run_plan(dep, plan: Plan, on_batch: BatchCallback | None = None) -> MethodRun:
    """One pass of `plan` over the deployment's prompts; `on_batch(decode_s, decode_tokens)` hears each
    batch as it ends."""
    if plan.verify not in RUNNERS:
        raise NotImplementedError(f"plan {plan.name!r}: no runner for {plan.verify!r} verification")
    return RUNNERS[plan.verify](dep, plan, on_batch)


def scorer(dep, plan: Plan):
    """The forcing scorer reproducing `plan`'s target numerics (weights, kernels, verification width; for a
    tree plan a tree forward at its shape, `forcing.tree_scorer`)."""
    params, target = dep.params_for(plan), dep.target_for(plan)
    if plan.verify == "two_level":
        t, lv = plan.tree, plan.two_level
        depth = min(t.depth, lv.keep - 1)
        return two_level_scorer(params, target, t.nodes, depth, t.branching, lv.first, lv.keep, lv.exit_layer,
                                exit_head=dep.exit_head_for(plan))
    if plan.verify == "tree":
        t = plan.tree
        return tree_scorer(params, target, t.nodes, min(t.depth, t.nodes - 1), t.branching)  # N-node forwards
    return chunked_scorer(params, target, chunk=plan.block_size)


def median_run(run: Callable[[], MethodRun], repeats: int, name: str = "", progress=None) -> MethodRun:
    """Call `run` `repeats` times; keep the run with the median decode time (tokens are identical for greedy):
    of an even count, the faster of the two middle runs, so that 2 repeats give the warm run rather than the
    first one's warm-up. The kept run's `repeat_times` lists every repeat's decode time per token.
    `progress(message)`, if given, hears about each repetition as it ends."""
    runs = []
    for i in range(repeats):
        t0 = time.perf_counter()
        runs.append(run())
        if progress:
            progress(f"{name}: run {i + 1}/{repeats} in {time.perf_counter() - t0:.1f} s "
                     f"({1e3 * runs[-1].decode_time_per_token:.3f} ms/token)")
    order = np.argsort([r.decode_s for r in runs])
    kept = runs[int(order[(len(order) - 1) // 2])]
    kept.repeat_times = [r.decode_time_per_token for r in runs]
    return kept
