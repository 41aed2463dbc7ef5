"""Packed verification's stream sizes against padded verification through the serving engine, with the
SmolLM2 pair on this machine: one fixed batch per engine, the engines taking turns for --rounds rounds
(so a loaded machine's drift falls on all of them), the median ms/token per engine. Every engine's
requests are checked against AR's tokens.

    PYTHONPATH=. python experiments/bench/bench_packed_streams.py --block 8 --slots 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

from experiments.bench.engine_setup import context_for, smollm2_folder, smollm2_pair
from specpilot.plan import Batching
from specpilot.serving import Engine, Request
from specpilot.serving.workloads import run_fixed


def engines(args, pair) -> dict[str, Engine]:
    target, params, drafter, dparams, prompts, _ = pair
    context = context_for(prompts[: args.slots], args.new_tokens)
    full = args.slots * args.block
    packed = dict(draft_budget="confidence", verify="packed", token_budget=full)
    cases = {"ar": (None, None), "stock, padded": (drafter, None),
             "packed, 1 stream": (drafter, Batching(**packed)),
             f"packed, {args.streams} streams, measured": (drafter, Batching(**packed, streams=args.streams,
                                                                              pricing="measured"))}
    out = {}
    for label, (d, batching) in cases.items():
        out[label] = Engine(target, params, d, dparams if d else None, block_size=args.block if d else None,
                            slots=args.slots, context_len=context, prefill_chunk=64, sampling=False,
                            batching=batching)
        out[label].warm_up()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model-dir", default="", help="the converted SmolLM2 folder (default: found in the cache)")
    args = ap.parse_args(argv)
    if min(args.block, args.slots, args.streams, args.rounds, args.new_tokens) < 1 or args.block < 2:
        ap.error("--block must be >= 2 and --slots, --streams, --rounds, --new-tokens >= 1")
    pair = smollm2_pair(smollm2_folder(args.model_dir), args.block, args.slots, 192)
    prompts = pair[4][: args.slots]
    built = engines(args, pair)
    times = {label: [] for label in built}
    rows = {}
    for _ in range(args.rounds):
        for label, engine in built.items():
            engine.stats = type(engine.stats)()
            row, handles = run_fixed(engine, [Request(p, args.new_tokens) for p in prompts])
            times[label].append(row["ms_per_token"])
            rows[label] = (row, [h.tokens for h in handles])
    reference = rows["ar"][1]
    ar_ms = statistics.median(times["ar"])
    print(f"block {args.block}, {args.slots} slots, {args.new_tokens} new tokens, median of {args.rounds} rounds")
    for label, ms in times.items():
        row, tokens = rows[label]
        mismatched = sum(a != b for a, b in zip(tokens, reference))
        print(f"{label:32s} {statistics.median(ms):7.2f} ms/token ({', '.join(f'{x:.2f}' for x in ms)})  "
              f"{ar_ms / statistics.median(ms):.2f}x AR  tau {row['tokens_per_row_step']:.2f}  "
              f"forward tokens/decode {row['forward_tokens_per_decode']:.1f}  mismatched {mismatched}")


if __name__ == "__main__":
    main()
