"""Hardware counters (Nsight Compute) of the W12 Mosaic kernel as runs call it, its bf16 twin and XLA's dot,
at Qwen3-8B's fused decode shapes: where the W12 kernel's time goes, measured rather than inferred.

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --profile-from-start off --clock-control none \
        --target-processes application-only --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        --section ComputeWorkloadAnalysis -o w12 python3 experiments/ncu_w12.py --m 1,16 --out order.json
    ncu --import w12.ncu-rep --csv --page details > details.csv
    python3 experiments/ncu_w12.py --table details.csv --order order.json      # the table in performance.md

Per instruction (`--section SourceCounters`, PC sampling; `--kernel-name regex:mosaic` profiles the Mosaic
kernels alone, W12 then the twin per case):

    ncu --import w12.ncu-rep --page source --csv --print-source sass > source.csv
    python3 experiments/ncu_w12.py --source source.csv --order order.json     # where each kernel's warps wait

Design choices:
- Each product is called exactly as a run calls it (`w12.linear`: the W12 matrix packed by
  `w12.encode_params(kernel="mosaic")`, the twin through `dense_kernel=True`, bf16 through XLA's einsum),
  compiled and warmed up first; only the measured calls sit inside the profiler range
  (`cuProfilerStart`/`cuProfilerStop`), so compilation and XLA's autotuning are not captured.
- Inside the range every shape runs xla, w12, twin in that order, one call each, synchronized between
  calls; `--out` records that order, so the report's kernels can be matched to products (the twin's call
  also holds the transpose that tiles its bf16 weight, and every Mosaic call the sum of its K splits).
- W12 is checked against the twin bit for bit before profiling: a counter reading of a wrong kernel is
  worthless.
- Counters come from ncu's replay (each kernel alone, L2 flushed before each pass by its default cache
  control): weights are read from DRAM as in a decode step, launch gaps are not included. Run it with
  `XLA_PYTHON_CLIENT_PREALLOCATE=false`: ncu saves and restores the device memory a kernel can write before
  each replay pass, and with XLA's default preallocation (75% of the H200's memory) the first Mosaic kernel
  did not get through its passes in 4 minutes.
- `--table` reads ncu's CSV export (`--page details`) back: the kernels of each call are told apart by the
  Mosaic kernels' positions (two per case: W12, then the twin; each with one kernel before it that
  prepares x and one after that adds the splits), and XLA's call is everything between the previous
  case's last kernel and W12's first.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specpilot.formats import w12  # noqa: E402

# Qwen3-8B's products as a run makes them (fused qkv and gate_up), plus k/v alone (the per-layer goal's
# smallest shape); [K, N]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
          "k/v": (4096, 1024)}


class _Profiler:
    """cuProfilerStart/Stop on the primary context (the one XLA uses), through the driver API."""

    def __init__(self):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        ctx, dev = ctypes.c_void_p(), ctypes.c_int()
        for call in (lambda: self.cuda.cuInit(0), lambda: self.cuda.cuDeviceGet(ctypes.byref(dev), 0),
                     lambda: self.cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                     lambda: self.cuda.cuCtxSetCurrent(ctx)):
            if call() != 0:
                raise RuntimeError("could not make the primary CUDA context current for cuProfilerStart")

    def start(self):
        if self.cuda.cuProfilerStart() != 0:
            raise RuntimeError("cuProfilerStart failed")

    def stop(self):
        if self.cuda.cuProfilerStop() != 0:
            raise RuntimeError("cuProfilerStop failed")


def _pack(w: jax.Array, rows: int):
    """A [K, N] bf16 matrix packed as a run packs it for the Mosaic kernel."""
    packed = w12.encode_params({"layers": ({"w": w},)}, names=("w",), lm_head=False, kernel="mosaic",
                               rows=rows)["layers"][0]["w"]
    if not isinstance(packed, w12.W12NK):
        raise RuntimeError(f"a [{w.shape[0]}, {w.shape[1]}] matrix was kept bf16: nothing to profile")
    return packed


def _stored_bytes(nk) -> int:
    """Bytes of the operands a run passes to the kernel (planes, bases, slot table, placeholders)."""
    from pallas_kernels import w12_mosaic

    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(w12_mosaic.run_operands(nk))))


# (section, metric) of ncu's details page, and the column each becomes in `--table`
TABLE_METRICS = (
    ("GPU Speed Of Light Throughput", "Duration", "us"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput", "dram_pct"),
    ("GPU Speed Of Light Throughput", "SM Active Cycles", "sm_active_cycles"),
    ("GPU Speed Of Light Throughput", "Elapsed Cycles", "elapsed_cycles"),
    ("Compute Workload Analysis", "Issue Slots Busy", "issue_busy_pct"),
    ("Scheduler Statistics", "No Eligible", "no_eligible_pct"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycles_per_issue"),
    ("Occupancy", "Achieved Active Warps Per SM", "warps_per_sm"),
    ("Launch Statistics", "Registers Per Thread", "registers"),
    ("Launch Statistics", "Dynamic Shared Memory Per Block", "smem_kb"),
)


def read_details(path: str) -> "collections.OrderedDict[int, dict]":
    """ncu's `--csv --page details` export: {kernel ID: {name, grid, metrics {(section, metric): value}}},
    in launch order. A path ending in .gz is read gzipped."""
    kernels: collections.OrderedDict[int, dict] = collections.OrderedDict()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            d = kernels.setdefault(int(r["ID"]), {"name": r["Kernel Name"], "grid": r["Grid Size"], "metrics": {}})
            if r["Metric Name"]:
                d["metrics"][(r["Section Name"], r["Metric Name"])] = r["Metric Value"]
    return kernels


def assign_calls(kernels: "collections.OrderedDict[int, dict]", order: list[dict]) -> list[tuple[dict, list[int]]]:
    """Each profiled call (`order`: xla, w12, twin per case) with the IDs of its kernels. Raises if the
    kernels do not have the expected shape (two Mosaic kernels per case, each with a kernel before and
    after it)."""
    ids = list(kernels)
    mosaic = [j for j, kid in enumerate(ids) if "mosaic" in kernels[kid]["name"]]
    if len(order) % 3 or len(mosaic) != 2 * (len(order) // 3):
        raise ValueError(f"{len(mosaic)} Mosaic kernels for {len(order)} calls: expected two per three calls")
    calls, prev = [], 0
    for c in range(len(order) // 3):
        a, b = mosaic[2 * c], mosaic[2 * c + 1]
        if a - 1 <= prev or b - 1 <= a + 1:
            raise ValueError(f"case {c}: no kernel for XLA's call or the twin's preparation")
        if b + 1 >= len(ids):
            raise ValueError(f"case {c}: no kernel after the twin's Mosaic kernel (its split sum)")
        calls += [(order[3 * c], ids[prev:a - 1]), (order[3 * c + 1], ids[a - 1:a + 2]),
                  (order[3 * c + 2], ids[a + 2:b + 2])]
        prev = b + 2
    if prev != len(ids):
        raise ValueError(f"{len(ids) - prev} kernels after the last call")
    return calls


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text not in ("", "-") else float("nan")


def table(kernels, order: list[dict]) -> list[dict]:
    """One row per call: its main kernel's counters (the Mosaic kernel of W12 and the twin, the largest
    kernel of XLA's call) and the duration of all its kernels."""
    out = []
    for call, kids in assign_calls(kernels, order):
        def dur(kid):
            return _number(kernels[kid]["metrics"].get(("GPU Speed Of Light Throughput", "Duration"), "-"))
        if call["call"] == "xla":
            main_id = max(kids, key=dur)
        else:
            main_id = next(kid for kid in kids if "mosaic" in kernels[kid]["name"])
        k = kernels[main_id]
        row = dict(call, kernel=k["name"], grid=k["grid"], all_kernels_us=sum(dur(kid) for kid in kids))
        for section, metric, col in TABLE_METRICS:
            row[col] = _number(k["metrics"].get((section, metric), "-"))
        out.append(row)
    return out


def print_table(rows: list[dict]):
    cols = ["shape", "m", "call", "grid", "us", "all_kernels_us", "dram_pct", "sm_active_pct", "issue_busy_pct",
            "no_eligible_pct", "cycles_per_issue", "warps_per_sm", "registers", "smem_kb"]
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        r = dict(r, sm_active_pct=100 * r["sm_active_cycles"] / r["elapsed_cycles"])
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")


# SASS classes of `--source`: the pipeline's wait for a step's copies (the mbarrier try-wait and the
# branch that loops on it), wgmma (issue and the wait for its completion)
_COPY_WAIT = ("SYNCS.PHASECHK",)
_WGMMA = ("HGMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE")


def read_source(path: str) -> list[list[dict]]:
    """ncu's `--page source --csv --print-source sass` export: per kernel (in launch order) its SASS
    instructions, each {address, sass, executed (warp instructions), samples (warp stall samples),
    stalls {reason: samples}}. A path ending in .gz is read gzipped."""
    opener = gzip.open if path.endswith(".gz") else open
    kernels, header = [], None
    with opener(path, "rt", newline="") as f:
        for r in csv.reader(f):
            if r and r[0] == "Kernel Name":
                kernels.append([])
                header = None
            elif kernels and header is None:
                header = r
            elif kernels and r:
                d = dict(zip(header, r))
                stalls = {c[len("stall_"):]: _number(v) for c, v in d.items()
                          if c.startswith("stall_") and "Not Issued" not in c and v not in ("", "-")}
                kernels[-1].append(dict(address=d["Address"], sass=d["Source"].strip(),
                                        executed=_number(d["Instructions Executed"] or "0"),
                                        samples=_number(d["Warp Stall Sampling (All Samples)"] or "0"),
                                        stalls=stalls))
    if not kernels:
        raise ValueError(f"{path}: no 'Kernel Name' line: not an ncu --page source export")
    return kernels


def source_summary(instrs: list[dict]) -> dict:
    """Where one kernel's warps are, from its per-instruction counts:

    - warps: the first instruction's execution count (the kernel's entry runs once per warp); steps: the
      execution count held by the most instructions, over warps (the K loop's body runs once per warp and
      step);
    - instructions per warp and step: in the loop body (executed every step), in the rest of the loop
      that runs at some steps (copies issued ahead, the exception patches), and once per warp;
    - the share of stall samples at the copies' wait, at wgmma, in the loop body's other instructions,
      in the rest of the loop and in the code run once per warp."""
    executed = [i["executed"] for i in instrs if i["executed"] > 0]
    if not instrs or not instrs[0]["executed"]:
        raise ValueError("the kernel's first instruction was not executed: not a profiled kernel's source")
    warps = instrs[0]["executed"]
    counts = collections.Counter(executed)
    body = max((c for c in counts if c > warps), key=lambda c: (counts[c], c), default=warps)
    steps = body / warps
    wait_idx = set()
    for q, i in enumerate(instrs):  # the try-wait and the branch that loops back to it
        if i["sass"].startswith(_COPY_WAIT):
            wait_idx.update({q, q + 1})
    total = sum(i["samples"] for i in instrs) or float("nan")
    share = collections.Counter()
    per_step = collections.Counter()
    for q, i in enumerate(instrs):
        if q in wait_idx:
            cls = "copy_wait"
        elif i["sass"].startswith(_WGMMA):
            cls = "wgmma"
        elif i["executed"] == body:
            cls = "body"
        elif i["executed"] != warps:
            cls = "sometimes"
        else:
            cls = "once"
        share[cls] += i["samples"] / total
        if i["executed"] != warps or q in wait_idx:
            per_step["loop" if i["executed"] == body else "sometimes"] += i["executed"] / body
        else:
            per_step["once"] += i["executed"] / warps
    stalls = collections.Counter()
    for i in instrs:
        stalls.update(i["stalls"])
    return dict(warps=int(warps), steps=steps, instructions=len(instrs),
                body_per_step=sum(1 for i in instrs if i["executed"] == body),
                per_step_loop=per_step["loop"], per_step_sometimes=per_step["sometimes"], once=per_step["once"],
                share={k: round(v, 4) for k, v in share.items()},
                stalls={k: v / total for k, v in stalls.most_common() if v})


def print_source(paths_rows: list[tuple[dict, dict]]):
    cols = ("copy_wait", "wgmma", "body", "sometimes", "once")
    print("| shape | M | call | warps | steps | loop instructions per step (+ at some steps) | once per warp | "
          + " | ".join(f"samples: {c}" for c in cols) + " | top stall reasons |")
    print("|" + " --- |" * (7 + len(cols)))
    for call, s in paths_rows:
        top = ", ".join(f"{k} {100 * v:.0f}%" for k, v in list(s["stalls"].items())[:4])
        print(f"| {call['shape']} | {call['m']} | {call['call']} | {s['warps']} | {s['steps']:.0f} | "
              f"{s['per_step_loop']:.0f} (+{s['per_step_sometimes']:.0f}) | {s['once']:.0f} | "
              + " | ".join(f"{100 * s['share'].get(c, 0):.1f}%" for c in cols) + f" | {top} |")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", default="1", help="comma list of activation rows")
    p.add_argument("--only", default="", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="write the order of the profiled calls here (JSON)")
    p.add_argument("--table", default="", help="summarize this ncu details CSV (with --order) instead of running")
    p.add_argument("--order", default="", help="with --table or --source: the --out file of the profiled run")
    p.add_argument("--source", default="",
                   help="summarize this ncu source CSV (--page source --print-source sass, Mosaic kernels only) "
                        "with --order instead of running")
    args = p.parse_args(argv)
    if args.source:
        if not args.order:
            raise SystemExit("--source needs --order (the JSON the profiled run wrote with --out)")
        with open(args.order) as f:
            calls = [c for c in json.load(f)["order"] if c["call"] != "xla"]
        kernels = read_source(args.source)
        if len(kernels) != len(calls):
            raise SystemExit(f"{len(kernels)} kernels in {args.source} for {len(calls)} W12 and twin calls: "
                             f"profile the Mosaic kernels alone (--kernel-name regex:mosaic)")
        rows = [(c, source_summary(k)) for c, k in zip(calls, kernels)]
        print_source(rows)
        return {"source": rows}
    if args.table:
        if not args.order:
            raise SystemExit("--table needs --order (the JSON the profiled run wrote with --out)")
        with open(args.order) as f:
            rows = table(read_details(args.table), json.load(f)["order"])
        print_table(rows)
        return {"rows": rows}
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("ncu_w12.py needs a GPU (the Mosaic kernel compiles for Hopper)")
    names = [s for s in args.only.split(",") if s] or list(SHAPES)
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    ms = [int(m) for m in args.m.split(",")]

    xla = w12_call = jax.jit(lambda x, w: w12.linear(x, w))  # by the weight's type: XLA's dot, or the W12 kernel
    twin = jax.jit(lambda x, w: w12.linear(x, w, implementation="mosaic", dense_kernel=True))
    key = jax.random.PRNGKey(args.seed)
    cases = []
    for name in names:
        k, n = SHAPES[name]
        key, kw, kx = jax.random.split(key, 3)
        w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
        for m in ms:
            nk = _pack(w, m)
            x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
            outs = {}
            for label, f, wt in (("xla", xla, w), ("w12", w12_call, nk), ("twin", twin, w)):
                for _ in range(2):  # compile, then warm
                    outs[label] = jax.block_until_ready(f(x, wt))
            a, b = np.asarray(outs["w12"]), np.asarray(outs["twin"])
            exact = bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)))
            if not exact:
                raise SystemExit(f"{name} M={m}: W12 differs from its twin; not profiling a wrong kernel")
            cases.append(dict(shape=name, k=k, n=n, m=m, x=x, w=w, nk=nk, exact=exact,
                              w12_bytes=_stored_bytes(nk), bf16_bytes=2 * k * n))
            print(f"{name} [{k}, {n}] M={m}: W12 exact against the twin", flush=True)

    prof = _Profiler()
    order = []
    prof.start()
    for c in cases:
        for label, f, wt in (("xla", xla, c["w"]), ("w12", w12_call, c["nk"]), ("twin", twin, c["w"])):
            jax.block_until_ready(f(c["x"], wt))
            order.append(dict(shape=c["shape"], m=c["m"], call=label))
    prof.stop()
    record = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, order=order,
                  cases=[{k: v for k, v in c.items() if k not in ("x", "w", "nk")} for c in cases])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(order), flush=True)
    return record


if __name__ == "__main__":
    main()
