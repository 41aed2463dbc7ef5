"""What a run leaves behind and shows while it works: summary.md, run.log, progress, spreads and the
noisy-machine warning."""

import io
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from specpilot.harness import config_schema, progress, runner, spread

ROOT = Path(__file__).resolve().parents[1]
TINY = ("target=tiny_random", "drafter=none", "decoding=ar", "bench=default")


def test_a_run_keeps_its_table_and_its_log(tmp_path):
    hydra_dir = tmp_path / "hydra"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *TINY, "bench.num_prompts=2",
                           "bench.new_tokens=8", "bench.repeats=3", f"hydra.run.dir={hydra_dir}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((hydra_dir / "results.jsonl").read_text().splitlines()[0])
    # three repeats: the spread is over the two after the warm-up
    assert rec["spread"]["over"] == "repeats" and rec["spread"]["n"] == 2
    assert rec["spread"]["min_ms"] <= rec["decode_ms_per_token"] <= rec["spread"]["max_ms"]

    summary = (hydra_dir / "summary.md").read_text()
    assert summary.startswith("# tiny_random + drafter none on cpu")
    header = next(line for line in summary.splitlines() if line.startswith("| plan |"))
    assert "| ms/token | spread |" in header
    row = next(line for line in summary.splitlines() if line.startswith("| ar |"))
    assert f"| {rec['decode_ms_per_token']:.3f} |" in row and "| 1.00x |" in row
    # the dense format names the target's dtype: this target keeps float32 weights, not bf16
    assert rec["weights"] == "bf16" and rec["dtype"] == "float32" and "| f32 |" in row and "| bf16 |" not in row
    assert "- note: random weights" in summary

    log = (hydra_dir / "run.log").read_text()
    # progress lines, each phase with its time, then the table and notes the run printed
    assert "building the deployment: target tiny_random, drafter none in " in log
    assert "ar: 3 timed runs of 2 batches in " in log and "ar: run 3/3 in" in log
    printed_table = proc.stdout[proc.stdout.index("plan "):proc.stdout.index("results: ")].strip()
    assert printed_table and printed_table in log


def test_a_run_with_its_own_output_dir_logs_there(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *TINY, "bench.num_prompts=1",
                           "bench.new_tokens=4", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (out / "run.log").read_text()
    assert log.count("building the deployment: target tiny_random, drafter none in ") == 1
    assert "speedup over AR" in log and (out / "summary.md").is_file()


def test_spread_leaves_out_the_warm_up_and_falls_back_to_batches():
    s = spread.timing_spread([5.0, 1.0, 1.2, 1.1], [])
    assert s["over"] == "repeats" and s["n"] == 3 and s["range"] == pytest.approx(0.2 / 1.1)
    two = spread.timing_spread([2.0, 1.0], [])
    assert two["n"] == 2 and two["range"] == pytest.approx(1.0 / 1.5)
    batches = spread.timing_spread([1.0], [(0.10, 10), (0.12, 10), (0.0, 0)])
    assert batches["over"] == "batches" and batches["n"] == 2
    assert batches["range"] == pytest.approx(0.002 / 0.011)
    assert spread.timing_spread([1.0], [(0.1, 10)]) is None
    assert spread.format_spread(None) == "-" and spread.format_spread(s) == "18%"


def test_noisy_machine_warning_names_the_spread_and_the_speedups_it_hides():
    quiet = {"over": "repeats", "n": 4, "range": 0.08}
    assert spread.noise_warning(quiet) is None and spread.noise_warning(None) is None
    noisy = {"over": "repeats", "n": 4, "range": 0.25}
    assert spread.noise_warning(noisy) == ("noisy machine: AR timings spread 25% over 4 repeats (more than 10%); "
                                           "speedups below 1.25x are within noise")
    assert "over 3 batches" in spread.noise_warning({"over": "batches", "n": 3, "range": 0.5})


def test_phase_logs_its_start_heartbeat_and_time_when_not_a_terminal(monkeypatch, caplog):
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    stream = io.StringIO()  # not a terminal: no bar
    logger = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        with progress.phase("building", total=2, logger=logger, stream=stream) as ph:
            ph.advance()
            time.sleep(0.2)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "building ..."
    assert any(m.startswith("building: still running (") and m.endswith(", 1/2)") for m in messages[1:-1])
    assert messages[-1].startswith("building in ") and messages[-1].endswith(" s")
    assert stream.getvalue() == ""


def test_phase_draws_a_bar_when_forced(monkeypatch, caplog):
    monkeypatch.setenv(progress.ENV, "1")
    stream = io.StringIO()
    logger = logging.getLogger("test.progress.bar")
    with caplog.at_level(logging.INFO, logger="test.progress.bar"):
        with progress.phase("stock: 1 timed run of 2 batches", total=2, logger=logger, stream=stream) as ph:
            ph.advance(1, "0.50 ms/token")
            ph.advance(1, "0.40 ms/token")
    drawn = stream.getvalue()
    assert "stock: 1 timed run of 2 batches" in drawn and "2/2" in drawn and "0.40 ms/token" in drawn
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["stock: 1 timed run of 2 batches"]
    monkeypatch.setenv(progress.ENV, "0")
    assert not progress.bars_enabled(stream)


def test_phase_that_raises_logs_no_time(monkeypatch, caplog):
    monkeypatch.delenv(progress.ENV, raising=False)
    logger = logging.getLogger("test.progress.fail")
    with caplog.at_level(logging.INFO, logger="test.progress.fail"), pytest.raises(RuntimeError):
        with progress.phase("forcing", logger=logger, stream=io.StringIO()):
            raise RuntimeError("boom")
    assert [r.getMessage() for r in caplog.records] == ["forcing ..."]


def test_a_noisy_ar_baseline_is_flagged_in_the_log_and_every_record(tmp_path, monkeypatch, caplog):
    config_schema.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = config_schema.typed(compose(config_name="config", overrides=[
            *TINY, "bench.num_prompts=2", "bench.new_tokens=4", f"cache_dir={tmp_path / 'cache'}"]))
    noisy = {"over": "repeats", "n": 4, "range": 0.3, "min_ms": 1.0, "max_ms": 1.3}
    monkeypatch.setattr(runner, "timing_spread", lambda repeat_times, batch_times: noisy)
    with caplog.at_level(logging.INFO):
        records = runner.run(cfg, tmp_path / "out")
    warning = "noisy machine: AR timings spread 30% over 4 repeats (more than 10%); speedups below 1.30x are within noise"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [warning]
    assert all(warning in r["notes"] for r in records) and records[0]["spread_pct"] == pytest.approx(30.0)
    assert "- note: random weights" in (tmp_path / "out" / "summary.md").read_text()
    log = (tmp_path / "out" / "run.log").read_text()
    assert warning in log and "| 30% |" not in log and "30%" in log  # the console table, not the markdown one
    handlers = logging.getLogger().handlers + runner.summary_log.handlers
    assert not any(getattr(h, "baseFilename", "").endswith("run.log") for h in handlers)  # removed after the run
