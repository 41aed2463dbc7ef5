"""Step timings on this device. A measured step cost for the confidence chooser: one decode's draft stage
and its packed verify forward (`stream_forward`, the branch a step runs) at each stream size, timed with
the engine's shapes, as `StepCost` points (where the cost model is not calibrated, a CPU's products are
not free at 4-16 rows, this prices what a step really costs at each size). And an engine's device share
of a step: decode calls back to back, no host work between them.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.decoding.sampling import RequestSampling
from specpilot.serving import slots as sl
from specpilot.serving.budget import StepCost
from specpilot.serving.packed import stream_forward


def _median_s(fn, args, repeats: int) -> float:
    """Median wall seconds of fn(*args) after one warm call."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def spread(total: int, rows: int, block: int) -> np.ndarray:
    """`total` verification tokens over `rows` rows as evenly as the block allows (each row 1..block)."""
    if not rows <= total <= rows * block:
        raise ValueError(f"{total} tokens do not fit {rows} rows of 1..{block} tokens")
    counts = np.full(rows, total // rows, np.int32)
    counts[: total % rows] += 1
    return counts


def measure_step_cost(setup: sl.EngineSetup, target_params, draft_params, slots: int, context: int,
                      repeats: int = 5) -> StepCost:
    """StepCost points (n, draft + verify(n)) for each of the setup's packed stream sizes n (or its token
    budget), with every row's committed context at `context` tokens."""
    if setup.verify != "packed" or not setup.uses_drafter:
        raise ValueError("a measured step cost prices packed verification of a drafted chain "
                         "(batching.verify: packed)")
    if not 0 <= context <= setup.context_len:
        raise ValueError(f"context {context} is outside the engine's 0..{setup.context_len} positions")
    state = sl.init_slots(setup, draft_params, slots)
    ts = state.target_state.commit(jnp.full((slots,), context, jnp.int32))
    propose = jax.jit(lambda dp, tp, ds, last: setup.drafter.propose(dp, tp, ds, last, setup.block_size)[0])
    draft_s = _median_s(propose, (draft_params, target_params, state.draft_state, state.last), repeats)
    points = []
    block = jnp.zeros((slots, setup.block_size), jnp.int32)
    for n in setup.stream_sizes or (setup.token_budget,):
        counts = jnp.asarray(spread(min(n, slots * setup.block_size), slots, setup.block_size))
        forward = jax.jit(lambda tp, b, c, s, n=n: stream_forward(setup.target, tp, b, c, s, n))
        verify_s = _median_s(forward, (target_params, block, counts, ts), repeats)
        points.append((int(n), draft_s + verify_s))
    return StepCost(points=tuple(points))


def device_step_ms(engine, calls: int = 20) -> float:
    """Milliseconds one decode call of `engine` takes when `calls` of them run back to back with no host work
    between them (greedy, every row computed, none committed): the device's share of a step, against
    which `step()`'s wall time shows the host's. Call it between workloads (it leaves every row's
    committed length as it was; halves engines time their first half's call)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    which = "halves0" if engine.overlap is not None else "decode"
    full_pages = engine.state.pages
    if engine.last_window:  # paged K/V: the page-table window the engine's last step read
        which += "@" + engine.last_window
        engine.state = dataclasses.replace(engine.state, pages=engine.paged.table_window(int(engine.last_window)))
    exe, idle = engine._exe(which, True), np.zeros(engine.slots, bool)
    sampling = RequestSampling(np.zeros(engine.slots, np.float32), np.ones(engine.slots, np.float32), greedy=True,
                               top_k=engine.setup.top_k)

    def call():
        if engine.overlap is not None:
            engine.state, engine.prepared, *_ = exe(engine.target_params, engine.draft_params, engine.state,
                                                    engine.prepared, idle, idle, sampling)
        else:
            engine.state, *_ = exe(engine.target_params, engine.draft_params, engine.state, idle, sampling)

    call()  # the first call after host work may include transfers
    jax.block_until_ready(engine.state)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    jax.block_until_ready(engine.state)
    if engine.last_window:
        engine.state = dataclasses.replace(engine.state, pages=full_pages)
    return 1e3 * (time.perf_counter() - t0) / calls
