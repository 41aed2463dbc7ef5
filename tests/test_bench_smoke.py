"""Smoke test of the AR benchmark on the tiny shape (CPU, seconds): the record has sane fields.

No timing thresholds: CPU timings say nothing about the GPU and would make the test flaky.
"""

import csv
import importlib.util
import math
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench_ar():
    return _load("bench_ar")


def test_bench_ar_tiny_record(bench_ar, tmp_path):
    out = tmp_path / "r.json"
    rec = bench_ar.main(["--shape", "tiny", "--context", "8", "--new-tokens", "4", "--warmup", "1",
                         "--copy-gib", "0.01", "--variants", "stock", "--out", str(out)])
    assert out.is_file()
    assert rec["shape"] == "tiny" and rec["batch"] == 1 and rec["new_tokens"] == 4
    assert rec["copy"]["bw"] > 0 and rec["floor_ms"] > 0 and rec["prefill_ms"] > 0
    sb = rec["step_bytes"]
    assert sb["total"] == sb["weights"] + sb["embed_rows"] + sb["kv_read"] + sb["kv_write"] + sb["logits"]
    v = rec["variants"]["stock"]
    assert "error" not in v, v.get("error")
    assert v["n"] == 4 and 0 < v["p10_ms"] <= v["median_ms"] <= v["p90_ms"]
    assert v["gen_ms_per_token"] > 0 and math.isclose(v["tokens_per_s"], 1e3 / v["gen_ms_per_token"])
    assert v["pct_copy_bw"] > 0 and v["first_logits_finite"] and v["token_match_frac"] == 1.0


@pytest.mark.slow
def test_bench_ar_tiny_variants_agree(bench_ar):
    rec = bench_ar.main(["--shape", "tiny", "--context", "8", "--new-tokens", "4", "--warmup", "1",
                         "--copy-gib", "0.01", "--variants", "stock,replica,fused,fused_nk,stock_fori"])
    for name, v in rec["variants"].items():
        assert "error" not in v, (name, v.get("error"))
        # Same function of the same weights: greedy tokens agree with stock's.
        assert v["token_match_frac"] == 1.0, name
        if "first_logits_rel_err_vs_ref" in v:
            assert v["first_logits_rel_err_vs_ref"] < 1e-2, name


def test_step_bytes_qwen3_8b(bench_ar):
    from specpilot import bench

    cfg = bench_ar.SHAPES["qwen3-8b"]
    sb = bench.step_bytes(cfg, batch=1, cache_len=768)
    # 36 layers of q/k/v/o + SwiGLU matrices and the LM head: 15.14 GB of bf16 (norms add ~0.6 MB).
    assert abs(sb["weights"] / 1e9 - 15.14) < 0.01
    assert sb["kv_read"] == 2 * 36 * 768 * 8 * 128 * 2
    assert sb["embed_rows"] == 4096 * 2 and sb["logits"] == 151936 * 4


def test_bench_ar_tiny_w12_rows(bench_ar, tmp_path):
    """bf16 vs W12 at batch 1: XLA bf16, the kernel's bf16 twin and W12 (interpret mode on the CPU); the W12
    run computes the twin's logits bit for bit, and its bandwidth counts the W12 bytes."""
    rec = bench_ar.main(["--shape", "tiny", "--context", "8", "--new-tokens", "4", "--warmup", "1",
                         "--copy-gib", "0.01", "--weights", "bf16,w12", "--out", str(tmp_path / "r.json")])
    assert list(rec["variants"]) == ["stock", "stock_twin", "stock@w12"]
    for name, v in rec["variants"].items():
        assert "error" not in v, (name, v.get("error"))
        assert v["gen_ms_per_token"] > 0 and v["median_ms"] > 0
    assert rec["variants"]["stock@w12"]["weights"] == "w12"
    assert rec["variants"]["stock_twin"]["first_logits_rel_err_vs_ref"] > 0  # really not XLA's dot
    twin = rec["variants"]["stock@w12"]["vs_twin"]
    assert twin["twin"] == "stock_twin" and twin["exact"] and twin["first_logits_bit_equal"]
    e = rec["w12"]
    assert e["matrices"] == 2 * 7 + 1 and not e["kept_bf16"] and e["encode_s"] > 0
    assert 12.0 < e["bits_per_weight"] < 12.5  # K = 64: the per-column base byte is 0.125 bits
    sb, sw = rec["step_bytes"], rec["step_bytes_w12"]
    assert sw["total"] - sb["total"] == e["bytes"] - e["bf16_bytes_replaced"] < 0
    assert rec["variants"]["stock@w12"]["step_bytes_total"] == sw["total"]


def test_kernel_summary_reads_a_perfetto_trace(tmp_path):
    """`bench.kernel_summary` on a hand-written Perfetto trace: only the device's stream events count, per
    step; busy is their summed duration, span first start to last end, and each kernel's per-call
    min/median/max come from its own events."""
    import gzip
    import json as json_

    from specpilot import bench as bench_

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "python"}}]
    kernels = [{"ph": "X", "pid": 1, "tid": 7, "name": "w12_kernel", "ts": t, "dur": d}
               for t, d in ((0, 10.0), (20, 30.0), (60, 20.0))]
    kernels.append({"ph": "X", "pid": 1, "tid": 7, "name": "reduce_fusion", "ts": 90, "dur": 10.0})
    host = [{"ph": "X", "pid": 2, "tid": 1, "name": "w12_kernel", "ts": 0, "dur": 500.0}]  # not a device event
    d = tmp_path / "plugins" / "profile"
    d.mkdir(parents=True)
    with gzip.open(d / "x.perfetto_trace.json.gz", "wt") as f:
        json_.dump({"traceEvents": meta + kernels + host}, f)
    s = bench_.kernel_summary(str(tmp_path), steps=2)
    assert s["kernels_per_step"] == 2.0
    assert abs(s["busy_ms_per_step"] - 35e-3) < 1e-9 and abs(s["span_ms_per_step"] - 50e-3) < 1e-9
    top = s["top"][0]
    assert top["name"] == "w12_kernel" and (top["us_min"], top["us_median"], top["us_max"]) == (10.0, 20.0, 30.0)
    assert bench_.kernel_summary(str(tmp_path / "none"), steps=1) is None


def test_kernel_summary_times_each_call_of_a_step(tmp_path, bench_ar):
    """A kernel called several times per step gets its median time at each call of the step ("sequences",
    over the steps), and `mosaic_calls` names those calls by the matrices a step multiplies, in order; a
    count that does not match the matrices gives no breakdown."""
    import gzip
    import json as json_

    from specpilot import bench as bench_

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}}]
    per_call = [(5.0, 7.0), (50.0, 54.0), (9.0, 9.0), (300.0, 310.0)]  # two steps: qkv, gate_up, down, lm_head
    events, t = [], 0
    for step in range(2):
        for name, durs in zip(("kernel_mosaic_gpu_kernel",) * 4, per_call):
            events.append({"ph": "X", "pid": 1, "tid": 7, "name": name, "ts": t, "dur": durs[step]})
            t += 400
        events.append({"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "ts": t, "dur": 1.0})
        t += 10
    d = tmp_path / "plugins" / "profile"
    d.mkdir(parents=True)
    with gzip.open(d / "x.perfetto_trace.json.gz", "wt") as f:
        json_.dump({"traceEvents": meta + events}, f)
    s = bench_.kernel_summary(str(tmp_path), steps=2)
    assert s["sequences"] == {"kernel_mosaic_gpu_kernel": [6.0, 52.0, 9.0, 305.0]}  # loop_add: once per step
    params = {"layers": ({"qkv": None, "o": None, "gate_up": None, "down": None},)}
    profile = dict(s, sequences={"kernel_mosaic_gpu_kernel": [6.0, 8.0, 52.0, 9.0, 305.0]})
    bench_ar.mosaic_calls(profile, params, "fused@w12")
    assert profile["mosaic_calls"]["gate_up"] == {"calls": 1, "us_median": 52.0, "us_per_step": 52.0}
    assert list(profile["mosaic_calls"]) == ["qkv", "o", "gate_up", "down", "lm_head"]
    bench_ar.mosaic_calls(s, params, "fused@w12")  # 4 calls for 5 matrices (one kept bf16): no breakdown
    assert "mosaic_calls" not in s
    assert bench_.label_calls([1.0, 2.0, 3.0], ["a", "b", "a"]) == {
        "a": {"calls": 2, "us_median": 2.0, "us_per_step": 4.0},
        "b": {"calls": 1, "us_median": 2.0, "us_per_step": 2.0}}


@pytest.mark.slow  # about 90 s in the interpreter; twin_params' bits: test_w12_mosaic
def test_bench_ar_tiled_twin_rows(bench_ar, tmp_path):
    """--weights ...,twin: the bf16 weights tiled once for the Mosaic kernel's twin (`w12.TwinNK`) give a bf16
    row with W12's kernel structure; the @w12 row equals it bit for bit, as it equals the per-call twin
    (interpret mode on the CPU). The format needs --w12-kernel mosaic."""
    rec = bench_ar.main(["--shape", "tiny-mosaic", "--w12-kernel", "mosaic", "--weights", "bf16,w12,twin",
                         "--gen-repeats", "1", "--variants", "fused", "--context", "8", "--new-tokens", "3",
                         "--warmup", "1", "--copy-gib", "0.01", "--out", str(tmp_path / "r.json")])
    assert list(rec["variants"]) == ["fused", "fused_twin", "fused@twin", "fused@w12"]
    for name, v in rec["variants"].items():
        assert "error" not in v, (name, v.get("error"))
    assert rec["variants"]["fused@twin"]["weights"] == "twin"
    assert rec["variants"]["fused@twin"]["step_bytes_total"] == rec["step_bytes"]["total"]  # bf16 bytes
    w12_row = rec["variants"]["fused@w12"]
    for key, twin in (("vs_twin", "fused_twin"), ("vs_tiled_twin", "fused@twin")):
        assert w12_row[key]["twin"] == twin and w12_row[key]["exact"] and w12_row[key]["first_logits_bit_equal"]
    with pytest.raises(SystemExit):
        bench_ar.parse_args(["--weights", "bf16,twin"])  # the twin's tiles are the Mosaic kernel's


def test_bench_ar_l2_prefetch_rows(bench_ar):
    """--l2-prefetch sets ar_variants.PREFETCH for a run; with --l2-prefetch-ab every non-stock row runs
    without and then with it (NAME+l2), each +l2 row compared bit for bit with the row without; bad specs
    are refused."""
    assert bench_ar.parse_prefetch("o,gate_up=0.25/512,qkv=0.5") == {"o": (1.0, 1), "gate_up": (0.25, 512),
                                                                      "qkv": (0.5, 1)}
    for bad in ("attn", "o=2", "o=0.5/0", "o=x"):
        with pytest.raises(ValueError, match="--l2-prefetch"):
            bench_ar.parse_prefetch(bad)
    with pytest.raises(SystemExit):
        bench_ar.parse_args(["--l2-prefetch-ab"])
    rec = bench_ar.main(["--shape", "tiny", "--context", "8", "--new-tokens", "3", "--warmup", "1",
                         "--copy-gib", "0.01", "--variants", "stock,fused", "--l2-prefetch", "o,gate_up=0.5,qkv",
                         "--l2-prefetch-ab"])
    assert list(rec["variants"]) == ["stock", "fused", "fused+l2"]
    for v in rec["variants"].values():  # generation: 5 passes by default, the row's figure their median
        assert len(v["gen_ms_per_token_passes"]) == 5 == rec["gen_repeats"]
        assert v["gen_ms_per_token"] == np.median(v["gen_ms_per_token_passes"])
    row = rec["variants"]["fused+l2"]
    assert row["l2_prefetch"] == {"o": [1.0, 1], "gate_up": [0.5, 1], "qkv": [1.0, 1]}
    assert rec["variants"]["fused"]["l2_prefetch"] == {}
    assert row["vs_no_prefetch"]["twin"] == "fused" and row["vs_no_prefetch"]["exact"]
    bench_ar.parse_args(["--l2-prefetch", "down"])  # each run sets it
    assert bench_ar.ar_variants.PREFETCH == {"down": (1.0, 1)}
    bench_ar.parse_args([])
    assert bench_ar.ar_variants.PREFETCH == {}


def test_bench_ar_qkv_barrier_keeps_the_tokens(bench_ar):
    """--qkv-barrier materializes the fused qkv product (a scheduling change only): same greedy tokens."""
    rec = bench_ar.main(["--shape", "tiny", "--context", "8", "--new-tokens", "4", "--warmup", "1",
                         "--copy-gib", "0.01", "--variants", "stock,fused", "--qkv-barrier",
                         "--barrier-after", "o,down"])
    assert rec["qkv_barrier"] and bench_ar.ar_variants.QKV_BARRIER
    assert rec["barrier_after"] == ["o", "down"] == list(bench_ar.ar_variants.BARRIER_AFTER)
    assert rec["variants"]["fused"]["token_match_frac"] == 1.0
    bench_ar.parse_args([])  # each run sets the flags: off again without them
    assert not bench_ar.ar_variants.QKV_BARRIER and not bench_ar.ar_variants.BARRIER_AFTER
    with pytest.raises(SystemExit):
        bench_ar.parse_args(["--barrier-after", "qkv"])


def test_bench_ar_mosaic_x_flags(bench_ar, monkeypatch):
    """--w12-pad-x, --w12-mp, --w12-sum-in-kernel, --w12-tiled, --w12-early-base, --w12-wide-swizzle and
    --w12-plain-planes set
    the Mosaic kernel's options for a run; bad values are refused."""
    from pallas_kernels import w12_mosaic

    monkeypatch.setattr(w12_mosaic, "PAD_X", True)
    monkeypatch.setattr(w12_mosaic, "MP_CHOICES", w12_mosaic.MP_CHOICES)
    for bad in (["--w12-pad-x", "off"], ["--w12-kernel", "mosaic", "--w12-mp", "8,16"],
                ["--w12-kernel", "mosaic", "--w12-mp", "12,64"]):
        with pytest.raises(SystemExit):
            bench_ar.parse_args(bad)
    monkeypatch.setattr(w12_mosaic, "SUM_SPLITS_IN_KERNEL", False)
    with pytest.raises(SystemExit):
        bench_ar.parse_args(["--w12-sum-in-kernel", "on"])
    for attr in ("TILED", "EARLY_BASE", "WIDE_SWIZZLE", "PLAIN_PLANES"):
        monkeypatch.setattr(w12_mosaic, attr, False)
    args = bench_ar.parse_args(["--w12-kernel", "mosaic", "--w12-pad-x", "off", "--w12-mp", "64,8,16",
                                "--w12-sum-in-kernel", "on", "--w12-tiled", "on", "--w12-early-base", "on",
                                "--w12-wide-swizzle", "on", "--w12-plain-planes", "on"])
    assert w12_mosaic.PAD_X is False and w12_mosaic.MP_CHOICES == (8, 16, 64) and w12_mosaic.SUM_SPLITS_IN_KERNEL
    assert w12_mosaic.TILED and w12_mosaic.EARLY_BASE and w12_mosaic.WIDE_SWIZZLE and args.w12_wide_swizzle == "on"
    assert w12_mosaic.PLAIN_PLANES and args.w12_plain_planes == "on"
    # the numeric switches: refused without the Mosaic kernel or out of range, else set, and part of the trace key
    for flag, attr, before, bad, good in (("--w12-small-m-stages", "SMALL_M_STAGES", 3, "5", 2),
                                          ("--w12-prefetch-slots", "PREFETCH_SLOTS", 0, "32", 2),
                                          ("--w12-copy-steps", "COPY_STEPS", 1, "9", 2)):
        monkeypatch.setattr(w12_mosaic, attr, before)
        for argv in ([flag, str(good)], ["--w12-kernel", "mosaic", flag, bad]):
            with pytest.raises(SystemExit):
                bench_ar.parse_args(argv)
        assert getattr(w12_mosaic, attr) == before
        key = w12_mosaic.knobs()
        bench_ar.parse_args(["--w12-kernel", "mosaic", flag, str(good)])
        assert getattr(w12_mosaic, attr) == good
        assert w12_mosaic.knobs() != key  # a product traced before is not reused
    assert w12_mosaic.default_stages(64, 16) == 2  # SMALL_M_STAGES = 2 from the loop above
    assert w12_mosaic.default_stages(64, 32) == 2 and w12_mosaic.default_stages(128, 16) == 2


def _ncu_csv(path, kernels):
    """A minimal ncu `--csv --page details` export: kernels [(name, duration_us)], one metric row each."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["ID", "Kernel Name", "Grid Size", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
        for i, (name, us) in enumerate(kernels):
            w.writerow([i, name, "(1, 1, 1)", "GPU Speed Of Light Throughput", "Duration", "us", f"{us:,}"])
            w.writerow([i, name, "(1, 1, 1)", "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "50"])


def test_ncu_table_assigns_kernels_to_calls(tmp_path):
    """`ncu_w12.py --table`: XLA's call is what precedes W12's x preparation, W12's call its prep, Mosaic
    kernel and split sum, the twin's the rest up to its split sum; durations add up per call."""
    ncu = _load("ncu_w12")
    order = [dict(shape="o", m=1, call=c) for c in ("xla", "w12", "twin")]
    order += [dict(shape="k/v", m=1, call=c) for c in ("xla", "w12", "twin")]
    kernels = [("gemm_fusion_dot", 13.0), ("loop_reduce_fusion", 3.0),  # o: xla
               ("loop_transpose_fusion", 2.5), ("kernel_mosaic_gpu_kernel", 10.0), ("loop_slice_fusion", 2.0),
               ("loop_transpose_fusion", 2.0), ("input_transpose_fusion", 1000.5),  # twin: x prep, tiling
               ("kernel_mosaic_gpu_kernel", 11.0), ("loop_slice_fusion", 2.0),
               ("loop_multiply_fusion", 8.0), ("input_reduce_fusion", 12.0),  # k/v: xla
               ("loop_transpose_fusion", 2.0), ("kernel_mosaic_gpu_kernel", 5.0), ("loop_slice_fusion", 3.0),
               ("input_transpose_fusion", 6.0), ("kernel_mosaic_gpu_kernel", 4.0), ("loop_slice_fusion", 3.0)]
    path = tmp_path / "details.csv"
    _ncu_csv(path, kernels)
    rows = ncu.table(ncu.read_details(str(path)), order)
    got = [(r["shape"], r["call"], r["kernel"], r["us"], r["all_kernels_us"]) for r in rows]
    assert got == [("o", "xla", "gemm_fusion_dot", 13.0, 16.0),
                   ("o", "w12", "kernel_mosaic_gpu_kernel", 10.0, 14.5),
                   ("o", "twin", "kernel_mosaic_gpu_kernel", 11.0, 1015.5),
                   ("k/v", "xla", "input_reduce_fusion", 12.0, 20.0),
                   ("k/v", "w12", "kernel_mosaic_gpu_kernel", 5.0, 10.0),
                   ("k/v", "twin", "kernel_mosaic_gpu_kernel", 4.0, 13.0)]
    assert all(r["dram_pct"] == 50.0 for r in rows)
    _ncu_csv(path, kernels[:-1])  # the last call's split sum missing: the kernels no longer fit the calls
    with pytest.raises(ValueError, match="no kernel after the twin"):
        ncu.table(ncu.read_details(str(path)), order)
    _ncu_csv(path, kernels[2:])  # the first case has no XLA kernel
    with pytest.raises(ValueError, match="no kernel for XLA"):
        ncu.table(ncu.read_details(str(path)), order)


def _source_csv(path, kernels):
    """ncu's `--page source --csv --print-source sass` layout: per kernel a name line, a header, then one row
    per instruction (address, SASS, samples, executed count, stall columns)."""
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_wait", "stall_long_sb (Not Issued)"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for instrs in kernels:
            w.writerow(["Kernel Name", "kernel_mosaic_gpu_kernel", ""])
            w.writerow(cols)
            for q, (sass, executed, long_sb, wait) in enumerate(instrs):
                w.writerow([f"0x{16 * q:x}", sass, long_sb + wait, executed, long_sb, wait, 0])


def test_ncu_source_summary(tmp_path):
    """`ncu_w12.py --source`: warps from the prologue's count, steps from the loop body's, the copies' wait
    (the try-wait and its branch) apart from the body, the code run at some steps and once per warp."""
    ncu = _load("ncu_w12")
    warps, steps = 8, 4
    body = warps * steps
    instrs = [("MOV R1, R2", warps, 0, 1),  # prologue
              ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9], R0", body, 0, 1), ("@!P0 BRA 0x10", body, 30, 0),
              ("LDS R0, [R1]", body, 4, 2), ("PRMT R3, R0, 0x1010, RZ", body, 0, 3),
              ("HGMMA.64x8x16.F32.BF16 R24, R28, gdesc[UR16], R24", body, 0, 5),
              ("WARPGROUP.DEPBAR.LE gsb0, 0x0", body, 0, 2),
              ("LOP3.LUT R4, R4, R5, R6, 0xd8, !PT", 6, 1, 1),  # a patch, at some steps
              ("UTMALDG.2D [UR16], [UR26]", warps * (steps - 2), 0, 1),  # copies issued ahead
              ("STG.E [R2], R24", warps, 2, 0)]  # epilogue
    path = tmp_path / "source.csv"
    _source_csv(path, [instrs, instrs[:3] + instrs[5:7] + instrs[-1:]])
    kernels = ncu.read_source(str(path))
    assert [len(k) for k in kernels] == [10, 6]
    s = ncu.source_summary(kernels[0])
    assert (s["warps"], s["steps"], s["body_per_step"]) == (warps, steps, 6)
    assert s["per_step_loop"] == 6 and s["once"] == 2
    assert abs(s["per_step_sometimes"] - (6 + warps * (steps - 2)) / body) < 1e-9
    total = 1 + 1 + 30 + 6 + 3 + 5 + 2 + 2 + 1 + 2
    assert s["share"]["copy_wait"] == round(31 / total, 4)
    assert s["share"]["wgmma"] == round(7 / total, 4) and s["share"]["body"] == round(9 / total, 4)
    assert s["share"]["once"] == round(3 / total, 4) and s["share"]["sometimes"] == round(3 / total, 4)
    assert abs(s["stalls"]["long_sb"] - 37 / total) < 1e-9  # "Not Issued" columns are not counted twice
    with pytest.raises(ValueError, match="not an ncu --page source export"):
        (tmp_path / "other.csv").write_text("ID,Kernel Name\n1,x\n")
        ncu.read_source(str(tmp_path / "other.csv"))
