"""Continuous batching: Poisson arrivals (throughput, TTFT, TPOT, KV in use) and fixed batches (steady-state
decode throughput, speedup over AR), for AR and speculative plans, through `specpilot.serving.Engine`.
Every row also counts the requests whose tokens differ from the AR reference's (0: lossless). What the
workloads, flags and rows mean: docs/design/bench.md.

    PYTHONPATH=. python experiments/bench/bench_engine.py [--shape smollm2|tiny] [--m 4] [--rates 0.5,2,8]
        [--requests 16] [--new-tokens 64] [--plans ar,stock] [--out engine.json]
        [--batching fixed,budget,budget+packed] [--token-budget N] [--streams K] [--step-cost measured]
        [--overlap none,halves]
    PYTHONPATH=. python experiments/bench/bench_engine.py --deployment "<run.py overrides>" --plans ar,stock ...
    PYTHONPATH=. python experiments/bench/bench_engine.py --smoke     # tiny random pair, a few seconds

H200, Qwen3-8B shape (random bf16 weights, oracle acceptance; past the per-command limit, split --m over
commands with one --compile-cache):

    PYTHONPATH=. python experiments/bench/bench_engine.py \\
        --deployment "experiment=stock_qwen3_8b_h200 drafter=oracle_calibrated" --plans ar,stock \\
        --m 16,32 --rates 0,4 --requests 32 --new-tokens 256 --batching fixed,budget,budget+packed \\
        --step-cost model --compile-cache /tmp/xla --out engine_8b_mechanisms.json
    ... --m 1,4,8,64 --rates 0                       # the fixed-batch sweep
    ... --overlap none,halves                        # mechanism 3 (even slot counts)
    ... --trace-top 12                               # the decode's top device kernels per fixed row
    ... --deployment "experiment=stock_qwen3_8b_h200 decoding=tree" --plans ar,tree_n16   # tree plans
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import jax

from experiments.bench.engine_report import (HEAD, add_speedups, print_fixed_summary, print_kernels,
                                             print_row)
from experiments.bench.engine_setup import (BATCHINGS, PlanRun, Setup, batching_label, batchings, check_grid,
                                            deployment_setup, shape_setup, with_reference)
from specpilot.decoding import ar
from specpilot.harness import bench
from specpilot.plan import KV_LAYOUTS
from specpilot.serving import Engine, Request
from specpilot.serving.workloads import run_fixed, run_workload


def lockstep_ar_row(run: PlanRun, requests: list[Request], context: int) -> tuple[dict, list[list[int]]]:
    """The AR plan's harness loop over a fixed batch (`ar.generate`: every decode step of the batch inside
    one jitted loop, no host work between steps), compiled by a first call and timed by a second -> (a
    fixed-batch row named `<plan>_lockstep`, each request's tokens). An AR baseline beside the engine's
    AR: speedups are taken over the faster (DESIGN.md, AR baseline)."""
    target, params = run.lockstep
    prompts = [r.prompt_ids for r in requests]
    new = requests[0].max_new_tokens
    t0 = time.perf_counter()
    ar.generate(target, params, prompts, new, cache_len=context)
    compile_s = time.perf_counter() - t0
    res = ar.generate(target, params, prompts, new, cache_len=context)
    slots, steps = len(prompts), res.decode_steps
    row = {"plan": f"{run.name}_lockstep", "speculative": False, "ar_baseline": True, "batching": "lockstep",
           "overlap": "none", "slots": slots, "compile_s": compile_s, "token_budget": slots, "rate": 0.0,
           "requests": slots, "output_tokens": int(res.tokens.size), "total_s": res.prefill_s + res.decode_s,
           "prefill_s": res.prefill_s, "decode_steps": steps, "decode_s": res.decode_s,
           "decode_tok_s": slots * steps / res.decode_s, "step_ms": 1e3 * res.decode_s / steps,
           "tokens_per_step": float(slots), "ms_per_token": 1e3 * res.decode_s / (slots * steps),
           "tokens_per_row_step": 1.0, "tokens_per_decode": float(slots), "verify_tokens_per_decode": float(slots),
           "forward_tokens_per_decode": float(slots), "steps": steps}
    return row, res.as_lists()


def note_not_fitting(record: dict, plan: str, batching: str, slots: int, context: int, e: Exception,
                     workload: str = "") -> None:
    """An engine that ran out of device memory (at build, or running `workload`): listed, and said."""
    miss = {"plan": plan, "batching": batching, "slots": slots, "context": context,
            "error": str(e).splitlines()[0][:300], **({"workload": workload} if workload else {})}
    record["not_fitting"].append(miss)
    when = f" running the {workload} workload" if workload else ""
    print(f"{plan + '/' + batching:>30} {slots:>5}   does not fit in device memory at context {context}{when}: "
          f"{miss['error']}", flush=True)


def out_of_memory(e: Exception) -> bool:
    """Whether `e` is the device running out of memory (XLA's RESOURCE_EXHAUSTED), a row that does not fit."""
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def trace_decode(engine: Engine, calls: int, top: int) -> dict | None:
    """`engine.device_step_ms(calls)` under the JAX profiler -> the device kernels per decode call
    (`bench.kernel_summary`: busy time, categories, the `top` kernels; None where the device has no
    kernel trace, as on a CPU). The calls commit nothing, so the engine is left as it was."""
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            engine.device_step_ms(calls)
            jax.effects_barrier()
        return bench.kernel_summary(d, calls + 1, top=top)  # device_step_ms runs one call before its clock


def parse_args(argv=None):
    """-> (parsed and checked arguments, the parser); bad values exit naming the flag."""
    ap = bench.common_parser(__doc__.split("\n")[0], shape_default="smollm2", shape_help="smollm2 or tiny",
                             m_default="4", m_help="comma list of engine slot counts", trials_default=1,
                             kernel_default="xla")
    ap.add_argument("--deployment", default="", help="run.py's config overrides, space separated "
                    "(e.g. 'experiment=stock_qwen3_8b_h200'); replaces --shape")
    ap.add_argument("--rates", default="0.5,2,8", help="comma list of arrival rates (requests per second); "
                    "0: a fixed batch of one request per slot")
    ap.add_argument("--requests", type=int, default=16, help="requests of each Poisson workload")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tpot-slo-ms", type=float, default=0.0,
                    help="Poisson rows: goodput at this time-per-output-token SLO (0: off)")
    ap.add_argument("--prompt-len", type=int, default=0, help="the longest prompt (tokens; --shape only)")
    ap.add_argument("--plans", default="ar,stock", help="comma list of plan names (--shape: ar, stock)")
    ap.add_argument("--block", type=int, default=0, help="stock's block size (--shape only; default 8, tiny 4)")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (prompt tokens per row per step)")
    ap.add_argument("--model-dir", default="", help="the converted SmolLM2 folder (default: found in the cache)")
    ap.add_argument("--batching", default=None, help=f"comma list of {', '.join(BATCHINGS)} (speculative plans; "
                    f"default fixed, or a --deployment plan's own batching)")
    ap.add_argument("--overlap", default=None, help="comma list of none, halves (speculative plans)")
    ap.add_argument("--kv", default=None, help="comma list of contiguous, paged: the K/V layouts each plan runs "
                    "with (default: the plan's own); rows report K/V bytes per slot")
    ap.add_argument("--context", type=int, default=0, help="positions each slot's K/V holds (contiguous: reserved "
                    "per slot; paged: the most a row's page table maps), at least the longest prompt plus "
                    "--new-tokens (0: that, rounded up to 64)")
    ap.add_argument("--page-size", type=int, default=16, help="--kv paged: slots per page")
    ap.add_argument("--pages", type=int, default=0, help="--kv paged: pages in the pool (0: every slot's whole context)")
    ap.add_argument("--token-budget", type=int, default=0, help="verification tokens per step (0: slots x block / 2)")
    ap.add_argument("--step-cost", default="flat", choices=("flat", "model", "measured"), help="what a confidence "
                    "budget takes a step's time to be: flat (fill the token budget), model (the cost model's step "
                    "time of a token count, from the gpu's rates; --deployment only) or measured (packed: batching.pricing="
                    "measured, the draft and the verify forward timed at each stream size when the engine is built)")
    ap.add_argument("--streams", type=int, default=1, help="budget+packed: stream sizes compiled up to the token "
                    "budget (batching.streams); each step runs the smallest that holds its kept tokens")
    ap.add_argument("--compile-cache", default="", help="jax's persistent compilation cache folder")
    ap.add_argument("--device-calls", type=int, default=20, help="fixed batches: decode calls timed back to back "
                    "after the run (device_step_ms; host_step_ms is the rest of a step), 0: off")
    ap.add_argument("--trace-top", type=int, default=0, help="fixed batches: run the --device-calls decode calls "
                    "under the JAX profiler and keep the N kernels that take the most device time per step (0: off)")
    ap.add_argument("--lockstep-ar", default="on", choices=("on", "off"), help="--deployment, fixed batches: "
                    "also time each AR baseline plan in the harness's loop (ar.generate) on the same batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny random pair, 6 requests: a few seconds")
    args = bench.parse_common(ap, argv)
    if args.smoke:
        args.deployment, args.shape, args.requests, args.new_tokens, args.prompt_len = "", "tiny", 6, 8, 12
        args.rates, args.m, args.block, args.chunk = "0,200", [2], 4, 8
    try:
        args.rates = bench.comma_list(args.rates, float)
    except ValueError:
        ap.error(f"--rates takes a comma list of numbers, got {args.rates!r}")
    for flag, value, allowed in (("--batching", args.batching, BATCHINGS),
                                 ("--overlap", args.overlap, ("none", "halves")), ("--kv", args.kv, KV_LAYOUTS)):
        if value is not None and (not bench.comma_list(value) or set(bench.comma_list(value)) - set(allowed)):
            ap.error(f"{flag} takes a comma list of {', '.join(allowed)}, got {value!r}")
    if not args.rates or min(args.rates) < 0:
        ap.error(f"--rates takes request rates >= 0 (0: a fixed batch), got {args.rates}")
    if args.tpot_slo_ms < 0:
        ap.error(f"--tpot-slo-ms takes a time per output token in ms (0: no goodput), got {args.tpot_slo_ms}")
    if args.streams < 1:
        ap.error(f"--streams must be >= 1, got {args.streams}")
    if args.page_size < 1 or args.pages < 0 or args.context < 0:
        ap.error("--page-size must be >= 1, --pages and --context >= 0")
    if args.requests < 1 or args.chunk < 1 or args.new_tokens < 1 or args.device_calls < 0 or args.trace_top < 0:
        ap.error("--requests, --chunk and --new-tokens must be >= 1, --device-calls and --trace-top >= 0")
    if args.trace_top and not args.device_calls:
        ap.error("--trace-top traces the --device-calls decode calls: give --device-calls >= 1")
    if 0.0 in args.rates and args.new_tokens < 2:
        ap.error("--rates 0 measures decode steps: --new-tokens must be >= 2 (the first token comes from prefill)")
    if args.step_cost == "model" and not args.deployment:
        ap.error("--step-cost model prices a --deployment's plans (the cost model needs its gpu's rates)")
    if not args.deployment and args.shape not in ("tiny", "smollm2"):
        ap.error(f"--shape takes smollm2 or tiny, got {args.shape!r}")
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", str(Path(args.compile_cache).expanduser()))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return args, ap


def build_setup(args, ap=None) -> Setup:
    """The plans, prompts and requests of `args`; a bad value exits naming it (raises ValueError without `ap`)."""
    n_prompts = max([args.requests] + (args.m if 0.0 in args.rates else []))
    try:
        setup = deployment_setup(args, n_prompts) if args.deployment else shape_setup(args, n_prompts)
        check_grid(setup, args)
    except (ValueError, NotImplementedError) as e:
        if ap is None:
            raise
        ap.error(str(e))
    return setup


def main(argv=None):
    args, ap = parse_args(argv)
    setup = build_setup(args, ap)
    print(f"device {jax.devices()[0]}, jax {jax.__version__}, {setup.label}, plans "
          f"{', '.join(p.name for p in setup.plans)}, <= {args.new_tokens} new tokens, context {setup.context}")
    for note in setup.notes:
        print(f"  note: {note}")
    print(HEAD)
    rows = []
    record = {"setup": setup.label, "shape": "deployment" if args.deployment else args.shape, "jax": jax.__version__,
              "device": str(jax.devices()[0]), "new_tokens": args.new_tokens, "context": setup.context,
              "chunk": args.chunk, "block": max(p.block for p in setup.plans), "notes": setup.notes, "rows": rows,
              "not_fitting": []}
    reference = setup.reference
    for slots in args.m:
        fixed = [Request(p, args.new_tokens) for p in setup.prompts[:slots]]
        want = {}  # workload -> the reference plan's tokens per request, at this slot count
        for run in setup.plans:
            for batching in batchings(setup, run, args, slots):
                t0 = time.perf_counter()
                try:
                    engine = run.make(slots, batching, setup.context, args.chunk)  # measured pricing: timed here
                    t0 = time.perf_counter()
                    engine.warm_up()
                except Exception as e:  # noqa: BLE001 -- only the device's out-of-memory is a row; the rest raise
                    if not out_of_memory(e):
                        raise
                    engine = None
                    note_not_fitting(record, run.name, batching_label(batching), slots, setup.context, e)
                    continue
                compile_s = time.perf_counter() - t0
                for i, rate in enumerate(args.rates):
                    workload = "fixed" if rate == 0 else "poisson"
                    requests = fixed if rate == 0 else setup.poisson
                    if run.replays:
                        requests = with_reference(requests, want[workload])
                    engine.stats = type(engine.stats)()
                    try:
                        row, handles = (run_fixed(engine, requests, args.device_calls) if rate == 0
                                        else run_workload(engine, requests, rate, args.seed + i,
                                                          args.tpot_slo_ms / 1e3 if args.tpot_slo_ms else None))
                    except Exception as e:  # noqa: BLE001 -- as at build: out of memory mid-run (a prefill's
                        if not out_of_memory(e):  # temporaries) is a row; the engine is dropped, the rest run
                            raise
                        note_not_fitting(record, run.name, batching_label(batching), slots, setup.context, e, workload)
                        break
                    if rate == 0 and args.trace_top:
                        row["kernels"] = trace_decode(engine, args.device_calls, args.trace_top)
                    tokens = [h.tokens for h in handles]
                    if run is reference:
                        want.setdefault(workload, tokens)
                    diff = sum(a != b for a, b in zip(tokens, want[workload])) if workload in want else None
                    row = {"plan": run.name, "speculative": run.speculative, "ar_baseline": run.ar_baseline,
                           "batching": batching_label(batching), "overlap": getattr(batching, "overlap", "none"),
                           "slots": slots, "compile_s": compile_s, "token_budget": engine.setup.token_budget,
                           "stream_sizes": engine.setup.stream_sizes, "step_cost_points": engine.setup.cost.points,
                           "mismatched_requests": diff, **row}
                    rows.append(row)
                    print_row(row)
                    print_kernels(row)
                    add_speedups(rows)
                    if args.out:
                        Path(args.out).write_text(json.dumps(record, indent=1, default=str))
                del engine  # its slot state (K/V of every slot) goes before the next engine's
            if run.lockstep is not None and 0.0 in args.rates:
                try:
                    row, tokens = lockstep_ar_row(run, fixed, setup.context)
                except Exception as e:  # noqa: BLE001 -- as the engines: out of memory is a row, the rest raise
                    if not out_of_memory(e):
                        raise
                    record["not_fitting"].append({"plan": f"{run.name}_lockstep", "batching": "lockstep",
                                                  "slots": slots, "context": setup.context,
                                                  "error": str(e).splitlines()[0][:300]})
                    print(f"{run.name + '_lockstep':>30} {slots:>5}   does not fit in device memory", flush=True)
                    continue
                diff = sum(a != b for a, b in zip(tokens, want["fixed"])) if "fixed" in want else None
                rows.append({**row, "mismatched_requests": diff})
                print_row(rows[-1])
                add_speedups(rows)
                if args.out:
                    Path(args.out).write_text(json.dumps(record, indent=1, default=str))
    print_fixed_summary(rows)
    return record


if __name__ == "__main__":
    main()
