"""Turn a run or multirun folder of `results.jsonl` files into a markdown table and plots.

Design choices:
- Records are found recursively, so one function serves a single run, a multirun sweep folder, or a
  folder of several sweeps; duplicates (same file read twice) cannot occur since each file is read once.
- Labels in the table repeat each record's notes ("random weights", "oracle acceptance"), so a number is
  never shown without what it rests on.
- Plots use matplotlib's Agg backend (no display) and are skipped, not faked, when their data are
  absent (e.g. no speculative method -> no tau plot).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

COLUMNS = ("target", "drafter", "gpu", "batch_size", "prompts", "method", "block_size",
           "decode_ms_per_token", "speedup_vs_ar", "tau", "ceiling_ms_per_token", "pct_of_ceiling",
           "mismatches", "notes")


def load_records(folder: str | Path) -> list[dict]:
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"no such results folder: {folder}")
    records = []
    for path in sorted(folder.rglob("results.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                rec.setdefault("block_size", (rec.get("config") or {}).get("drafter", {}).get("block_size"))
                if rec["method"] == "ar":
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
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines)


def plot_all(records: list[dict], out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    # TPOT per method and deployment
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['target']}/{r['method']}/b{r['batch_size']}" for r in records]
    ax.barh(labels, [r["decode_ms_per_token"] for r in records])
    ax.set_xlabel("decode time per output token (ms)")
    save(fig, "tpot_per_method.png")

    spec = [r for r in records if r.get("block_size") and r["method"] != "ar"]
    if spec:
        series = defaultdict(list)
        for r in spec:
            series[(r["target"], r["method"])].append((r["block_size"], r["speedup_vs_ar"]))
        fig, ax = plt.subplots(figsize=(6, 4))
        for (target, method), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{target} {method}")
        ax.set_xlabel("block size")
        ax.set_ylabel("speedup over AR")
        ax.legend(fontsize=7)
        save(fig, "speedup_vs_block.png")

    with_tau = [r for r in records if r.get("tau") is not None]
    if with_tau:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([f"{r['prompts']}/{r['method']}/b{r.get('block_size')}" for r in with_tau],
               [r["tau"] for r in with_tau])
        ax.set_ylabel("tau (tokens per verification)")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
        save(fig, "tau_per_prompt_set.png")

    split = [r for r in records if (r.get("stats") or {}).get("time_split")]
    if split:
        fig, ax = plt.subplots(figsize=(6, 4))
        parts = sorted({k for r in split for k in r["stats"]["time_split"]})
        left = [0.0] * len(split)
        names = [f"{r['target']}/{r['method']}/b{r.get('block_size')}" for r in split]
        for part in parts:
            vals = [r["stats"]["time_split"].get(part, 0.0) for r in split]
            ax.barh(names, vals, left=left, label=part)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel("fraction of decode time")
        ax.legend(fontsize=7)
        save(fig, "time_split.png")
    return written


def report(folder: str | Path, out_dir: str | Path | None = None) -> tuple[str, list[Path]]:
    records = load_records(folder)
    out_dir = Path(out_dir) if out_dir else Path(folder)
    table = markdown_table(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(table + "\n")
    return table, plot_all(records, out_dir)
