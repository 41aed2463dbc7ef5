"""Smoke tests of the benchmark scripts on tiny shapes (CPU, seconds): the records have sane fields, the W12
rows equal the rows that must give their bits, and the shared arguments parse and refuse the same way.

No timing thresholds: CPU timings say nothing about the GPU and would make the test flaky.
"""

import gzip
import importlib.util
import json
import math
import os

import pytest

from pallas_kernels import dispatch
from pallas_kernels import w12_mosaic as mk
from specpilot.harness import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench_ar():
    return _load("bench_ar")


@pytest.fixture(scope="module")
def bench_w12():
    return _load("bench_w12")


TINY_AR = ["--shape", "tiny", "--context", "8", "--new-tokens", "4", "--warmup", "1", "--copy-gib", "0.01"]


def test_bench_ar_tiny_record(bench_ar, tmp_path):
    out = tmp_path / "r.json"
    rec = bench_ar.main(TINY_AR + ["--variants", "stock", "--out", str(out)])
    assert out.is_file() and json.loads(out.read_text())["shape"] == "tiny"
    assert rec["shape"] == "tiny" and rec["batch"] == 1 and rec["new_tokens"] == 4 and rec["trials"] == 5
    assert rec["copy"]["bw"] > 0 and rec["floor_ms"] > 0 and rec["prefill_ms"] > 0
    sb = rec["step_bytes"]
    assert sb["total"] == sb["weights"] + sb["embed_rows"] + sb["kv_read"] + sb["kv_write"] + sb["logits"]
    v = rec["variants"]["stock"]
    assert "error" not in v, v.get("error")
    assert v["n"] == 4 and 0 < v["p10_ms"] <= v["median_ms"] <= v["p90_ms"]
    assert len(v["gen_ms_per_token_passes"]) == 5
    assert v["gen_ms_per_token"] > 0 and math.isclose(v["tokens_per_s"], 1e3 / v["gen_ms_per_token"])
    assert v["pct_copy_bw"] > 0 and v["first_logits_finite"] and v["token_match_frac"] == 1.0


@pytest.mark.slow
def test_bench_ar_tiny_variants_agree(bench_ar):
    rec = bench_ar.main(TINY_AR + ["--variants", "stock,replica,fused,fused_nk,stock_fori"])
    for name, v in rec["variants"].items():
        assert "error" not in v, (name, v.get("error"))
        # Same function of the same weights: greedy tokens agree with stock's.
        assert v["token_match_frac"] == 1.0, name
        if "first_logits_rel_err_vs_ref" in v:
            assert v["first_logits_rel_err_vs_ref"] < 1e-2, name


def test_step_bytes_qwen3_8b(bench_ar):
    cfg = bench_ar.SHAPES["qwen3-8b"]
    sb = bench.step_bytes(cfg, batch=1, cache_len=768)
    # 36 layers of q/k/v/o + SwiGLU matrices and the LM head: 15.14 GB of bf16 (norms add ~0.6 MB).
    assert abs(sb["weights"] / 1e9 - 15.14) < 0.01
    assert sb["kv_read"] == 2 * 36 * 768 * 8 * 128 * 2
    assert sb["embed_rows"] == 4096 * 2 and sb["logits"] == 151936 * 4


@pytest.mark.slow
def test_bench_ar_tiny_w12_rows(bench_ar, tmp_path):
    """bf16 vs W12 at batch 1 with `--kernel xla` (decode + XLA's dot): each @w12 row gives its bf16 row's
    logits and tokens bit for bit, and its bandwidth counts the W12 bytes."""
    rec = bench_ar.main(TINY_AR + ["--kernel", "xla", "--weights", "bf16,w12", "--variants", "stock,fused",
                                   "--trials", "2", "--out", str(tmp_path / "r.json")])
    assert list(rec["variants"]) == ["stock", "fused", "stock@w12", "fused@w12"]
    for name, v in rec["variants"].items():
        assert "error" not in v, (name, v.get("error"))
        assert v["gen_ms_per_token"] > 0 and v["median_ms"] > 0
    for name in ("stock", "fused"):
        row = rec["variants"][f"{name}@w12"]
        assert row["weights"] == "w12" and row["vs_bf16"]["twin"] == name
        assert row["vs_bf16"]["exact"] and row["vs_bf16"]["first_logits_bit_equal"]
    e = rec["w12"]
    assert e["matrices"] == 2 * 7 + 1 and not e["kept_bf16"] and e["encode_s"] > 0 and e["layout"] == ["W12"]
    assert 12.0 < e["bits_per_weight"] < 12.5  # K = 64: the per-column base byte is 0.125 bits
    sb, sw = rec["step_bytes"], rec["step_bytes_w12"]
    assert sw["total"] - sb["total"] == e["bytes"] - e["bf16_bytes_replaced"] < 0
    assert rec["variants"]["stock@w12"]["step_bytes_total"] == sw["total"]
    assert rec["kernel"] == ["xla"] and rec["kernel_config"] == {}


@pytest.mark.slow  # about 90 s in the interpreter
def test_bench_ar_tiled_twin_rows(bench_ar, tmp_path):
    """--weights ...,twin with --kernel mosaic: the bf16 weights tiled once for the Mosaic kernel's twin give
    a bf16 row with W12's kernel structure, and the @w12 row equals it bit for bit (interpreter on the CPU);
    the settings of --kernel-config are recorded. The twin layout needs the Mosaic kernel."""
    rec = bench_ar.main(["--shape", "tiny-mosaic", "--kernel", "mosaic,xla", "--kernel-config",
                         '{"small_m_stages": 3}', "--weights", "bf16,w12,twin", "--trials", "1", "--variants",
                         "stock,fused", "--context", "8", "--new-tokens", "3", "--warmup", "1", "--copy-gib",
                         "0.01", "--out", str(tmp_path / "r.json")])
    assert list(rec["variants"]) == ["stock", "fused", "stock@twin", "fused@twin", "stock@w12", "fused@w12"]
    for name, v in rec["variants"].items():
        assert "error" not in v, (name, v.get("error"))
    assert rec["kernel_config"]["small_m_stages"] == 3 and rec["w12"]["layout"] == ["W12NK"]
    assert rec["variants"]["fused@twin"]["step_bytes_total"] == rec["step_bytes"]["total"]  # bf16 bytes
    for name in ("stock", "fused"):
        row = rec["variants"][f"{name}@w12"]["vs_twin"]
        assert row["twin"] == f"{name}@twin" and row["exact"] and row["first_logits_bit_equal"]
    with pytest.raises(SystemExit):
        bench_ar.parse_args(["--kernel", "xla", "--weights", "bf16,twin"])  # the twin's tiles are Mosaic's


def test_shared_arguments_parse_and_refuse(bench_ar, bench_w12):
    """The scripts' shared flags: the kernel choice is the OpChoice a plan with those values holds; bad
    values are refused with the flag named (argparse exits)."""
    args = bench_ar.parse_args(["--kernel", "mosaic,xla", "--kernel-config", '{"mp_choices": [8, 16, 64]}',
                                "--m", "2", "--profile", "fused,stock"])
    assert args.choice == dispatch.OpChoice(("mosaic", "xla"), mk.W12MosaicConfig(mp_choices=(8, 16, 64)))
    assert args.batch == 2 and args.profile == ["fused", "stock"]
    for bad in (["--kernel", "cuda"], ["--kernel-config", '{"block_k": 64}'], ["--kernel-config", "[1]"],
                ["--kernel-config", "{bad"], ["--m", "1,2"], ["--m", "0"], ["--trials", "0"], ["--shape", "huge"],
                ["--weights", "int4"]):
        with pytest.raises(SystemExit):
            bench_ar.parse_args(bad)
    with pytest.raises(SystemExit):
        bench_w12.main(["--shape", "128x"])


def test_kernel_summary_reads_a_perfetto_trace(tmp_path):
    """`bench.kernel_summary` on a hand-written Perfetto trace: only the device's stream events count, per
    step; busy is their summed duration, span first start to last end, and each kernel's per-call
    min/median/max come from its own events."""
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
        json.dump({"traceEvents": meta + kernels + host}, f)
    s = bench.kernel_summary(str(tmp_path), steps=2)
    assert s["kernels_per_step"] == 2.0
    assert abs(s["busy_ms_per_step"] - 35e-3) < 1e-9 and abs(s["span_ms_per_step"] - 50e-3) < 1e-9
    top = s["top"][0]
    assert top["name"] == "w12_kernel" and (top["us_min"], top["us_median"], top["us_max"]) == (10.0, 20.0, 30.0)
    assert bench.kernel_summary(str(tmp_path / "none"), steps=1) is None


def test_kernel_summary_window_keeps_kernels_inside_host_spans(tmp_path):
    """`window=` keeps only the device kernels that start inside a host span of that name (two "accept"
    spans here: kernels at 5 and 105 count, the one at 50 and the one just past the second span's end do
    not), and reports the spans' wall time per step and their count."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(Compute)"}}]
    kernels = [{"ph": "X", "pid": 1, "tid": 7, "name": n, "ts": t, "dur": 4.0}
               for n, t in (("argmax", 5), ("matmul", 50), ("argmax", 105), ("late", 121))]
    spans = [{"ph": "X", "pid": 2, "tid": 1, "name": "specpilot.accept", "ts": t, "dur": 20.0} for t in (0, 100)]
    spans.append({"ph": "X", "pid": 2, "tid": 1, "name": "specpilot.verify", "ts": 40, "dur": 30.0})
    d = tmp_path / "plugins" / "profile"
    d.mkdir(parents=True)
    with gzip.open(d / "x.perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + kernels + spans}, f)
    s = bench.kernel_summary(str(tmp_path), steps=2, window="specpilot.accept")
    assert s["spans"] == 2 and s["kernels_per_step"] == 1.0 and [t["name"] for t in s["top"]] == ["argmax"]
    assert abs(s["window_ms_per_step"] - 20e-3) < 1e-9 and abs(s["busy_ms_per_step"] - 4e-3) < 1e-9
    v = bench.kernel_summary(str(tmp_path), steps=1, window="specpilot.verify")
    assert [t["name"] for t in v["top"]] == ["matmul"]
    assert bench.kernel_summary(str(tmp_path), steps=1, window="absent")["kernels"] == 0


def test_kernel_summary_times_each_call_of_a_step(tmp_path, bench_ar):
    """A kernel called several times per step gets its median time at each call of the step ("sequences",
    over the steps), and `mosaic_calls` names those calls by the matrices a step multiplies, in order; a
    count that does not match the matrices gives no breakdown."""
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
        json.dump({"traceEvents": meta + events}, f)
    s = bench.kernel_summary(str(tmp_path), steps=2)
    assert s["sequences"] == {"kernel_mosaic_gpu_kernel": [6.0, 52.0, 9.0, 305.0]}  # loop_add: once per step
    params = {"layers": ({"qkv": None, "o": None, "gate_up": None, "down": None},)}
    profile = dict(s, sequences={"kernel_mosaic_gpu_kernel": [6.0, 8.0, 52.0, 9.0, 305.0]})
    bench_ar.mosaic_calls(profile, params, "fused@w12")
    assert profile["mosaic_calls"]["gate_up"] == {"calls": 1, "us_median": 52.0, "us_per_step": 52.0}
    assert list(profile["mosaic_calls"]) == ["qkv", "o", "gate_up", "down", "lm_head"]
    bench_ar.mosaic_calls(s, params, "fused@w12")  # 4 calls for 5 matrices (one kept bf16): no breakdown
    assert "mosaic_calls" not in s
    assert bench.label_calls([1.0, 2.0, 3.0], ["a", "b", "a"]) == {
        "a": {"calls": 2, "us_median": 2.0, "us_per_step": 4.0},
        "b": {"calls": 1, "us_median": 2.0, "us_per_step": 2.0}}


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_bench_w12_tiny_smoke(bench_w12, tmp_path):
    """`bench_w12.py --shape tiny`: XLA's dot, the Mosaic and Triton kernels' twins and W12 rows (interpreters
    on the CPU), every W12 row equal to its twin bit for bit and every row close to XLA's product."""
    out = tmp_path / "w12.json"
    record = bench_w12.main(["--shape", "tiny", "--m", "1", "--kernel", "mosaic,triton", "--out", str(out)])
    assert out.exists() and {r["impl"] for r in record["rows"]} == {
        "xla_bf16", "twin_mosaic", "w12_mosaic", "twin_triton", "w12_triton"}
    for r in record["rows"]:
        assert "error" not in r, r
        assert r["rel_err_vs_xla"] <= bench_w12.REL_ERR_VS_XLA_MAX and "wrong_vs_xla" not in r
    assert all(r["bit_exact"] for r in record["rows"] if r["impl"].startswith("w12"))
    assert next(r for r in record["rows"] if r["impl"] == "w12_mosaic")["layout"] == "W12NK"


def test_bench_w12_other_shapes(bench_w12):
    """`--shape KxN,...` times those shapes instead of Qwen3-8B's; a shape the kernel does not tile leaves
    its rows out and is reported."""
    record = bench_w12.main(["--shape", "128x64,256x96", "--m", "1", "--reps", "1", "--trials", "1",
                             "--min-bytes", "0", "--kernel", "xla"])
    assert [(r["shape"], r["k"], r["n"], r["impl"]) for r in record["rows"]] == [
        ("128x64", 128, 64, "xla_bf16"), ("256x96", 256, 96, "xla_bf16")]


def test_bench_w12_profile_table(bench_w12, tmp_path):
    """`--table`: rows from recorded profiles, the ratio taken against the faster bf16 path."""
    def row(impl, wall, busy, kern, shape="q/o"):
        return {"shape": shape, "m": 1, "impl": impl, "us_per_matrix": wall,
                "profile": {"busy_ms_per_step": busy / 1e3, "top": [{"us_median": kern}]}}

    rec = {"rows": [row("xla_bf16", 16.0, 15.0, 12.0), row("twin_mosaic", 15.0, 14.0, 10.0),
                    row("w12_mosaic", 30.0, 14.0, 8.0),
                    {"shape": "q/o", "m": 4, "impl": "xla_bf16", "us_per_matrix": 1.0}]}
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(rec))
    table = bench_w12.main(["--table", str(path)])["table"]
    assert table[2:] == ["| q/o | 1 | 16.0 / 15.0 / 30.0 | 15.0 / 14.0 / 14.0 | 12.0 / 10.0 / 8.0 | 1.00x | 1.25x |"]
    other = [row(r["impl"], r["us_per_matrix"], 1.0, 1.0, "4096x24576") for r in rec["rows"][:3]]
    path.write_text(json.dumps({"rows": other + rec["rows"][:3]}))  # Qwen3-8B's shapes first, then others
    assert [line.split(" | ")[0] for line in bench_w12.profile_table([str(path)])[2:]] == ["| q/o", "| 4096x24576"]


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_bench_spec_loops_smoke():
    rows = _load("bench_spec_loops").main(["--m", "1", "--blocks", "4", "--new-tokens", "8", "--trials", "1"])
    assert {r["drafter"] for r in rows} == {"oracle", "mixed", "random"}
    assert all(r["ar_s_per_token"] > 0 and r["while_s_per_token"] > 0 for r in rows)
