"""Smoke test of the AR benchmark on the tiny shape (CPU, seconds): the record has sane fields.

No timing thresholds: CPU timings say nothing about the GPU and would make the test flaky.
"""

import importlib.util
import math
import os
import sys

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
