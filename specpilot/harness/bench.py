"""Timing and byte accounting for decode benchmarks on any JAX device: synced per-call and pipelined clocks,
copy bandwidth, bytes per decode step, profiler-trace kernel summaries, and the argument schema the lab
benchmarks under experiments/bench/ share. Design notes: docs/design/harness.md.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import re
import math
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels import dispatch
from specpilot.models import dense
from specpilot.models.config import ModelConfig


def summarize(times_s: list[float]) -> dict[str, float]:
    """Median / p10 / p90 / mean of a list of seconds, in milliseconds."""
    ms = sorted(t * 1e3 for t in times_s)

    def pct(p):
        return ms[min(len(ms) - 1, max(0, int(round(p * (len(ms) - 1)))))]

    return {"median_ms": statistics.median(ms), "p10_ms": pct(0.1), "p90_ms": pct(0.9),
            "mean_ms": statistics.fmean(ms), "n": len(ms)}


def per_call(fn: Callable[[], Any], n: int, warmup: int = 3) -> list[float]:
    """Seconds of each of n calls of fn(), synced after every call, after `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def pipelined(fn: Callable[[], Any], n: int, warmup: int = 3) -> float:
    """Mean seconds per call over n back-to-back calls with one sync at the end."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    t0 = time.perf_counter()
    last = None
    for _ in range(n):
        last = fn()
    jax.block_until_ready(last)
    return (time.perf_counter() - t0) / n


def timed_compile(jitted, *args, **kwargs):
    """AOT-compile a jitted function for these arguments; returns (compiled, seconds)."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args, **kwargs).compile()
    return compiled, time.perf_counter() - t0


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 20, seed: int = 0) -> dict[str, float]:
    """Device-to-device streaming bandwidth (bytes read + written per second) of an XOR over nbytes."""
    n = nbytes // 4
    x = jax.jit(lambda k: jax.random.bits(k, (n,), jnp.uint32))(jax.random.PRNGKey(seed))
    f = jax.jit(lambda a: a ^ jnp.uint32(0x5A5A5A5A))
    moved = 2 * n * 4
    calls = per_call(lambda: f(x), reps)
    pipe = pipelined(lambda: f(x), reps)
    med = statistics.median(calls)
    return {"bytes_moved": moved, "per_call_median_ms": med * 1e3, "pipelined_ms": pipe * 1e3,
            "bw_per_call": moved / med, "bw_pipelined": moved / pipe, "bw": moved / min(med, pipe)}


def step_bytes(cfg, batch: int, cache_len: int, mean_len: float | None = None,
               dtype=jnp.bfloat16, tokens_per_step: int = 1) -> dict[str, int]:
    """Bytes one decode step must move for a dense decoder config (see module docstring)."""
    item = jnp.dtype(dtype).itemsize
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = (h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i  # matrices
                 + 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0))  # norms
    head = cfg.vocab_size * h  # lm_head, or the tied embedding read as the head
    weights = (cfg.num_layers * per_layer + head + h) * item
    gathered = batch * tokens_per_step * h * item if not cfg.tie_word_embeddings else 0
    kv_one = 2 * cfg.num_layers * batch * cfg.kv_size * item  # K and V of one position, all layers
    kv_read = kv_one * cache_len
    kv_min = int(kv_one * (mean_len if mean_len is not None else cache_len))
    kv_write = kv_one * tokens_per_step
    logits = batch * tokens_per_step * cfg.vocab_size * 4
    total = weights + gathered + kv_read + kv_write + logits
    return {"weights": weights, "embed_rows": gathered, "kv_read": kv_read, "kv_read_min": kv_min,
            "kv_write": kv_write, "logits": logits, "total": total,
            "total_min": weights + gathered + kv_min + kv_write + logits}


def device_info() -> dict[str, Any]:
    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": getattr(d, "device_kind", str(d)),
            "num_devices": jax.device_count(), "jax": jax.__version__,
            "jaxlib": getattr(jax.lib, "__version__", None) or _jaxlib_version()}


def _jaxlib_version() -> str | None:
    return getattr(jaxlib, "__version__", None)


def bandwidth_fields(nbytes: int, seconds: float, copy_bw: float | None) -> dict[str, float]:
    bw = nbytes / seconds
    out = {"achieved_bw": bw}
    if copy_bw:
        out["pct_copy_bw"] = 100.0 * bw / copy_bw
    return out


# --------------------------------------------------------------------------------------------------
# Profiler traces and compiled HLO


def traced_kernels(run: Callable[[], Any], calls: int, top: int = 4) -> dict[str, Any]:
    """Kernel summary per call (`kernel_summary`) of run() under the JAX profiler, which makes `calls`
    calls of what is measured and returns an array to sync on; {"error": ...} if tracing fails
    (profiling is evidence, never fatal)."""
    with tempfile.TemporaryDirectory() as d:
        try:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                jax.block_until_ready(run())
            return kernel_summary(d, calls, top=top) or {}
        except Exception as e:  # noqa: BLE001
            return {"error": repr(e)[:500]}


def median_ms(fn: Callable, *args, trials: int) -> float:
    """Median wall milliseconds of fn(*args) over `trials` synced calls, after one warm-up (the compile)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def kernel_summary(trace_dir: str, steps: int, top: int = 25, window: str | None = None) -> dict[str, Any] | None:
    """Per-step kernel time on the device from a Perfetto trace under trace_dir (None if absent).

    `window`: only kernels that start inside a host span of that name count (a `TraceAnnotation` such as
    the decode loop's "specpilot.decode", or a profiled phase's "specpilot.accept": the phase syncs
    before its span closes, so its kernels lie inside it); the summary then also gives the spans' wall
    time per step (`window_ms_per_step`) and their count.
    """
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return None
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev_pids = {p for p, n in names.items() if re.search(r"/device:(GPU|TPU)", n)}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in dev_pids
               and "stream" in threads.get((e["pid"], e.get("tid")), "Stream").lower()]
    spans = None
    if window is not None:
        spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                       if e.get("ph") == "X" and e.get("pid") not in dev_pids and e.get("name") == window)
        starts = [a for a, _ in spans]
        kernels = [e for e in kernels if _inside(float(e["ts"]), spans, starts)]
    if not kernels:
        return {"kernels": 0, "device_pids": sorted(names[p] for p in dev_pids),
                **({} if spans is None else {"window": window, "spans": len(spans)})}
    by_name = collections.defaultdict(lambda: [0, 0.0])
    durations = collections.defaultdict(list)
    calls = collections.defaultdict(list)  # per name, (start, duration) of each call
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += float(e.get("dur", 0.0))
        durations[e["name"]].append(float(e.get("dur", 0.0)))
        calls[e["name"]].append((e["ts"], float(e.get("dur", 0.0))))
    busy_us = sum(v[1] for v in by_name.values())
    span_us = max(e["ts"] + e.get("dur", 0) for e in kernels) - min(e["ts"] for e in kernels)
    cats = collections.Counter()
    for name, (_, dur) in by_name.items():
        cats[_kernel_category(name)] += dur
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    sequences = {}  # a kernel called several times per step: its median time at each call of the step
    for name, (count, _) in rows:
        per_step = count // steps
        if per_step >= 2 and count == per_step * steps:
            ordered = [dur for _, dur in sorted(calls[name])]
            sequences[name[:120]] = [round(statistics.median(ordered[q::per_step]), 3) for q in range(per_step)]
    return {
        "steps": steps, "kernels_per_step": len(kernels) / steps,
        "busy_ms_per_step": busy_us / steps / 1e3, "span_ms_per_step": span_us / steps / 1e3,
        "category_ms_per_step": {k: v / steps / 1e3 for k, v in cats.most_common()},
        "top": [{"name": n[:120], "calls_per_step": c / steps, "ms_per_step": d / steps / 1e3,
                 "us_per_call": d / c, "us_min": min(durations[n]), "us_median": statistics.median(durations[n]),
                 "us_max": max(durations[n])} for n, (c, d) in rows],
        "sequences": sequences,
        **({} if spans is None else {"window": window, "spans": len(spans),
                                     "window_ms_per_step": sum(b - a for a, b in spans) / steps / 1e3}),
    }


def _inside(ts: float, spans: list[tuple[float, float]], starts: list[float]) -> bool:
    """Whether ts lies in one of the sorted, non-overlapping spans (their starts given for bisection)."""
    i = bisect.bisect_right(starts, ts) - 1
    return i >= 0 and ts <= spans[i][1]


def label_calls(sequence: list[float], labels: list[str]) -> dict[str, dict[str, float]] | None:
    """One kernel's per-call medians of a step (`kernel_summary`'s "sequences") grouped by what each call
    multiplies: `labels` names the calls in step order (e.g. a layer's matrices, repeated, then the LM head).
    Per label: its calls per step, the median of their times and their sum per step (us). None if the counts
    differ (another step structure than the labels describe)."""
    if len(sequence) != len(labels):
        return None
    groups = collections.defaultdict(list)
    for label, us in zip(labels, sequence):
        groups[label].append(us)
    return {label: {"calls": len(v), "us_median": statistics.median(v), "us_per_step": sum(v)}
            for label, v in groups.items()}


def _kernel_category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemv", "gemm", "cublas", "cutlass", "xmma", "sm90", "dot", "matmul")):
        return "matmul"
    if "triton" in n or "pallas" in n or "kernel" in n:
        return "custom"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copy"
    if "reduce" in n or "softmax" in n:
        return "reduce"
    return "elementwise/other"


def hlo_summary(hlo_text: str) -> dict[str, Any]:
    """Counts of custom-call targets and fusion kinds in optimized HLO (what the step launches)."""
    targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text))
    kinds = collections.Counter(re.findall(r"kind=(k\w+)", hlo_text))
    backend = collections.Counter(re.findall(r'"kind":"(__\w+)"', hlo_text))
    return {"custom_calls": dict(targets), "fusion_kinds": dict(kinds), "fusion_backends": dict(backend),
            "while_loops": len(re.findall(r"\bwhile\(", hlo_text)),
            "command_buffers": len(re.findall(r"command_buffer", hlo_text))}


def finite(x: Any) -> bool:
    return bool(np.all(np.isfinite(np.asarray(x, dtype=np.float32)))) if x is not None else False


def make_chain(k: int, mm):
    """A jitted chain over distinct matrices `ws` that times matmuls back to back: each product is
    rescaled into the next one's input, so none can be skipped or fused away."""
    def fit(y):  # [M, N] float32 -> [M, K] bf16, rescaled to stay O(1) down the chain
        n = y.shape[1]
        y = y[:, :k] if n >= k else jnp.tile(y, (1, math.ceil(k / n)))[:, :k]
        return (y * jax.lax.rsqrt(jnp.mean(y * y) + 1e-6)).astype(jnp.bfloat16)

    @jax.jit
    def chain(x, ws):
        for w in ws:
            x = fit(mm(x, w))
        return x

    return chain


# ---- the benchmark scripts' shared arguments --------------------------------------------------------

def common_parser(description: str, *, shape_default: str, shape_help: str, m_default: str,
                  m_help: str = "comma list of rows per product", trials_default: int = 5,
                  kernel_default: str = "mosaic,xla") -> argparse.ArgumentParser:
    """An argument parser holding the flags every benchmark script takes, the same way."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shape", default=shape_default, help=shape_help)
    p.add_argument("--m", default=m_default, help=m_help)
    p.add_argument("--trials", type=int, default=trials_default,
                   help="timed passes per row; the row's time is their median")
    p.add_argument("--out", default="", help="write the JSON record here")
    p.add_argument("--profile", default="",
                   help="comma list of rows (name prefixes) to trace with the JAX profiler (kernel times per call)")
    p.add_argument("--kernel", default=kernel_default,
                   help="matmul implementations in order of preference (pallas_kernels.dispatch.IMPLEMENTATIONS)")
    p.add_argument("--kernel-config", default="",
                   help="JSON object of the first implementation's settings, e.g. '{\"mp_choices\": [8, 16, 64]}'")
    return p


def comma_list(text: str, type_=str) -> list:
    return [type_(s) for s in text.split(",") if s]


def parse_common(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, then check and convert the shared flags: `m` a list of ints, `profile` a list, `trials` >= 1,
    `choice` the matmul OpChoice (errors name the flag)."""
    args = p.parse_args(argv)
    try:
        args.m = comma_list(args.m, int)
    except ValueError:
        p.error(f"--m takes a comma list of integers, got {args.m!r}")
    if not args.m or min(args.m) < 1:
        p.error(f"--m takes row counts >= 1, got {args.m}")
    if args.trials < 1:
        p.error(f"--trials must be >= 1, got {args.trials}")
    args.profile = comma_list(args.profile)
    try:
        args.choice = matmul_choice(args.kernel, args.kernel_config)
    except (ValueError, TypeError) as e:
        p.error(f"--kernel / --kernel-config: {e}")
    return args


def matmul_choice(kernel: str, kernel_config: str = ""):
    """"mosaic,xla" and '{"small_m_stages": 3}' -> the matmul OpChoice a plan with those values would hold."""
    try:
        config = json.loads(kernel_config) if kernel_config else None
    except json.JSONDecodeError as e:
        raise ValueError(f"the config is not JSON: {e}") from None
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"the config must be a JSON object, got {kernel_config!r}")
    return dispatch.choice("matmul", comma_list(kernel), config)


def init_params_on_device(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, std: float = 0.02,
                          wide_margin: bool = True):
    """Random params with dense.param_shapes' structure, generated on the device one layer at a time.

    One normal draw per layer, sliced into its matrices: each distinct random call costs a compile
    (about 0.5 s on a CPU), and one jitted layer initializer serves every layer. `wide_margin` applies
    `dense.init_wide_margin`'s scheme (embed N(0, 1), residual writes o/down at std / (3 sqrt(2L)), head =
    permuted embedding / sqrt(H)), so variants' greedy tokens are comparable: with N(0, std) everywhere
    the top-2 logits are near-ties and any change of kernel changes the tokens.
    """
    shapes = dense.param_shapes(cfg)
    layer = shapes["layers"][0]
    mats = [n for n in layer if not n.endswith(("norm", "bias"))]
    sizes = [math.prod(layer[n]) for n in mats]

    out_std = std / (3.0 * (2.0 * cfg.num_layers) ** 0.5) if wide_margin else std

    @jax.jit
    def make_layer(k):
        flat = jax.random.normal(k, (sum(sizes),), jnp.float32)
        out, start = {}, 0
        for n, size in zip(mats, sizes):
            scale = out_std if n in ("o", "down") else std
            out[n] = (scale * flat[start:start + size]).astype(dtype).reshape(layer[n])
            start += size
        for n in layer:
            if n not in out:  # norms are ones, biases zeros
                out[n] = (jnp.ones if n.endswith("norm") else jnp.zeros)(layer[n], dtype)
        return out

    embed_std = 1.0 if wide_margin else std

    @jax.jit
    def make_matrix(k):
        return (embed_std * jax.random.normal(k, shapes["embed"], jnp.float32)).astype(dtype)

    @jax.jit
    def permuted_head(embed, k):  # [H, V]: column v reads embedding row pi(v)
        perm = jax.random.permutation(k, cfg.vocab_size)
        return (embed[perm].astype(jnp.float32).T / math.sqrt(cfg.hidden_size)).astype(dtype)

    k_layers, k_embed, k_head = jax.random.split(key, 3)
    layers = tuple(jax.block_until_ready(make_layer(k)) for k in jax.random.split(k_layers, cfg.num_layers))
    params = {"layers": layers, "final_norm": jnp.ones((cfg.hidden_size,), dtype), "embed": make_matrix(k_embed)}
    if "lm_head" in shapes:  # [H, V]
        params["lm_head"] = (permuted_head(params["embed"], k_head) if wide_margin
                             else jax.jit(lambda k: make_matrix(k).T)(k_head))
    return jax.block_until_ready(params)
