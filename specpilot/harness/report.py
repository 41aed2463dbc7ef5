"""Turn a run or multirun folder of `results.jsonl` files into a markdown table and plots.

Records are found recursively (one run, a sweep, or several sweeps); every plot draws one bar or point per
record, labelled by what varies across the records, with what they share in the title and each record's
notes kept in the table. Design notes: docs/design/harness.md.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from matplotlib.figure import Figure

from specpilot import atomic_io

COLUMNS = ("target", "drafter", "gpu", "batch_size", "prompts", "method", "block_size",
           "decode_ms_per_token", "speedup_vs_ar", "tau", "ceiling_ms_per_token", "pct_of_ceiling",
           "predicted_ms_per_token", "prediction_error", "mismatches", "notes")


def prediction_error(rec: dict) -> str | None:
    """The cost model's prediction against the measurement, signed (+ predicted slower), e.g. "-9%"."""
    pred, meas = rec.get("predicted_ms_per_token"), rec.get("decode_ms_per_token")
    if pred is None or not meas:
        return None
    return f"{100 * (pred / meas - 1):+.0f}%"


def load_records(folder: str | Path) -> list[dict]:
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"no such results folder: {folder}")
    records = []
    for path in sorted(folder.rglob("results.jsonl")):
        for rec in atomic_io.read_jsonl(path):
            rec.setdefault("block_size", (rec.get("config") or {}).get("drafter", {}).get("block_size"))
            if rec["method"] == "ar" or rec.get("verify") == "ar":  # one token per step: no block
                rec["block_size"] = None
            records.append(rec)
    if not records:
        raise FileNotFoundError(f"no results.jsonl under {folder}")
    return records


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def markdown_table(records: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in records:
        row = {**r, "prediction_error": prediction_error(r)}
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


# Record fields a plot can vary over, in label order, with how a value is written.
AXES = (("target", "{}"), ("drafter", "drafter {}"), ("gpu", "{}"), ("prompts", "prompts {}"),
        ("method", "{}"), ("batch_size", "batch {}"), ("block_size", "block {}"))
IGNORED_SETTINGS = ("output_dir",)  # differ between runs without making the measurements differ


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def own_settings(rec: dict) -> dict:
    """A record's config settings that bear on its own plan: no other plan's fields (a sweep over
    `decoding.plans.stock.block_size` says nothing about the AR plan of each run), and for an AR plan
    nothing of the drafter's."""
    method = rec.get("method")
    ar = rec.get("verify") == "ar" or method == "ar"
    return {k: v for k, v in _flat(rec.get("config") or {}).items()
            if not (k.startswith("decoding.plans.") and not k.startswith(f"decoding.plans.{method}."))
            and not (ar and k.startswith("drafter."))}


def describe(records: list[dict], x_axis: str | None = None) -> tuple[list[str], str]:
    """(a distinct label per record, the values all records share) for a plot of `records`.

    `x_axis` names a field the plot shows on an axis: it is left out of labels, and records that
    differ in it may share a label (they are one series).
    """
    axes = [(k, fmt) for k, fmt in AXES if k != x_axis]
    varies = [(k, fmt) for k, fmt in axes if len({repr(r.get(k)) for r in records}) > 1]
    shared = [fmt.format(records[0][k]) for k, fmt in axes
              if (k, fmt) not in varies and records[0].get(k) is not None]
    labels = [", ".join(fmt.format(r[k]) for k, fmt in varies if r.get(k) is not None) for r in records]
    groups = defaultdict(list)
    for i, label in enumerate(labels):
        groups[label, repr(records[i].get(x_axis)) if x_axis else None].append(i)
    for (label, _), members in groups.items():
        if len(members) < 2:
            continue
        flats = [own_settings(records[i]) for i in members]
        # members share the x value too, so a setting that restates the x axis never differs here
        settings = sorted(k for k in set().union(*flats)
                          if k not in IGNORED_SETTINGS and len({repr(f.get(k)) for f in flats}) > 1)
        keyed = [", ".join(f"{k}={f.get(k)}" for k in settings) for f in flats]
        count, seen = Counter(keyed), defaultdict(int)
        for i, extra in zip(members, keyed):
            if count[extra] > 1:  # the same settings too: numbered in record order
                seen[extra] += 1
                extra = ", ".join(p for p in (extra, f"#{seen[extra]}") if p)
            labels[i] = f"{label}, {extra}" if label else extra
    if len(records) == 1 and not labels[0]:
        labels[0] = records[0]["method"]
    return labels, ", ".join(shared)


def _title(ax, what: str, shared: str) -> None:
    ax.set_title(f"{what}\n{shared}" if shared else what, fontsize=9)


def _barh(ax, labels: list[str], values: list[float], left=None, **kw) -> None:
    """Horizontal bars at positions 0..n-1, top to bottom in record order."""
    pos = list(range(len(labels)))
    ax.barh(pos, values, left=left, **kw)
    ax.set_yticks(pos, labels, fontsize=7)
    ax.set_ylim(len(labels) - 0.5, -0.5)


SPEEDUP_REFERENCE = {"color": "0.4", "linestyle": "--", "linewidth": 1, "label": "AR (1.0x)"}


def plot_all(records: list[dict], out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        written.append(path)

    def figure(n_bars):
        fig = Figure(figsize=(7, 1.6 + 0.3 * n_bars))
        return fig, fig.subplots()

    labels, shared = describe(records)
    fig, ax = figure(len(records))
    _barh(ax, labels, [r["decode_ms_per_token"] for r in records])
    ax.set_xlabel("decode time per output token (ms)")
    _title(ax, "Decode time per output token", shared)
    save(fig, "tpot_per_method.png")

    # speculative plans only (load_records clears the block size of ar plans)
    spec = [r for r in records if r.get("block_size")]
    if spec:
        names, shared = describe(spec, x_axis="block_size")
        series = defaultdict(list)
        for name, r in zip(names, spec):
            series[name].append((r["block_size"], r["speedup_vs_ar"]))
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        ax.axhline(1.0, **SPEEDUP_REFERENCE)  # at or under it, the plan is no faster than AR
        for name, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xticks(sorted({r["block_size"] for r in spec}))
        ax.set_xlabel("block size")
        ax.set_ylabel("speedup over AR")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
        _title(ax, "Speedup over AR by block size", shared)
        save(fig, "speedup_vs_block.png")

    with_tau = [r for r in records if r.get("tau") is not None]
    if with_tau:
        labels, shared = describe(with_tau)
        fig, ax = figure(len(with_tau))
        _barh(ax, labels, [r["tau"] for r in with_tau])
        ax.set_xlabel("tau (tokens per verification)")
        _title(ax, "Tokens per verification (tau)", shared)
        save(fig, "tau_per_method.png")

    split = [r for r in records if (r.get("stats") or {}).get("time_split")]
    if split:
        labels, shared = describe(split)
        fig, ax = figure(len(split))
        parts = sorted({k for r in split for k in r["stats"]["time_split"]})
        left = [0.0] * len(split)
        for part in parts:
            vals = [r["stats"]["time_split"].get(part, 0.0) for r in split]
            _barh(ax, labels, vals, left=left, label=part)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel("fraction of decode time")
        ax.legend(fontsize=7)
        _title(ax, "Where decode time goes", shared)
        save(fig, "time_split.png")

    attributed = [r for r in records if r.get("attribution")]
    if attributed:
        save(_stage_plot(attributed), "stages_vs_prediction.png")
    return written


def _stage_plot(records: list[dict]) -> Figure:
    """Per record and stage, three bars: measured, the cost model's prediction, its floor (ms per step)."""
    labels, shared = describe(records)
    rows = [(f"{label}: {st['stage']}", st) for label, r in zip(labels, records)
            for st in sorted(r["attribution"]["stages"], key=lambda s: s["stage"])]
    fig = Figure(figsize=(7, 1.6 + 0.45 * len(rows)))
    ax = fig.subplots()
    pos = list(range(len(rows)))
    for j, (key, name) in enumerate((("measured_ms", "measured"), ("predicted_ms", "predicted"),
                                     ("floor_ms", "floor"))):
        ax.barh([p + (j - 1) * 0.27 for p in pos], [st[key] for _, st in rows], height=0.27, label=name)
    ax.set_yticks(pos, [name for name, _ in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("ms per step")
    ax.legend(fontsize=7)
    _title(ax, "Measured vs predicted vs floor per stage", shared)
    return fig


def report(folder: str | Path, out_dir: str | Path | None = None) -> tuple[str, list[Path]]:
    records = load_records(folder)
    out_dir = Path(out_dir) if out_dir else Path(folder)
    table = markdown_table(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(table + "\n")
    return table, plot_all(records, out_dir)
