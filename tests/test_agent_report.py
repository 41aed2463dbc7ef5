"""The loop's round report (each candidate, what it measured and why it was proposed) and its plot of the
best time per token: the start, then each round."""

from types import SimpleNamespace

import pytest
from matplotlib.figure import Figure

from specpilot.agent import report


@pytest.fixture
def saved(monkeypatch):
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, *a, **k: figures.append(fig))
    return figures


def _round(index, incumbent_s, best_s):
    return SimpleNamespace(index=index, incumbent_s_per_token=incumbent_s, best_s_per_token=best_s)


def test_one_round_shows_the_start_and_the_round(tmp_path, saved):
    path = report.plot_best(tmp_path, [_round(0, 0.010, 0.008)])
    assert path == tmp_path / "best_by_round.png"
    ax = saved[0].axes[0]
    best = next(ln for ln in ax.get_lines() if ln.get_label() == "best ms per token")
    assert list(best.get_xdata()) == [0, 1] and list(best.get_ydata()) == pytest.approx([10.0, 8.0])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["start", "round 0"]
    start = next(ln for ln in ax.get_lines() if ln.get_label() == "start")
    assert list(start.get_ydata()) == pytest.approx([10.0, 10.0])


def test_rounds_without_a_measured_start_plot_the_rounds_only(tmp_path, saved):
    report.plot_best(tmp_path, [_round(0, None, 0.008), _round(1, 0.008, 0.006)])
    ax = saved[0].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["round 0", "round 1"]
    assert [ln.get_label() for ln in ax.get_lines()] == ["best ms per token"]


def test_no_measured_round_draws_nothing(tmp_path, saved):
    assert report.plot_best(tmp_path, [_round(0, None, None)]) is None and not saved


def test_the_round_report_says_why_each_candidate_was_proposed(tmp_path):
    rows = [{"name": "r0-c0-predicted", "proposer": "predicted", "rewrite": {"weights": "w12"}, "status": "rejected",
             "s_per_token": 0.002, "gain": 0.9, "verdict": {}, "reason": "not faster",
             "why": "the cost model predicts 1.000 ms/token against the incumbent's 1.140 (1.14x)"},
            {"name": "r0-given0-x", "proposer": "given", "rewrite": {}, "status": "dropped", "reason": "bad",
             "why": ""}]
    text = report.write_round(tmp_path, 0, {"verify": "chain"}, {"verify": "chain"},
                              {"s_per_token": 0.0018, "status": "ok", "wall_s": [0.1]}, rows).read_text()
    assert "| r0-c0-predicted | predicted | `{\"weights\": \"w12\"}` | rejected | 2.000 | 0.900x |" in text
    assert "- r0-c0-predicted: the cost model predicts 1.000 ms/token against the incumbent's 1.140 (1.14x)" in text
    assert "- r0-given0-x" not in text  # no reason given, no line


def test_the_round_report_shows_each_timed_run_its_tau_and_compiles_while_timed(tmp_path):
    rows = [{"name": "r0-c0-predicted", "proposer": "predicted", "rewrite": {"block_size": 12}, "status": "accepted",
             "s_per_token": 0.003, "gain": 1.16, "verdict": {}, "reason": "", "why": "",
             "result": {"wall_s": [0.3851, 0.3907], "stats": {"tau": 5.8712}, "timed_compiles": 2}},
            {"name": "r0-c1-guided", "proposer": "guided", "rewrite": {"verify": "ar"}, "status": "failed",
             "s_per_token": None, "gain": None, "verdict": {}, "reason": "crashed", "why": ""}]
    text = report.write_round(tmp_path, 0, {"verify": "chain"}, {"verify": "chain", "block_size": 12},
                              {"s_per_token": 0.0035, "status": "ok", "wall_s": [0.45, 0.44], "stats": {"tau": 6.27}},
                              rows).read_text()
    assert "runs 0.4500, 0.4400 s; τ 6.27)" in text
    assert ("| r0-c0-predicted | predicted | `{\"block_size\": 12}` | accepted | 3.000 | 1.160x | 0.3851, 0.3907 | "
            "5.87 | - | 2 program(s) compiled while timed |") in text
    assert "| r0-c1-guided | guided | `{\"verify\": \"ar\"}` | failed | - | - | - | - | - | crashed |" in text
