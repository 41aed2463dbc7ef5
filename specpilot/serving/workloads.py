"""Workloads that drive a serving engine and measure it: Poisson arrivals, and a fixed batch's steady state.
Design notes: docs/design/serving.md.
"""

from __future__ import annotations

import time

import numpy as np

from specpilot.serving.engine import Engine
from specpilot.serving.handles import DECODING
from specpilot.serving.pages import kv_bytes_per_slot
from specpilot.serving.request import Request


def percentile(values, q) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else float("nan")


def _ratio(a, b) -> float:
    return a / b if b else float("nan")


def stats_row(engine: Engine) -> dict:
    s = engine.stats
    return {"tokens_per_row_step": s.tokens_per_row_step, "steps": s.steps, "tokens_per_decode": s.tokens_per_decode,
            "verify_tokens_per_decode": s.verify_tokens_per_decode,
            "rows_verified_per_decode": s.rows_verified_per_decode,
            "rows_drafted_per_decode": s.rows_drafted_per_decode,
            "both_halves_busy_fraction": s.both_halves_busy_fraction,
            "forward_tokens_per_decode": _ratio(s.forward_tokens, s.decode_calls), **kv_row(engine)}


def kv_row(engine: Engine) -> dict:
    """The target's K/V bytes reserved per slot: contiguous, every slot's max_len; paged, the pages a row held
    on average over the steps it held any (the allocator's own counts, `EngineStats.pages_per_row`)."""
    per_position = kv_bytes_per_slot(engine.state.target_state)
    contiguous = per_position * engine.setup.max_len
    row = {"kv": engine.batching.kv, "kv_bytes_per_slot_contiguous": contiguous, "kv_bytes_per_slot": contiguous}
    if engine.paged is not None:
        layout, s = engine.paged.layout, engine.stats
        row.update(kv_bytes_per_slot=per_position * layout.page_size * s.pages_per_row, kv_page_size=layout.page_size,
                   kv_pages_per_row_mean=s.pages_per_row, kv_pages_peak=s.peak_pages, kv_pool_pages=layout.num_pages)
    return row


def _mean_length(committed: list[int], slots: list[int]) -> float:
    """Mean committed positions per slot in use over the sampled steps that had one."""
    pairs = [(c, s) for c, s in zip(committed, slots) if s]
    return float(np.mean([c / s for c, s in pairs])) if pairs else float("nan")


def slo_goodput(tpots: list, tokens: list[int], span_s: float, tpot_slo_s: float) -> dict:
    """Goodput at a time-per-output-token SLO: output tokens per second of the requests that met it (a
    request of one token has no TPOT and meets it), and the fraction of requests that met it."""
    met = [t is None or t <= tpot_slo_s for t in tpots]
    return {"tpot_slo_s": tpot_slo_s, "slo_met_fraction": float(np.mean(met)) if met else float("nan"),
            "goodput_tok_s": _ratio(sum(n for n, m in zip(tokens, met) if m), span_s)}


def run_workload(engine: Engine, requests: list[Request], rate: float, seed: int, tpot_slo_s: float | None = None):
    """Submit `requests` at Poisson arrival times (rate per second) and step until all are done
    -> (row, handles); with `tpot_slo_s`, the row has the goodput at that SLO too (`slo_goodput`)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(requests)))
    handles, nxt, slots_used, kv_used = [None] * len(requests), 0, [], []
    t0 = time.perf_counter()
    while nxt < len(requests) or engine.busy:
        now = time.perf_counter() - t0
        while nxt < len(requests) and arrivals[nxt] <= now:
            handles[nxt] = engine.submit(requests[nxt])
            nxt += 1
        if engine.busy:
            engine.step()
            slots_used.append(engine.slots_in_use)
            kv_used.append(engine.committed_tokens())
        elif nxt < len(requests):
            time.sleep(max(0.0, arrivals[nxt] - now))
    end = max(h.token_s[-1] for h in handles) - t0
    ttft = [h.token_s[0] - t0 - a for h, a in zip(handles, arrivals)]
    tpot = [h.tpot_s for h in handles if h.tpot_s is not None]
    out_tokens = sum(len(h.tokens) for h in handles)
    slo = ({} if tpot_slo_s is None else
           slo_goodput([h.tpot_s for h in handles], [len(h.tokens) for h in handles], end - arrivals[0], tpot_slo_s))
    return {"rate": rate, "requests": len(requests), "output_tokens": out_tokens,
            "throughput_tok_s": out_tokens / (end - arrivals[0]), **slo,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "slots_in_use_mean": float(np.mean(slots_used)), "slots_in_use_max": int(np.max(slots_used)),
            "kv_tokens_mean": float(np.mean(kv_used)), "kv_tokens_max": int(np.max(kv_used)),
            "kv_len_mean": _mean_length(kv_used, slots_used),
            "kv_tokens_capacity": engine.slots * engine.setup.max_len, **stats_row(engine)}, handles


def run_fixed(engine: Engine, requests: list[Request], device_calls: int = 0):
    """All `requests` (one per slot) submitted at t=0; the steady state is the steps in which every slot
    decodes (none prefilling, none finished) -> (row, handles). With device_calls > 0 the row also has
    `device_step_ms` (`Engine.device_step_ms`: decode calls back to back, no host work between) and
    `host_step_ms`, the rest of a steady-state step's wall time."""
    if len(requests) != engine.slots:
        raise ValueError(f"a fixed batch takes one request per slot: {len(requests)} requests, {engine.slots} slots")
    t0 = time.perf_counter()
    handles = [engine.submit(r) for r in requests]
    window_s, window_steps, window_tokens, first_token_s = 0.0, 0, 0, None
    kv_used, slots_used = [], []
    while engine.busy:
        # every slot decodes and has its first token (under pipelined dispatch a row is decoding from the
        # step its prompt ends in, and this call then reads that step's first tokens)
        full = all(h is not None and h.status == DECODING and h.tokens for h in engine.table)
        before = sum(len(h.tokens) for h in handles)
        s = time.perf_counter()
        engine.step()  # ends in a host sync (this step's tokens, or pipelined: the step before's)
        dt = time.perf_counter() - s
        kv_used.append(engine.committed_tokens())
        slots_used.append(engine.slots_in_use)
        if first_token_s is None and all(h.tokens for h in handles):
            first_token_s = time.perf_counter() - t0
        if full:
            window_s, window_steps = window_s + dt, window_steps + 1
            window_tokens += sum(len(h.tokens) for h in handles) - before
    total_s = time.perf_counter() - t0
    out_tokens = sum(len(h.tokens) for h in handles)
    split = {}
    if device_calls > 0:
        device_ms = engine.device_step_ms(device_calls)
        split = {"device_step_ms": device_ms, "host_step_ms": 1e3 * _ratio(window_s, window_steps) - device_ms}
    return {"rate": 0.0, "requests": len(requests), "output_tokens": out_tokens, "total_s": total_s,
            "prefill_s": first_token_s, "decode_steps": window_steps, "decode_s": window_s,
            "decode_tok_s": _ratio(window_tokens, window_s), "step_ms": 1e3 * _ratio(window_s, window_steps),
            "tokens_per_step": _ratio(window_tokens, window_steps),
            "ms_per_token": 1e3 * _ratio(window_s, window_tokens), "kv_len_mean": _mean_length(kv_used, slots_used),
            **split, **stats_row(engine)}, handles
