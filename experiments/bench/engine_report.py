"""The engine benchmark's report (`bench_engine.py`): speedups over the fastest AR baseline of a slot
count, a printed line per row, the device kernels of a traced row and the fixed-batch summary table.
"""

from __future__ import annotations


def print_kernels(row: dict) -> None:
    k = row.get("kernels")
    if not k or "top" not in k:
        return
    cats = ", ".join(f"{c} {ms:.2f}" for c, ms in k["category_ms_per_step"].items())
    print(f"    device busy {k['busy_ms_per_step']:.2f} ms per decode call, {k['kernels_per_step']:.0f} kernels; {cats}")
    for t in k["top"]:
        print(f"    {t['ms_per_step']:7.3f} ms {t['calls_per_step']:6.1f}x {t['us_median']:8.1f} us  {t['name'][:90]}")


def add_speedups(rows: list[dict]) -> None:
    """Fixed-batch rows: speedup = decode_tok_s over the fastest AR baseline's at the same slot count."""
    fixed = [r for r in rows if r["rate"] == 0]
    for r in fixed:
        base = [b for b in fixed if b["ar_baseline"] and b["slots"] == r["slots"]
                and b["decode_tok_s"] == b["decode_tok_s"]]
        if base:
            best = max(base, key=lambda b: b["decode_tok_s"])
            r["speedup"], r["baseline"] = r["decode_tok_s"] / best["decode_tok_s"], best["plan"]


HEAD = f"{'plan':>30} {'slots':>5} {'rate':>6} {'diff':>4} {'tau':>5} {'tok/dec':>7} {'ver/dec':>7} {'fwd/dec':>7}"


def _label(row: dict) -> str:
    return row["plan"] + ("/" + row["batching"] if row["speculative"] or row["batching"].endswith("/paged") else "")


def print_row(row: dict) -> None:
    label = _label(row)
    common = (f"{label:>30} {row['slots']:>5} {row['rate']:>6.2f} {str(row['mismatched_requests']):>4} "
              f"{row['tokens_per_row_step']:>5.2f} {row['tokens_per_decode']:>7.2f} "
              f"{row['verify_tokens_per_decode']:>7.2f} {row['forward_tokens_per_decode']:>7.1f}")
    if row["rate"] == 0:
        print(f"{common}   fixed: {row['decode_tok_s']:.1f} tok/s, {row['step_ms']:.2f} ms/step "
              f"(device {row.get('device_step_ms', float('nan')):.2f}), "
              f"{row['tokens_per_step']:.2f} tok/step over {row['decode_steps']} steps, prefill "
              f"{row['prefill_s']:.2f} s, compile {row['compile_s']:.1f} s", flush=True)
    else:
        print(f"{common}   {row['throughput_tok_s']:.1f} tok/s, ttft {row['ttft_p50_s']:.3f}/{row['ttft_p99_s']:.3f} s,"
              f" tpot {row['tpot_p50_s']:.4f}/{row['tpot_p99_s']:.4f} s, slots {row['slots_in_use_mean']:.2f}, kv max "
              f"{row['kv_tokens_max']}, rows V/D {row['rows_verified_per_decode']:.2f}/"
              f"{row['rows_drafted_per_decode']:.2f}, both {row['both_halves_busy_fraction']:.2f}, compile "
              f"{row['compile_s']:.1f} s", flush=True)
        if row.get("tpot_slo_s") is not None:
            print(f"    goodput at TPOT <= {1e3 * row['tpot_slo_s']:.1f} ms: {row['goodput_tok_s']:.1f} tok/s "
                  f"({100 * row['slo_met_fraction']:.0f}% of requests met it)", flush=True)
    if row.get("kv") == "paged":
        print(f"    K/V per slot {row['kv_bytes_per_slot'] / 2**10:.1f} KiB paged ({row['kv_pages_per_row_mean']:.2f} "
              f"pages of {row['kv_page_size']} on average, peak {row['kv_pages_peak']} of {row['kv_pool_pages']}) "
              f"against {row['kv_bytes_per_slot_contiguous'] / 2**10:.1f} KiB contiguous, mean length "
              f"{row['kv_len_mean']:.1f}", flush=True)


def print_fixed_summary(rows: list[dict]) -> None:
    fixed = [r for r in rows if r["rate"] == 0]
    if not fixed:
        return
    print(f"\nfixed batches (steady-state decode; speedup over the fastest AR baseline at the same slots)\n"
          f"{'plan':>30} {'slots':>5} {'tok/s':>9} {'ms/step':>8} {'device':>7} {'tok/step':>8} {'ms/tok':>7} "
          f"{'speedup':>7} {'diff':>4}")
    for r in fixed:
        label = _label(r)
        print(f"{label:>30} {r['slots']:>5} {r['decode_tok_s']:>9.1f} {r['step_ms']:>8.2f} "
              f"{r.get('device_step_ms', float('nan')):>7.2f} {r['tokens_per_step']:>8.2f} {r['ms_per_token']:>7.3f} "
              f"{r.get('speedup', float('nan')):>7.2f} "
              f"{str(r['mismatched_requests']):>4}")
