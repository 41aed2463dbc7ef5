"""Decoding methods by name: what `decoding.methods` in the config chooses from.

Design choices:
- A method is a function `Deployment -> MethodRun` registered under a name; the runner knows nothing
  else about it. New mechanisms register here and become a config override (`decoding.methods=[...]`).
- Each run repeats the whole prompt set `repeats` times after a warm-up and reports the median decode
  time per output token, so compile time never enters a number.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from specpilot.decoding import ar


@dataclasses.dataclass
class MethodRun:
    tokens: list[list[int]]  # generated tokens per prompt (prompt order)
    prefill_s: float  # total over batches
    decode_s: float  # total over batches
    # output tokens per sequence produced after prefill, summed over batches: decode time per output
    # token is then per-sequence latency (TPOT), and throughput is batch_size / TPOT
    decode_tokens: int
    stats: dict = dataclasses.field(default_factory=dict)  # method-specific (tau, acceptance, ...)

    @property
    def decode_time_per_token(self) -> float:
        return self.decode_s / self.decode_tokens


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    run: Callable
    needs_drafter: bool = False
    description: str = ""
    # Deployment -> forcing.Scorer reproducing this method's target numerics (weights, kernels, chunk
    # size); token forcing compares it with AR's, position by position
    scorer: Callable | None = None


def run_ar(dep, params=None) -> MethodRun:
    tokens, prefill_s, decode_s, decode_tokens = [], 0.0, 0.0, 0
    for batch in dep.batches():
        res = ar.generate(params or dep.params, dep.cfg, batch, dep.new_tokens, dep.sampling,
                          key=dep.key, cache_len=dep.cache_len)
        tokens.extend(res.tokens.tolist())
        prefill_s += res.prefill_s
        decode_s += res.decode_s
        decode_tokens += res.num_new_tokens - 1
    return MethodRun(tokens, prefill_s, decode_s, decode_tokens)


def run_stock(dep, params=None, drafter_params=None) -> MethodRun:
    """Block drafter + chain verification (greedy prefix match, or rejection sampling). `params` /
    `drafter_params` replace the deployment's target / drafter weights (e.g. in another format)."""
    from specpilot.decoding import spec
    from specpilot.models.drafter import replay_reference
    from specpilot.models.oracle import OracleDrafter

    drafter = dep.drafter[0]
    base_draft_params = dep.drafter[1] if drafter_params is None else drafter_params
    draft_params = base_draft_params
    tokens, prefill_s, decode_s, decode_tokens = [], 0.0, 0.0, 0
    steps, emitted, hist = 0, 0, None
    for i, batch in enumerate(dep.batches()):
        if isinstance(drafter, OracleDrafter):
            if dep.reference_tokens is None:
                raise RuntimeError("an oracle drafter needs the AR baseline's tokens; run AR first")
            continuation = dep.reference_tokens[i * dep.batch_size:(i + 1) * dep.batch_size]
            reference = replay_reference(batch, continuation)
            draft_params = OracleDrafter.make_params(base_draft_params, reference, seed=i)
        res = spec.generate(params or dep.params, dep.cfg, drafter, draft_params, batch, dep.new_tokens,
                            block_size=dep.block_size, sampling=dep.sampling, key=dep.key,
                            cache_len=dep.cache_len)
        tokens.extend(res.tokens.tolist())
        prefill_s += res.prefill_s
        decode_s += res.decode_s
        decode_tokens += res.num_new_tokens - 1
        st = res.stats
        steps += int(st.steps.sum())
        emitted += int(st.emitted.sum())
        hist = st.accept_hist if hist is None else hist + st.accept_hist
    # per-position acceptance: fraction of verification steps that accepted draft k (k = 1..Bs-1)
    at_least = hist[::-1].cumsum()[::-1] / max(1, hist.sum())
    stats = {"tau": emitted / max(1, steps), "steps": steps,
             "acceptance_per_position": [float(a) for a in at_least[1:]]}
    if dep.profile_split:
        # A separate, profiled pass over the first batch (phases jitted apart and synced): it gives the
        # draft / verify / bookkeeping split without touching the timed runs above.
        batch = dep.batches()[0]
        if isinstance(drafter, OracleDrafter):
            draft_params = OracleDrafter.make_params(
                base_draft_params, replay_reference(batch, dep.reference_tokens[:len(batch)]), seed=0)
        prof = spec.generate(params or dep.params, dep.cfg, drafter, draft_params, batch,
                             dep.new_tokens, block_size=dep.block_size, sampling=dep.sampling,
                             key=dep.key, cache_len=dep.cache_len, profile=True).stats
        total = prof.draft_s + prof.verify_s + prof.bookkeeping_s
        stats["time_split"] = {"draft": prof.draft_s / total, "verify": prof.verify_s / total,
                               "bookkeeping": prof.bookkeeping_s / total}
    return MethodRun(tokens, prefill_s, decode_s, decode_tokens, stats)


def _scorer(params_of, chunk_of):
    def make(dep):
        from specpilot.forcing import chunked_scorer

        return chunked_scorer(params_of(dep), dep.cfg, chunk=chunk_of(dep))
    return make


def _bf16(dep):
    return dep.params


def _w12(dep):
    return dep.encoded("w12")


def _twin(dep):
    return dep.twin()


def _one(dep):
    return 1


def _block(dep):
    return dep.block_size


METHODS: dict[str, Method] = {
    "ar": Method("ar", run_ar, description="autoregressive baseline, one token per target step",
                 scorer=_scorer(_bf16, _one)),
    "stock": Method("stock", run_stock, needs_drafter=True,
                    description="block drafter + chain verification, bf16 weights",
                    scorer=_scorer(_bf16, _block)),
    "ar_w12": Method("ar_w12", lambda dep: run_ar(dep, _w12(dep)),
                     description="AR with the lossless 12-bit weight format",
                     scorer=_scorer(_w12, _one)),
    "ar_twin": Method("ar_twin", lambda dep: run_ar(dep, _twin(dep)),
                      description="AR with bf16 weights through the Mosaic W12 kernel's bf16 twin (tiled once): "
                                  "the bf16 baseline with W12's kernel structure",
                      scorer=_scorer(_twin, _one)),
    "stock_w12": Method("stock_w12", lambda dep: run_stock(dep, _w12(dep), dep.encoded_drafter("w12")),
                        needs_drafter=True,
                        description="stock with the lossless 12-bit weight format (target and drafter)",
                        scorer=_scorer(_w12, _block)),
}


def register(method: Method) -> None:
    METHODS[method.name] = method


def median_run(method: Method, dep, repeats: int, progress=None) -> MethodRun:
    """Run `repeats` times; keep the run with the median decode time (tokens are identical for greedy): of an
    even count, the faster of the two middle runs, so that 2 repeats give the warm run rather than the first
    one's warm-up. `progress(message)`, if given, hears about each repetition as it ends."""
    runs = []
    for i in range(repeats):
        t0 = time.perf_counter()
        runs.append(method.run(dep))
        if progress:
            progress(f"{method.name}: run {i + 1}/{repeats} in {time.perf_counter() - t0:.1f} s "
                     f"({1e3 * runs[-1].decode_time_per_token:.3f} ms/token)")
    order = np.argsort([r.decode_s for r in runs])
    return runs[int(order[(len(order) - 1) // 2])]
