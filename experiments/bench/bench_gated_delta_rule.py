"""The gated delta rule's Pallas kernel against its jnp reference at Qwen3.5-27B's linear-layer shape.

    PYTHONPATH=. python3 experiments/bench/bench_gated_delta_rule.py --out gdr.csv          # GPU: B 1, 8; T 1, 4, 16
    PYTHONPATH=. python3 experiments/bench/bench_gated_delta_rule.py --configs 32:4:1,64:8:2  # block_v:warps:stages
    PYTHONPATH=. python3 experiments/bench/bench_gated_delta_rule.py --smoke --out /tmp/g.csv # CPU: tiny, interpreted

Design notes: docs/design/bench.md.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gated_delta_rule as gdr

QWEN3_5_27B = dict(heads=48, dk=128, dv=128)  # linear layers: 48 value heads, key/value head dim 128
TINY = dict(heads=2, dk=16, dv=32)
DEFAULT_CONFIGS = "16:4:1,32:4:1,64:4:1,32:2:1,32:8:1,64:8:1"
CSV_FIELDS = ("batch", "tokens", "heads", "dk", "dv", "impl", "block_v", "num_warps", "num_stages", "us_per_call",
              "gb_per_s", "pct_of_peak", "bytes", "max_abs_err_o", "max_abs_err_states", "compile_s")


def bytes_moved(b: int, t: int, h: int, dk: int, dv: int) -> int:
    """float32 bytes one call must move: S0 read, T states written, q k v g beta read, o written."""
    state = b * h * dk * dv
    return 4 * (state * (1 + t) + b * t * h * (2 * dk + 2 * dv + 2))


def inputs(b: int, t: int, h: int, dk: int, dv: int, seed: int = 0):
    """What the layer feeds the rule: L2-normalised q (scaled by DK^-1/2) and k, unit-scale v and S0,
    g in [-0.5, 0], beta in [0, 1]; float32 on the default device."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = unit(rng.normal(size=(b, t, h, dk))) * dk ** -0.5
    k = unit(rng.normal(size=(b, t, h, dk)))
    v = rng.normal(size=(b, t, h, dv))
    g = -rng.uniform(0.0, 0.5, size=(b, t, h))
    beta = rng.uniform(0.0, 1.0, size=(b, t, h))
    s0 = rng.normal(size=(b, h, dk, dv))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, s0))


def looped(fn, calls: int):
    """jit of `calls` chained calls of fn(q, k, v, g, beta, s0) -> (o, states); returns the last outputs."""

    @jax.jit
    def run(q, k, v, g, beta, s0):
        def body(_, carry):
            g_next, _, _ = carry
            o, states = fn(q, k, v, g_next, beta, s0)
            return g + 1e-30 * o[..., 0], o, states

        o, states = fn(q, k, v, g, beta, s0)
        return jax.lax.fori_loop(1, calls, body, (g + 1e-30 * o[..., 0], o, states))

    return run


def timed(run, args, trials: int) -> tuple[float, float]:
    """(median seconds of one run over trials, first call's compile + run seconds)."""
    t0 = time.perf_counter()
    jax.block_until_ready(run(*args))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def parse_configs(text: str, interpret: bool, dv: int) -> list[gdr.GatedDeltaRuleTritonConfig]:
    """"block_v:warps:stages,..." -> configs (block_v capped at DV, duplicates dropped)."""
    out = []
    for item in text.split(","):
        parts = [int(p) for p in item.split(":")]
        if not 1 <= len(parts) <= 3:
            raise SystemExit(f"--configs: {item!r} is not block_v[:num_warps[:num_stages]]")
        block_v, warps, stages = (parts + [4, 1][len(parts) - 1:])[:3]
        c = gdr.GatedDeltaRuleTritonConfig(block_v=min(block_v, dv), num_warps=warps, num_stages=stages,
                                           interpret=interpret)
        if c not in out:
            out.append(c)
    return out


def bench_shape(b, t, shape, configs, args) -> list[dict]:
    h, dk, dv = shape["heads"], shape["dk"], shape["dv"]
    x = inputs(b, t, h, dk, dv)
    nbytes = bytes_moved(b, t, h, dk, dv)
    want_o, want_states = jax.jit(gdr.gated_delta_rule_reference)(*x)
    base = dict(batch=b, tokens=t, heads=h, dk=dk, dv=dv, bytes=nbytes)
    rows = []

    def row(impl, config, run):
        seconds, compile_s = timed(run, x, args.trials)
        us = 1e6 * seconds / args.calls
        r = dict(base, impl=impl, us_per_call=us, gb_per_s=nbytes / us / 1e3, compile_s=compile_s,
                 pct_of_peak=100 * nbytes / us / 1e3 / args.peak_gbs,
                 **({k: getattr(config, k) for k in ("block_v", "num_warps", "num_stages")} if config else {}))
        if config is not None:  # the compiled kernel against the reference, on this device
            o, states = gdr.gated_delta_rule(*x, config)
            r["max_abs_err_o"] = float(jnp.max(jnp.abs(o - want_o)))
            r["max_abs_err_states"] = float(jnp.max(jnp.abs(states - want_states)))
        rows.append(r)
        return r

    row("xla", None, looped(gdr.gated_delta_rule_reference, args.calls))
    for c in configs:
        row("triton", c, looped(lambda *a, c=c: gdr.gated_delta_rule(*a, c), args.calls))
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    lines = [f"{'B':>3}{'T':>4} {'impl':<7}{'bv':>4}{'warps':>6}{'stg':>4}{'us/call':>10}{'GB/s':>9}{'%peak':>7}"
             f"{'x ref':>7}{'err o':>10}{'err S':>10}"]
    ref = {}
    for r in rows:
        if r["impl"] == "xla":
            ref[r["batch"], r["tokens"]] = r["us_per_call"]
        cfg = (f"{r['block_v']:>4}{r['num_warps']:>6}{r['num_stages']:>4}" if r["impl"] == "triton"
               else f"{'-':>4}{'-':>6}{'-':>4}")
        errs = (f"{r['max_abs_err_o']:>10.1e}{r['max_abs_err_states']:>10.1e}" if "max_abs_err_o" in r
                else f"{'':>20}")
        lines.append(f"{r['batch']:>3}{r['tokens']:>4} {r['impl']:<7}{cfg}{r['us_per_call']:>10.2f}"
                     f"{r['gb_per_s']:>9.0f}{r['pct_of_peak']:>7.1f}"
                     f"{ref[r['batch'], r['tokens']] / r['us_per_call']:>7.2f}{errs}")
    return lines


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", help="batch sizes (default 1,8; smoke 1,2)")
    p.add_argument("--tokens", help="tokens per call T (default 1,4,16; smoke 1,3)")
    p.add_argument("--configs", help=f"block_v:num_warps:num_stages, comma-separated (default {DEFAULT_CONFIGS})")
    p.add_argument("--calls", type=int, help="chained calls per timed jit (default 50; smoke 2)")
    p.add_argument("--trials", type=int, help="timed runs, the median reported (default 5; smoke 1)")
    p.add_argument("--peak-gbs", type=float, default=4280.0, help="the card's copy bandwidth (H200: 4280)")
    p.add_argument("--smoke", action="store_true", help="tiny shape, interpreted kernel, few calls (any backend)")
    p.add_argument("--out", help="CSV path for the rows")
    args = p.parse_args(argv)
    shape = TINY if args.smoke else QWEN3_5_27B
    defaults = (dict(batch="1,2", tokens="1,3", configs="16:4:1,32:4:1", calls=2, trials=1) if args.smoke else
                dict(batch="1,8", tokens="1,4,16", configs=DEFAULT_CONFIGS, calls=50, trials=5))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    interpret = args.smoke or jax.default_backend() != "gpu"
    dev = jax.devices()[0]
    print(f"device {dev.platform}:{getattr(dev, 'device_kind', '')}, jax {jax.__version__}, shape H={shape['heads']} "
          f"DK={shape['dk']} DV={shape['dv']}, {args.calls} calls per jit, median of {args.trials}"
          + (", kernel interpreted" if interpret else ""), flush=True)
    configs = parse_configs(args.configs, interpret, shape["dv"])
    rows = []
    for b in (int(v) for v in args.batch.split(",")):
        for t in (int(v) for v in args.tokens.split(",")):
            shape_rows = bench_shape(b, t, shape, configs, args)
            rows += shape_rows
            print("\n".join(format_rows(shape_rows)[(0 if len(rows) == len(shape_rows) else 1):]), flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    return rows


if __name__ == "__main__":
    main()
