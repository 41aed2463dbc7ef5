"""What the loop writes for people: a markdown report per round (every candidate with its proposer, rewrite,
status and the gate's reasons), a plot of the best time per token from the start through each round, and
the winning plan as a decoding config file ready for `experiments/run.py decoding=<name>`.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from matplotlib.figure import Figure

from specpilot import atomic_io


def _ms(s) -> str:
    return "-" if s is None else f"{1e3 * s:.3f}"


def write_round(out: Path, index: int, old: dict, new: dict, incumbent: dict, rows: list[dict]) -> Path:
    lines = [f"# Round {index}", "", f"Incumbent at the start: `{json.dumps(old)}`",
             f"re-measured this session: {_ms(incumbent.get('s_per_token'))} ms/token "
             f"(status {incumbent.get('status')}; runs {[round(w, 4) for w in incumbent.get('wall_s', [])]} s)", "",
             "| candidate | proposer | rewrite | status | ms/token | gain | ceiling ms | reasons |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        v = row.get("verdict") or {}
        gain = "-" if row.get("gain") is None else f"{row['gain']:.3f}x"
        reason = (row.get("reason") or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {row['name']} | {row['proposer']} | `{json.dumps(row['rewrite'])}` | {row['status']} | "
                     f"{_ms(row.get('s_per_token'))} | {gain} | {_ms(v.get('ceiling_s_per_token'))} | {reason} |")
    whys = [f"- {row['name']}: {row['why']}" for row in rows if row.get("why")]
    if whys:  # the proposers' reasons (the cost model's predicted gain, say), beside what was measured
        lines += ["", "Why each was proposed:", "", *whys]
    lines += ["", f"Incumbent after the round: `{json.dumps(new)}`", ""]
    path = out / f"round_{index}.md"
    atomic_io.write_text(path, "\n".join(lines))
    return path


def plot_best(out: Path, rounds) -> Path | None:
    """best_by_round.png: the incumbent before the loop ("start": round 0's re-measurement of it), then the
    best time per token after each round."""
    points = [(f"round {r.index}", r.best_s_per_token) for r in rounds if r.best_s_per_token is not None]
    if not points:
        return None
    if rounds[0].index == 0 and rounds[0].incumbent_s_per_token is not None:
        points.insert(0, ("start", rounds[0].incumbent_s_per_token))
    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    pos = list(range(len(points)))
    ax.plot(pos, [1e3 * p[1] for p in points], marker="o", label="best ms per token")
    if points[0][0] == "start":
        ax.axhline(1e3 * points[0][1], color="0.4", linestyle="--", linewidth=1, label="start")
    ax.set_xticks(pos, [p[0] for p in points])
    ax.set_xlim(-0.5, len(points) - 0.5)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("best ms per token")
    ax.set_title("best time per token: the start, then each round", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "best_by_round.png"
    fig.savefig(path, dpi=100)
    return path


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings (a kernel variant's source) as literal blocks: the plan file stays readable."""


_LiteralDumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def write_plan(out: Path, plan_name: str, fields: dict, run_key: str, variants=()) -> Path:
    """The plan as conf/decoding/<name>.yaml: `decoding=<name>` runs it next to the AR baseline. The kernel
    variants it names (`harness.kernel_variants.Variant`) travel inline (`variants: [{op, source}]`), so the one
    file is the whole plan; the run checks them against their references before timing
    (`harness.plan_variants`)."""
    name = f"agent_{run_key}"
    folder = out / "decoding"
    folder.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in fields.items() if v is not None}
    body = {"defaults": ["decoding_schema", "_self_"], "name": name, "plans": {plan_name: clean}}
    if variants:
        body["variants"] = [{"op": v.op, "source": v.source} for v in variants]
    path = folder / f"{name}.yaml"
    header = f"# The plan found by the optimization loop (run {run_key}).\n"
    atomic_io.write_text(path, header + yaml.dump(body, Dumper=_LiteralDumper, sort_keys=False))
    return path
