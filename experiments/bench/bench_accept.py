"""What the accept stage costs: greedy prefix matching against rejection sampling, jitted, on random logits.

    PYTHONPATH=. python experiments/bench/bench_accept.py [--vocab 49152,151936] [--blocks 4,8,16]
        [--batch 1,16] [--trials 30] [--settings 0.7:1:0,0.7:0.9:0,0.7:0.95:50] [--baseline COMMIT] [--trace-top N]

One chain verification's accept (`rejection.verify_chain`) over drafts [B, Bs-1], draft logits
[B, Bs-1, V] and target logits [B, Bs, V], the drafts' own sampling (`rejection.choose_drafts`), and the
serving engine's row-by-row accept (`slots.verify_rows`). Greedy, then each temperature:top_p:top_k
setting. Greedy and sampled accepts are timed in turn within each trial (the machine may be shared), so
"x greedy" is the median of the per-trial ratios, with its interquartile range; other columns are medians.
The default deployment verifies block 4 of SmolLM2-135M (vocabulary 49152); Qwen3-8B's is 151936.
--baseline COMMIT also times that commit's decoding/{nucleus,sampling,rejection}.py in the same trials
(rows "base ..."): before and after from one run.
"""

import argparse
import importlib
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from specpilot.decoding.rejection import choose_drafts, verify_chain
from specpilot.decoding.sampling import SamplingConfig
from specpilot.harness.bench import median_ms, traced_kernels
from specpilot.serving.slots import verify_rows


def inputs(batch: int, block: int, vocab: int, seed: int = 0):
    """Logits shaped like a trained pair's: a peaked target, a drafter close to it, drafts its argmax."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    target = 4.0 * jax.random.normal(k1, (batch, block, vocab), jnp.float32)
    draft = target[:, :-1] + jax.random.normal(k2, (batch, block - 1, vocab), jnp.float32)
    drafts = jnp.argmax(draft, axis=-1).astype(jnp.int32)
    return drafts, draft, target


def parse_settings(text: str) -> dict[str, SamplingConfig]:
    """"0.7:0.9:50,..." -> {"t0.7 p0.9 k50": SamplingConfig, ...} (top_p 1 and top_k 0 left out of names)."""
    settings = {}
    for item in text.split(","):
        temperature, top_p, top_k = item.split(":")
        name = f"t{float(temperature):g}" + (f" p{float(top_p):g}" if float(top_p) < 1 else "") + (
            f" k{int(top_k)}" if int(top_k) else "")
        settings[name] = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    return settings


def baseline_modules(commit: str):
    """(verify_chain jitted, RequestSampling) of the sampling modules at a git commit, loaded beside
    this tree's under other names."""
    folder = tempfile.mkdtemp()
    for name in ("nucleus", "sampling", "rejection"):
        text = subprocess.run(["git", "show", f"{commit}:specpilot/decoding/{name}.py"], capture_output=True,
                              text=True, check=True).stdout
        text = re.sub(r"from specpilot\.decoding\.(nucleus|sampling) import", r"from baseline_\1 import", text)
        with open(f"{folder}/baseline_{name}.py", "w") as f:
            f.write(text)
    sys.path.insert(0, folder)
    rejection = importlib.import_module("baseline_rejection")
    return jax.jit(rejection.verify_chain), importlib.import_module("baseline_sampling").RequestSampling


def interleaved_ms(calls: list, trials: int, seed: int = 0) -> list[list[float]]:
    """Wall ms of each call (a no-argument function) per trial, the calls timed in turn in every trial,
    in a fresh random order each trial: a call timed right after greedy ran up to 1.8x slower than the
    same call elsewhere in the trial, so no call keeps that place."""
    for call in calls:
        jax.block_until_ready(call())
    times = [[] for _ in calls]
    order = list(range(len(calls)))
    shuffle = random.Random(seed).shuffle
    for _ in range(trials):
        shuffle(order)
        for j in order:
            t0 = time.perf_counter()
            jax.block_until_ready(calls[j]())
            times[j].append(1e3 * (time.perf_counter() - t0))
    return times


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q1, q2, q3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", default="49152,151936", help="comma list of vocabulary sizes")
    ap.add_argument("--blocks", default="4,8,16", help="comma list of block sizes (drafts + 1)")
    ap.add_argument("--batch", default="1,16", help="comma list of batch sizes")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--settings", default="0.7:1:0,0.7:0.9:0",
                    help="comma list of temperature:top_p:top_k sampled settings (greedy always runs first)")
    ap.add_argument("--no-rows", action="store_true", help="skip the engine's row-by-row accept and the draws")
    ap.add_argument("--baseline", help="a git commit whose sampled accepts are timed in the same trials")
    ap.add_argument("--trace-top", type=int, default=0,
                    help="also trace each setting's accept under the JAX profiler: device time, kernels per call "
                         "and this many of its costliest kernels")
    args = ap.parse_args(argv)

    chain = jax.jit(verify_chain)
    drafting = jax.jit(choose_drafts)
    rows = jax.jit(verify_rows)
    settings = {"greedy": SamplingConfig(), **parse_settings(args.settings)}
    base_chain, base_sampling = baseline_modules(args.baseline) if args.baseline else (None, None)
    print(f"{'V':>7} {'Bs':>3} {'B':>3} {'sampling':>19} {'accept ms':>10} {'x greedy':>9} {'IQR':>11} "
          f"{'rows ms':>8} {'drafts ms':>10}")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for block in (int(b) for b in args.blocks.split(",")):
            for batch in (int(b) for b in args.batch.split(",")):
                drafts, draft_logits, target_logits = inputs(batch, block, vocab)
                kept = jnp.full((batch,), block - 1, jnp.int32)
                key = jax.random.key(1)
                row_keys = jax.random.split(key, batch)
                per_row = {name: config.for_requests(batch) for name, config in settings.items()}
                calls = [lambda s=s: chain(key, drafts, draft_logits, target_logits, s, kept) for s in per_row.values()]
                if base_chain is not None:
                    for name, s in list(per_row.items())[1:]:
                        base = base_sampling(s.temperature, s.top_p, greedy=s.greedy, top_k=s.top_k)
                        calls.append(lambda b=base: base_chain(key, drafts, draft_logits, target_logits, b, kept))
                        per_row[f"base {name}"] = None
                times = interleaved_ms(calls, args.trials)
                for (name, s), accept in zip(per_row.items(), times):
                    ratios = [a / g for a, g in zip(accept, times[0])]
                    q1, ratio, q3 = quartiles(ratios)
                    by_row = draw = float("nan")
                    if not args.no_rows and s is not None:
                        by_row = median_ms(rows, row_keys, drafts, draft_logits, target_logits, s, kept,
                                           trials=args.trials)
                        draw = median_ms(drafting, key, draft_logits, s, trials=args.trials)
                    print(f"{vocab:>7} {block:>3} {batch:>3} {name:>19} {statistics.median(accept):>10.3f} "
                          f"{ratio:>9.2f} {q1:>5.2f}-{q3:<5.2f} {by_row:>8.3f} {draw:>10.3f}", flush=True)
                if args.trace_top:
                    for (name, _), call in zip(per_row.items(), calls):
                        print_trace(name, call, args.trace_top)


def print_trace(name: str, call, top: int, calls: int = 10) -> None:
    """Device time per accept call (profiler trace of `calls` calls) and its costliest kernels."""
    def run():
        out = None
        for _ in range(calls):
            out = call()
        return out
    summary = traced_kernels(run, calls, top=top)
    if "busy_ms_per_step" not in summary:
        print(f"    trace {name}: {summary}")
        return
    print(f"    trace {name}: device {summary['busy_ms_per_step']:.3f} ms, span {summary['span_ms_per_step']:.3f} ms, "
          f"{summary['kernels_per_step']:.0f} kernels per call")
    for k in summary["top"]:
        print(f"      {k['ms_per_step'] * 1e3:8.1f} us  {k['calls_per_step']:4.1f}x  {k['name'][:100]}")


if __name__ == "__main__":
    main()
