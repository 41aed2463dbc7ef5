"""Measure the cost model's rates on this device: `python experiments/bench/calibrate.py [target=... gpu=...]`.

Composes the same config as experiments/run.py (same overrides), builds its deployment and plans, and
measures on the current device: copy bandwidth, per-launch cost, host cost per while-loop step and per
dispatched call, the peak matmul rate, and for every matmul implementation the plans use, seconds per
launch at each (K, N) the plans multiply over an M grid (1, 2, 4, ... and the M values the plans use).
Writes `conf/gpu/rates/<gpu.name>.yaml` (matmul tables merge with those already there, so calibrating
several deployments accumulates their shapes); `+calibrate.out=<file>` writes elsewhere.
Options: `+calibrate.repeats=7`, `+calibrate.min_bytes=<bytes of weight copies per timed call>`
(default 256 MB: more than the caches hold, as a decode step streams its weights),
`+calibrate.grid=[1,16]` (the M values measured besides those the plans use; default 1, 2, 4, ... 128).
How a launch is timed, and why: docs/design/bench.md.
"""

from __future__ import annotations

import datetime
import functools
import logging
import math
import statistics
import time
from pathlib import Path

import hydra
import jax
import jax.numpy as jnp
from omegaconf import DictConfig, open_dict

from pallas_kernels import dispatch
from specpilot.costmodel import counts
from specpilot.costmodel.rates import RATES_DIR, MatmulTable, Rates
from specpilot.formats import w12
from specpilot.harness import config_schema, deploy

config_schema.register()
log = logging.getLogger("calibrate")
M_GRID = (1, 2, 4, 8, 16, 32, 64, 128)


def _time(fn, *args, repeats: int) -> float:
    """Median seconds of fn(*args) synced, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def copy_gbs(nbytes: int, repeats: int) -> float:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    return 2 * x.nbytes / _time(f, x, repeats=repeats) / 1e9


def launch_us(repeats: int, n: int = 256) -> float:
    """A chain of n dependent tiny products (each its own kernel) per call, less one call's dispatch."""
    w = jnp.full((8, 8), 0.1, jnp.float32)

    @jax.jit
    def chain(x, w):
        for _ in range(n):
            x = jnp.sin(x @ w)
        return x

    @jax.jit
    def one(x, w):
        return jnp.sin(x @ w)

    x = jnp.ones((1, 8), jnp.float32)
    return 1e6 * (_time(chain, x, w, repeats=repeats) - _time(one, x, w, repeats=repeats)) / (n - 1)


def host_step_us(repeats: int, n: int = 2000) -> float:
    """One iteration of an on-device while loop with a trivial body."""
    @jax.jit
    def loop(x):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 1.0001 + 1.0), (0, x))[1]

    @jax.jit
    def once(x):
        return x * 1.0001 + 1.0

    x = jnp.ones((8,), jnp.float32)
    return 1e6 * (_time(loop, x, repeats=repeats) - _time(once, x, repeats=repeats)) / n


def dispatch_us(repeats: int) -> float:
    f = jax.jit(lambda x: x + 1.0)
    x = jnp.ones((8,), jnp.float32)
    return 1e6 * _time(f, x, repeats=max(50, 10 * repeats))


def peak_tflops(gpu: bool, repeats: int) -> float:
    n, dtype = (8192, jnp.bfloat16) if gpu else (1024, jnp.float32)
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    return 2 * n ** 3 / _time(f, a, a, repeats=repeats) / 1e12


def plan_matmuls(plans, shape: counts.Shape) -> dict[str, tuple[set, set]]:
    """impl -> ((K, N) shapes, M values) the plans' steps multiply."""
    out: dict[str, tuple[set, set]] = {}
    for plan in plans:
        for k in counts.step_counts(plan, shape).kernels:
            if k.dot and k.impl:
                shapes, ms = out.setdefault(k.impl, (set(), set()))
                shapes.add((k.k, k.n))
                ms.add(k.m)
    return out


def _weight(impl: str, k: int, n: int, m: int, key):
    """A random weight stored and laid out as `impl` multiplies it; -> (weight, activation dtype, matmul)."""
    name, storage = impl.split("/")
    dtype = jnp.float32 if storage == "f32" else jnp.bfloat16
    tied = name == "xla-tied"
    w = (0.02 * jax.random.normal(key, (n, k) if tied else (k, n), jnp.float32)).astype(dtype)
    return _layout(impl, w, dtype, m)


def _layout(impl: str, w, dtype, m: int):
    name, storage = impl.split("/")
    tied = name == "xla-tied"
    if tied:  # the tied head: an einsum against the embedding [V, H]
        return w, dtype, lambda x, w: jnp.einsum("...h,vh->...v", x, w, preferred_element_type=jnp.float32)
    choice = dispatch.OpChoice((name,))
    if storage == "w12":
        w = w12.encode_device(w)
    w = dispatch.prepare_weight(w, choice, rows=m)
    return w, dtype, lambda x, w: dispatch.matmul(x, w, choice=choice)


def _dependent_chain(fn, x, weights):
    """Each launch waits for the one before (as a decode step's products do): XLA's CPU runtime runs
    independent products concurrently, which would overstate the rate."""
    for w in weights:
        y = fn(x, w)
        x = x + (1e-30 * jnp.sum(y.astype(jnp.float32))).astype(x.dtype)
    return x


def _looped_chain(fn, x, weights, passes):
    """`passes` times the dependent chain over every weight, in one on-device loop (the trip count is an
    argument: one compile serves every pass count)."""
    return jax.lax.fori_loop(0, passes, lambda _, x: _dependent_chain(fn, x, weights), x)


def per_launch_s(run, copies: int, loop_s: float, repeats: int, min_call_s: float = 2e-2) -> float:
    """Seconds per launch from `run(passes)` (which executes passes x copies launches and waits for them).

    A call also pays a fixed cost (dispatch, argument handling, the sync): on the H200 about 65 us, more
    than a whole 4096x4096 product, so dividing one call by its launches overstates every launch. Two pass
    counts are timed in alternation and each pair differenced, which cancels any fixed cost and any slow
    drift of the clock; the median difference is taken, and `loop_s` (one on-device loop iteration,
    `host_step_us`) comes off each extra pass. Passes are added until the difference spans at least
    `min_call_s`: at a 2 ms span the H200's call-to-call jitter still moved single entries by 30-90 us."""
    def timed(passes):
        t0 = time.perf_counter()
        run(passes)
        return time.perf_counter() - t0

    run(1)  # warm-up (and compile)
    base = statistics.median(timed(1) for _ in range(3))
    extra = int(min(256, max(2, math.ceil(min_call_s / max(base, 1e-7)))))
    run(1 + extra)
    diffs = []
    for _ in range(repeats):
        short = timed(1)
        diffs.append(timed(1 + extra) - short)
    per_pass = statistics.median(diffs) / extra
    return max(per_pass - loop_s, 1e-9) / copies


def matmul_table(impl: str, shapes, ms, min_bytes: int, repeats: int, loop_s: float = 0.0,
                 base_grid=M_GRID) -> MatmulTable | None:
    storage = impl.split("/")[1]
    wbytes = {"f32": 4.0, "bf16": 2.0, "w12": 1.5}[storage]
    act = 4 if storage == "f32" else 2
    grid = sorted(set(base_grid) | set(ms))
    grid = [m for m in grid if m <= max(2 * max(ms), 8)]
    kept, rows = [], []
    for k, n in sorted(shapes):
        copies = int(min(128, max(2, math.ceil(min_bytes / (k * n * wbytes)))))
        row = []
        base = _weight(impl, k, n, 1, jax.random.key(k * n))[0] if impl.endswith(("f32", "bf16")) and \
            impl.startswith("xla") else None
        try:
            for m in grid:
                if base is not None:  # plain arrays: cheap distinct copies of one random matrix
                    scale = jax.jit(lambda w, i: w * (1 + 1e-3 * i).astype(w.dtype))
                    ws = [(scale(base, jnp.float32(i)), base.dtype, _layout(impl, base, base.dtype, m)[2])
                          for i in range(copies)]
                else:
                    ws = [_weight(impl, k, n, m, jax.random.key(i)) for i in range(copies)]
                fn = ws[0][2]
                weights = [w for w, _, _ in ws]
                x = jnp.ones((m, k), ws[0][1])
                step = jax.jit(functools.partial(_looped_chain, fn))
                row.append(per_launch_s(lambda p: jax.block_until_ready(step(x, weights, jnp.int32(p))),
                                        copies, loop_s, repeats))
                del ws, weights
        except NotImplementedError as e:
            log.warning("%s refuses %dx%d: %s", impl, k, n, e)
            continue
        kept.append((k, n))
        rows.append(tuple(row))
        log.info("%s %dx%d: %s us", impl, k, n, " ".join(f"{1e6 * t:.1f}" for t in row))
    if not kept:
        return None
    return MatmulTable(impl, tuple(grid), tuple(kept), tuple(rows), wbytes, act)


@hydra.main(version_base=None, config_path="../../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    with open_dict(cfg):  # this script's own options, not part of the run config the schema types
        cal = cfg.pop("calibrate", None) or {}
    cfg = config_schema.typed(cfg)
    repeats = int(cal.get("repeats", 7))
    on_gpu = jax.devices()[0].platform == "gpu"
    min_bytes = int(cal.get("min_bytes", 256 * 2 ** 20))
    base_grid = tuple(int(m) for m in cal.get("grid", M_GRID))
    if not base_grid or min(base_grid) < 1:
        raise SystemExit(f"calibrate.grid: M values must be positive integers, got {list(base_grid)}")
    t0 = time.perf_counter()
    plans = config_schema.build_plans(cfg)
    dep = deploy.build(cfg, plans)
    shape = counts.Shape.from_deployment(dep)
    wanted = plan_matmuls(plans, shape)
    del dep
    dev = jax.devices()[0]
    rates = dict(copy_gbs=copy_gbs((1024 if on_gpu else 256) * 2 ** 20, repeats), launch_us=launch_us(repeats),
                 host_step_us=host_step_us(repeats), dispatch_us=dispatch_us(repeats),
                 matmul_tflops=peak_tflops(on_gpu, repeats))
    log.info("rates: %s", rates)
    tables = {}
    for impl, (shapes, ms) in sorted(wanted.items()):
        table = matmul_table(impl, shapes, ms, min_bytes, repeats, 1e-6 * rates["host_step_us"], base_grid)
        if table is not None:
            tables[impl] = table
    out = Path(cal.get("out") or RATES_DIR / f"{cfg.gpu.name}.yaml")
    if out.is_file():
        old = Rates.load(out)
        for impl, t in old.matmul.items():
            tables[impl] = t.merged(tables[impl]) if impl in tables else t
    source = (f"experiments/bench/calibrate.py {datetime.date.today().isoformat()}, jax {jax.__version__}, "
              f"{dev.platform}:{getattr(dev, 'device_kind', '')}, target {cfg.target.name}")
    Rates(device=f"{dev.platform}:{getattr(dev, 'device_kind', '')}", matmul=tables, source=source,
          **rates).save(out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f} s: " + ", ".join(f"{k} {v:.4g}" for k, v in rates.items()))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
