"""Continuous batching under Poisson arrivals: throughput, TTFT, TPOT and KV slots in use, AR vs stock.

    PYTHONPATH=. python experiments/bench_engine.py [--shape smollm2] [--m 4] [--rates 0.5,2,8]
        [--requests 16] [--new-tokens 64] [--plans ar,stock] [--out engine.json]
        [--batching fixed,budget,budget+packed] [--token-budget N] [--overlap none,halves]
    PYTHONPATH=. python experiments/bench_engine.py --smoke     # tiny random pair, a few seconds

--shape smollm2: the real SmolLM2-135M-Instruct pair (target converted from its GGUF, the packaged
block drafter at --block), chat prompts of at most --prompt-len tokens, each request stopping at the
model's end-of-turn token or after --new-tokens. --batching (stock only): `fixed` verifies every row's
full block, `budget` chooses each row's draft count per step from the drafter's confidence under
--token-budget (mechanism 1; default half of slots x block), `budget+packed` also packs only the kept
candidates into the verify forward (mechanism 2). --overlap (stock only): `halves` verifies one half
of the slots per step while drafting the other in the same program (mechanism 3; a step then verifies
half the slots, so the default budget is half of slots/2 x block). Each row reports tokens emitted, sent
to verification and computed by the verify forward per decode step, rows verified and drafted per decode
step, and the share of decode steps with both halves busy. --shape tiny (and --smoke): a 2-layer random target
with a random block drafter, random prompts and budgets. --m: the engine's slot counts.

Requests arrive as a Poisson process at each rate (requests per second, wall clock, seeded), are
submitted once their arrival time has passed, and the engine steps while any is in flight. TTFT is
counted from the arrival time, TPOT per request over its tokens after the first; throughput is output
tokens over the time from the first arrival to the last token. Every executable is compiled before the
clock starts (`Engine.warm_up`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.harness import bench
from specpilot.serving import Engine, Request

DEFAULT_SMOLLM2_DIRS = ("~/.cache/specpilot/gguf", "/tmp/smolcache/gguf")


def percentile(values, q) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if len(values) else float("nan")


def run_workload(engine: Engine, requests: list[Request], rate: float, seed: int) -> dict:
    """Submit `requests` at Poisson arrival times (rate per second) and step until all are done."""
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
    return {"rate": rate, "requests": len(requests), "output_tokens": out_tokens,
            "throughput_tok_s": out_tokens / (end - arrivals[0]),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
            "slots_in_use_mean": float(np.mean(slots_used)), "slots_in_use_max": int(np.max(slots_used)),
            "kv_tokens_mean": float(np.mean(kv_used)), "kv_tokens_max": int(np.max(kv_used)),
            "kv_tokens_capacity": engine.slots * engine.setup.max_len,
            "tokens_per_row_step": engine.stats.tokens_per_row_step, "steps": engine.stats.steps,
            "tokens_per_decode": engine.stats.tokens_per_decode,
            "verify_tokens_per_decode": engine.stats.verify_tokens_per_decode,
            "rows_verified_per_decode": engine.stats.rows_verified_per_decode,
            "rows_drafted_per_decode": engine.stats.rows_drafted_per_decode,
            "both_halves_busy_fraction": engine.stats.both_halves_busy_fraction,
            "forward_tokens_per_decode": (engine.stats.forward_tokens / engine.stats.decode_calls
                                          if engine.stats.decode_calls else float("nan"))}


BATCHINGS = {"fixed": {}, "budget": {"draft_budget": "confidence"},
             "budget+packed": {"draft_budget": "confidence", "verify": "packed"}}


def batching_for(name: str, slots: int, block: int, token_budget: int, overlap: str = "none"):
    """The plan.Batching of a --batching name and --overlap value (budgeted ones at token_budget, default
    rows x block / 2 over the rows one step verifies: the slots, or half of them under halves)."""
    from specpilot.plan import Batching

    fields = BATCHINGS[name]
    if not fields:
        return Batching(overlap=overlap)
    rows = slots // 2 if overlap == "halves" else slots
    return Batching(**fields, token_budget=token_budget or max(2 * rows, rows * block // 2), overlap=overlap)


def tiny_pair(block: int):
    from specpilot.models import dense
    from specpilot.models import drafter as dr
    from specpilot.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
    params = dense.init(jax.random.key(0), cfg, dtype=jnp.float32, std=0.5)
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=block)
    return dense.target(cfg, jnp.float32), params, dr.BlockDrafter(dcfg, cfg), dr.init(jax.random.key(1), dcfg,
                                                                                       jnp.float32)


def tiny_requests(n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(rng.integers(0, vocab, rng.integers(1, prompt_len + 1)).tolist(),
                    int(rng.integers(1, new_tokens + 1))) for _ in range(n)]


def smollm2_folder(given: str) -> Path:
    if given:
        return Path(given).expanduser()
    for root in DEFAULT_SMOLLM2_DIRS:
        found = sorted(Path(root).expanduser().glob("SmolLM2-135M-Instruct*/config.json"))
        if found:
            return found[0].parent
    raise SystemExit(f"no converted SmolLM2 folder under {DEFAULT_SMOLLM2_DIRS}; run experiments/run.py "
                     f"target=smollm2 once, or pass --model-dir")


def smollm2_pair(folder: Path, block: int, num: int, prompt_len: int, new_tokens: int):
    import dataclasses

    from specpilot.data import prompt_sets
    from specpilot.models import dense
    from specpilot.models import drafter as dr
    from specpilot.models.checkpoint import load_hf

    params, cfg = load_hf(folder, dtype=jnp.float32)
    dparams, dcfg = dr.load_drafter(dr.PACKAGED / "smollm2-135m-instruct-dflash-b8", dtype=jnp.float32)
    dcfg = dataclasses.replace(dcfg, block_size=block)
    cfg = cfg.with_taps(dcfg.tap_layers)
    text = prompt_sets.load_model_text(folder)
    prompts, _ = prompt_sets.build("chat", text, num, prompt_len)
    eos = prompt_sets.eos_token_id(folder)
    requests = [Request(p, new_tokens, stop_token=eos) for p in prompts]
    return dense.target(cfg, jnp.float32), params, dr.BlockDrafter(dcfg, cfg), dparams, requests


def main(argv=None):
    ap = bench.common_parser(__doc__.split("\n")[0], shape_default="smollm2", shape_help="smollm2 or tiny",
                             m_default="4", m_help="comma list of engine slot counts", trials_default=1,
                             kernel_default="xla")
    ap.add_argument("--rates", default="0.5,2,8", help="comma list of arrival rates (requests per second)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=192, help="the longest prompt (tokens)")
    ap.add_argument("--plans", default="ar,stock", help="comma list of ar, stock")
    ap.add_argument("--block", type=int, default=8, help="stock's block size")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (prompt tokens per row per step)")
    ap.add_argument("--model-dir", default="", help="the converted SmolLM2 folder (default: found in the cache)")
    ap.add_argument("--batching", default="fixed", help=f"comma list of {', '.join(BATCHINGS)} (stock plans)")
    ap.add_argument("--overlap", default="none", help="comma list of none, halves (stock plans)")
    ap.add_argument("--token-budget", type=int, default=0, help="verification tokens per step (0: slots x block / 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny random pair, 6 requests: a few seconds")
    args = bench.parse_common(ap, argv)
    if args.smoke:
        args.shape, args.requests, args.new_tokens, args.prompt_len = "tiny", 6, 8, 12
        args.rates, args.m, args.block, args.chunk = "200", [2], 4, 8
    rates, plans = bench.comma_list(args.rates, float), bench.comma_list(args.plans)
    batchings = bench.comma_list(args.batching)
    if not batchings or set(batchings) - set(BATCHINGS):
        ap.error(f"--batching takes {', '.join(BATCHINGS)}, got {args.batching!r}")
    overlaps = bench.comma_list(args.overlap)
    if not overlaps or set(overlaps) - {"none", "halves"}:
        ap.error(f"--overlap takes none and/or halves, got {args.overlap!r}")
    if not rates or min(rates) <= 0:
        ap.error(f"--rates takes positive request rates, got {args.rates!r}")
    if not plans or set(plans) - {"ar", "stock"}:
        ap.error(f"--plans takes ar and/or stock, got {args.plans!r}")
    if args.shape == "tiny":
        target, params, drafter, dparams = tiny_pair(args.block)
        requests = tiny_requests(args.requests, args.prompt_len, args.new_tokens, target.vocab_size, args.seed)
        context = args.prompt_len + args.new_tokens
    elif args.shape == "smollm2":
        target, params, drafter, dparams, requests = smollm2_pair(
            smollm2_folder(args.model_dir), args.block, args.requests, args.prompt_len, args.new_tokens)
        context = -(-(max(len(r.prompt_ids) for r in requests) + args.new_tokens) // 64) * 64
    else:
        ap.error(f"--shape takes smollm2 or tiny, got {args.shape!r}")
    print(f"device {jax.devices()[0]}, jax {jax.__version__}, {args.shape}, {len(requests)} requests, "
          f"<= {args.new_tokens} new tokens, context {context}")
    print(f"{'plan':>26} {'slots':>5} {'rate':>6} {'tok/s':>8} {'ttft50':>7} {'ttft99':>7} {'tpot50':>7} "
          f"{'tpot99':>7} {'used':>5} {'kv_max':>6} {'tau':>5} {'tok/dec':>7} {'ver/dec':>7} {'fwd/dec':>7} "
          f"{'rowsV':>5} {'rowsD':>5} {'both':>5}")
    rows = []
    runs = [(p, b, o) for p in plans for b in (batchings if p == "stock" else ["fixed"])
            for o in (overlaps if p == "stock" else ["none"])]
    for slots in args.m:
        for plan, batching, overlap in runs:
            d, dp = (drafter, dparams) if plan == "stock" else (None, None)
            engine = Engine(target, params, d, dp, block_size=args.block if d else None, slots=slots,
                            context_len=context, prefill_chunk=args.chunk, sampling=False,
                            batching=batching_for(batching, slots, args.block, args.token_budget, overlap) if d else None)
            t0 = time.perf_counter()
            engine.warm_up()
            compile_s = time.perf_counter() - t0
            for i, rate in enumerate(rates):
                engine.stats = type(engine.stats)()
                row = {"plan": plan, "batching": batching, "overlap": overlap, "slots": slots, "compile_s": compile_s,
                       "token_budget": engine.setup.token_budget,
                       **run_workload(engine, requests, rate, args.seed + i)}
                rows.append(row)
                label = plan + "/" + batching + ("+halves" if overlap == "halves" else "")
                print(f"{label:>26} {slots:>5} {rate:>6.2f} {row['throughput_tok_s']:>8.1f} "
                      f"{row['ttft_p50_s']:>7.3f} {row['ttft_p99_s']:>7.3f} {row['tpot_p50_s']:>7.4f} "
                      f"{row['tpot_p99_s']:>7.4f} {row['slots_in_use_mean']:>5.2f} {row['kv_tokens_max']:>6} "
                      f"{row['tokens_per_row_step']:>5.2f} {row['tokens_per_decode']:>7.2f} "
                      f"{row['verify_tokens_per_decode']:>7.2f} {row['forward_tokens_per_decode']:>7.1f} "
                      f"{row['rows_verified_per_decode']:>5.2f} {row['rows_drafted_per_decode']:>5.2f} "
                      f"{row['both_halves_busy_fraction']:>5.2f}")
    record = {"shape": args.shape, "jax": jax.__version__, "device": str(jax.devices()[0]),
              "new_tokens": args.new_tokens, "context": context, "chunk": args.chunk, "block": args.block,
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
