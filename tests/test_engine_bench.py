"""experiments/bench_engine.py --smoke: the Poisson workload runs end to end on the tiny random pair."""

import importlib.util
from pathlib import Path


def _load():
    path = Path(__file__).resolve().parent.parent / "experiments" / "bench_engine.py"
    spec = importlib.util.spec_from_file_location("bench_engine", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_engine_smoke(tmp_path):
    out = tmp_path / "engine.json"
    record = _load().main(["--smoke", "--out", str(out)])
    assert out.is_file() and {r["plan"] for r in record["rows"]} == {"ar", "stock"}
    for r in record["rows"]:
        assert r["output_tokens"] > r["requests"]  # every request emits at least one token, most more
        assert r["throughput_tok_s"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
        assert r["tpot_p50_s"] <= r["tpot_p99_s"] and 1 <= r["slots_in_use_max"] <= r["slots"]
        assert 0 < r["kv_tokens_max"] <= r["kv_tokens_capacity"]
