"""The loop's plot of the best time per token: the start, then each round."""

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
