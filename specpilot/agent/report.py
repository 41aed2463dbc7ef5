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
    """round_<index>.md: the incumbent's re-measurement and every candidate's verdict, with each timed run
    and the τ it ran at, so a gain can be told from a run's noise or a change of acceptance."""
    lines = [f"# Round {index}", "", f"Incumbent at the start: `{json.dumps(old)}`",
             f"re-measured this session: {_ms(incumbent.get('s_per_token'))} ms/token "
             f"(status {incumbent.get('status')}; runs {_runs(incumbent)} s; τ {_tau(incumbent)})", "",
             "| candidate | proposer | rewrite | status | ms/token | gain | runs s | τ | ceiling ms | reasons |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        v, res = row.get("verdict") or {}, row.get("result") or {}
        gain = "-" if row.get("gain") is None else f"{row['gain']:.3f}x"
        reason = (row.get("reason") or "").replace("|", "/").replace("\n", " ")
        if res.get("timed_compiles"):  # a program compiled inside a timed run inflates it
            reason = "; ".join(filter(None, [reason, f"{res['timed_compiles']} program(s) compiled while timed"]))
        lines.append(f"| {row['name']} | {row['proposer']} | `{json.dumps(row['rewrite'])}` | {row['status']} | "
                     f"{_ms(row.get('s_per_token'))} | {gain} | {_runs(res)} | {_tau(res)} | "
                     f"{_ms(v.get('ceiling_s_per_token'))} | {reason} |")
    whys = [f"- {row['name']}: {row['why']}" for row in rows if row.get("why")]
    if whys:  # the proposers' reasons (the cost model's predicted gain, say), beside what was measured
        lines += ["", "Why each was proposed:", "", *whys]
    lines += ["", f"Incumbent after the round: `{json.dumps(new)}`", ""]
    path = out / f"round_{index}.md"
    atomic_io.write_text(path, "\n".join(lines))
    return path


def _runs(result: dict) -> str:
    walls = result.get("wall_s") or []
    return ", ".join(f"{w:.4f}" for w in walls) if walls else "-"


def _tau(result: dict) -> str:
    tau = (result.get("stats") or {}).get("tau")
    return "-" if tau is None else f"{float(tau):.2f}"


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
