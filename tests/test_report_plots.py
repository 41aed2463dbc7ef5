"""Report plots: one bar per record, labelled by what varies across the records, and a title on each.

The records are shaped like a multirun's: each run measures AR (no block size) and the speculative
method, and carries its resolved config. Figures are captured at `savefig` and inspected.
"""

import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

from specpilot.harness import report  # noqa: E402


def _record(method, block, batch=4, tpot=1.0, config_block=None):
    rec = {"target": "tiny_random", "drafter": "oracle", "gpu": "cpu", "batch_size": batch,
           "prompts": "heldout", "method": method, "block_size": None if method == "ar" else block,
           "decode_ms_per_token": tpot, "speedup_vs_ar": 1.0 if method == "ar" else 2.0 / tpot,
           "tau": None if method == "ar" else block / 2,
           "stats": {} if method == "ar" else {"time_split": {"draft": 0.3, "verify": 0.6,
                                                               "bookkeeping": 0.1}},
           "config": {"seed": 0, "bench": {"batch_size": batch},
                      "drafter": {"block_size": config_block or block}}}
    return rec


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """Draw `records` with report.plot_all; returns {file name: Figure}."""
    figures = {}

    def capture(fig, path, *args, **kwargs):
        figures[str(path).rsplit("/", 1)[-1]] = fig

    monkeypatch.setattr(Figure, "savefig", capture)
    return lambda records: (report.plot_all(records, tmp_path), figures)[1]


def _bars(fig):
    ax = fig.axes[0]
    labels = [t.get_text() for t in (ax.get_yticklabels() or ax.get_xticklabels())]
    return ax, [p for p in ax.patches], labels


def test_block_sweep_draws_every_record(drawn):
    records = [_record("stock", b, tpot=1.0 / b) for b in (2, 4, 8, 16)]
    figs = drawn(records)
    ax, bars, labels = _bars(figs["tpot_per_method.png"])
    assert len(bars) == 4
    assert labels == ["block 2", "block 4", "block 8", "block 16"]
    widths = sorted(round(b.get_width(), 6) for b in bars)
    assert widths == sorted(round(r["decode_ms_per_token"], 6) for r in records)
    assert "batch 4" in ax.get_title() and "stock" in ax.get_title()  # what all bars share


def test_ar_and_spec_runs_of_a_block_sweep_stay_apart(drawn):
    # Two runs (block 4 and block 8), each with its AR baseline: four records, four bars.
    records = [_record("ar", None, tpot=1.0, config_block=4), _record("stock", 4, tpot=0.5),
               _record("ar", None, tpot=1.1, config_block=8), _record("stock", 8, tpot=0.4)]
    _, bars, labels = _bars(drawn(records)["tpot_per_method.png"])
    assert len(bars) == 4 and len(set(labels)) == 4, labels
    assert labels[1] == "stock, block 4" and labels[3] == "stock, block 8"
    # the AR bars are AR's: the runs differ only in the speculative plan's settings, which say nothing of AR
    assert labels[0] == "ar, #1" and labels[2] == "ar, #2"


def test_a_block_sweep_over_a_plan_override_labels_ar_as_ar(drawn):
    # `-m decoding.plans.stock.block_size=4,8`: each run's AR record carries the stock plan's override
    records = []
    for block, tpot in ((4, 0.5), (8, 0.4)):
        for method in ("ar", "stock"):
            rec = _record(method, block, tpot=1.0 if method == "ar" else tpot)
            rec["config"]["decoding"] = {"plans": {"ar": {"verify": "ar"}, "stock": {"block_size": block}}}
            records.append(rec)
    _, _, labels = _bars(drawn(records)["tpot_per_method.png"])
    assert labels == ["ar, #1", "stock, block 4", "ar, #2", "stock, block 8"]
    assert not any("block_size" in label for label in labels)


def test_ar_runs_that_differ_in_their_own_settings_are_labelled_by_them(drawn):
    records = [_record("ar", None, tpot=1.0), _record("ar", None, tpot=1.2)]
    records[1]["config"]["seed"] = 1
    _, _, labels = _bars(drawn(records)["tpot_per_method.png"])
    assert labels == ["seed=0", "seed=1"]


def test_batch_and_block_are_spelled_out_and_every_plot_has_a_title(drawn):
    records = [_record("stock", b, batch=n, tpot=1.0 / (b * n)) for n in (1, 4) for b in (4, 8)]
    figs = drawn(records)
    assert set(figs) == {"tpot_per_method.png", "speedup_vs_block.png", "tau_per_method.png",
                         "time_split.png"}
    for name, fig in figs.items():
        assert fig.axes[0].get_title(), f"{name} has no title"
    for name in ("tpot_per_method.png", "tau_per_method.png", "time_split.png"):
        _, bars, labels = _bars(figs[name])
        assert len(set(labels)) == 4, (name, labels)
        assert all(re.fullmatch(r"batch \d+, block \d+", label) for label in labels), (name, labels)
    lines = [ln for ln in figs["speedup_vs_block.png"].axes[0].get_lines() if ln.get_label() != "AR (1.0x)"]
    assert sorted(line.get_label() for line in lines) == ["batch 1", "batch 4"]  # one line per batch
    assert all(list(line.get_xdata()) == [4, 8] for line in lines)


def test_speedup_plot_has_the_ar_reference_line(drawn):
    records = [_record("ar", None), _record("stock", 4, tpot=0.5), _record("stock", 8, tpot=0.4)]
    ax = drawn(records)["speedup_vs_block.png"].axes[0]
    reference = [ln for ln in ax.get_lines() if ln.get_label() == "AR (1.0x)"]
    assert len(reference) == 1 and set(reference[0].get_ydata()) == {1.0}
    assert "AR (1.0x)" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert ax.get_ylim()[0] == 0


def test_tau_plot_draws_tau_per_plan_and_says_so(drawn):
    records = [_record("ar", None), _record("stock", 4, tpot=0.5), _record("stock", 8, tpot=0.4)]
    figs = drawn(records)
    assert "tau_per_prompt_set.png" not in figs
    ax, bars, labels = _bars(figs["tau_per_method.png"])
    assert labels == ["block 4", "block 8"] and [b.get_width() for b in bars] == [2.0, 4.0]
    assert ax.get_xlabel().startswith("tau") and ax.get_title().startswith("Tokens per verification (tau)")


def test_records_nothing_tells_apart_are_numbered(drawn):
    # The same run read twice (e.g. copied into two sweep folders) and a third run with another seed.
    records = [_record("stock", 4, tpot=0.5), _record("stock", 4, tpot=0.6), _record("stock", 4, tpot=0.7)]
    records[2]["config"]["seed"] = 1
    _, bars, labels = _bars(drawn(records)["tpot_per_method.png"])
    assert len(bars) == 3
    assert labels == ["seed=0, #1", "seed=0, #2", "seed=1"]


def test_cli_on_a_missing_folder_prints_the_message_alone(tmp_path):
    cli = Path(__file__).resolve().parents[1] / "experiments" / "report.py"
    proc = subprocess.run([sys.executable, str(cli), str(tmp_path / "nope")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"error: no such results folder: {tmp_path / 'nope'}"


def test_stage_plot_draws_measured_predicted_and_floor_per_stage(drawn):
    stages = [{"stage": "draft", "measured_ms": 2.0, "predicted_ms": 1.5, "floor_ms": 1.0},
              {"stage": "verify", "measured_ms": 6.0, "predicted_ms": 5.0, "floor_ms": 3.0}]
    records = [_record("ar", 1), _record("stock", 4)]
    records[1]["attribution"] = {"stages": stages}
    fig = drawn(records)["stages_vs_prediction.png"]
    ax, patches, labels = _bars(fig)
    assert len(patches) == 3 * 2
    assert len(labels) == 2 and all("stock" in t for t in labels)
    assert labels[0].endswith("draft") and labels[1].endswith("verify")
    assert sorted(p.get_width() for p in patches) == [1.0, 1.5, 2.0, 3.0, 5.0, 6.0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["measured", "predicted", "floor"]


def test_prediction_error_is_signed_against_the_measurement():
    assert report.prediction_error({"predicted_ms_per_token": 0.9, "decode_ms_per_token": 1.0}) == "-10%"
    assert report.prediction_error({"predicted_ms_per_token": 6.0, "decode_ms_per_token": 5.0}) == "+20%"
    assert report.prediction_error({"predicted_ms_per_token": None, "decode_ms_per_token": 5.0}) is None
    table = report.markdown_table([{"method": "ar", "predicted_ms_per_token": 3.3, "decode_ms_per_token": 3.0}])
    assert "| +10% |" in table and "prediction_error" in table.splitlines()[0]
