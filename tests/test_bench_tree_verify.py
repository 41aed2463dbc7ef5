"""experiments/bench/bench_tree_verify.py --smoke: a row per (shape, nodes, implementation), the kernel rows
checked against the xla rows on the device, and the real shapes' configs as the harness builds them."""

import csv
import importlib.util
from pathlib import Path

import pytest

from specpilot.models.config import ModelConfig
from specpilot.models.hybrid_config import HybridConfig

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tree_verify", ROOT / "experiments" / "bench" / "bench_tree_verify.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_smoke_writes_checked_rows(tmp_path):
    out = tmp_path / "tree.csv"
    _bench().main(["--smoke", "--out", str(out)])
    rows = list(csv.DictReader(out.open()))
    assert [(r["shape"], r["nodes"], r["impl"]) for r in rows] == [
        ("tiny_dense", "8", "xla"), ("tiny_dense", "8", "triton"),
        ("tiny_hybrid", "8", "xla"), ("tiny_hybrid", "8", "triton")]
    for r in rows:
        assert float(r["ms_median"]) > 0 and r["layers"] == "2" and r["context"] == "24"
    for r in rows[1::2]:  # float32 models: the kernel's logits are the reference's to rounding
        assert "tree_attention" in r["ops"].split("+")
        assert ("tree_gated_delta_rule" in r["ops"]) == (r["shape"] == "tiny_hybrid")
        assert float(r["max_abs_diff_logits"]) < 1e-4 and float(r["argmax_agree"]) == 1.0


def test_real_shapes_and_argument_errors():
    bench = _bench()
    cfg, _ = bench.load_shape("qwen3_8b", None, "bfloat16")
    assert isinstance(cfg, ModelConfig) and (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        36, 32, 8, 128) and cfg.qk_norm
    cfg, _ = bench.load_shape("qwen3_5_27b", 16, "bfloat16")
    assert isinstance(cfg, HybridConfig) and cfg.num_layers == 16 and cfg.head_dim == 256
    assert cfg.layer_types.count("full_attention") == 4  # the 3:1 pattern survives truncation
    with pytest.raises(SystemExit):
        bench.parse(["--shapes", "qwen3_9b"])
    with pytest.raises(SystemExit):
        bench.parse(["--context", "2000", "--cache-len", "2048", "--nodes", "64"])
    with pytest.raises(SystemExit):
        bench.parse(["--config", "tree_attention.block_v=2"])  # not a setting of that kernel
    assert bench.parse(["--config", "tree_attention.splits=16"]).configs == {"tree_attention": {"splits": 16}}
    # one op alone: the dense target has no recurrence, so it runs no kernel for it
    dense_cfg, _ = bench.load_shape("tiny_dense", 2, "float32")
    hybrid_cfg, _ = bench.load_shape("tiny_hybrid", 2, "float32")
    assert bench.kernel_ops(dense_cfg, "tree_gated_delta_rule") == ()
    assert bench.kernel_ops(hybrid_cfg, "triton") == ("tree_attention", "tree_gated_delta_rule")
