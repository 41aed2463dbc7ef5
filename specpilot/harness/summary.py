"""A run's results for people: the table the run prints, the same table in markdown (`summary.md`), the
notes under it and the decoded replies. One set of rows and notes serves both renderings, so the file and
the console never disagree.
"""

from __future__ import annotations

from specpilot.costmodel import prediction
from specpilot.harness.spread import format_spread

# (header, width, right-aligned) per column of the text table
COLUMNS = (("verify", 7, False), ("weights", 8, False), ("matmul", 13, False), ("block", 5, True),
           ("ms/token", 10, True), ("spread", 8, True), ("tok/s", 10, True), ("speedup", 9, True),
           ("tau", 7, True), ("ceiling ms", 11, True), ("% ceil", 8, True), ("pred ms", 9, True),
           ("mismatch", 10, True))


def _opt(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def weights_cell(r: dict) -> str:
    """The plan's weight format, naming the target's dtype for dense weights (`weights: bf16` is the dense
    format; a float32 target keeps float32 weights)."""
    short = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
    if r["weights"] == "bf16" and r.get("dtype"):
        return short.get(r["dtype"], r["dtype"])
    return r["weights"]


def table_rows(records: list[dict]) -> list[list[str]]:
    """One row of cells per record: the plan's name, then `COLUMNS`."""
    rows = []
    for r in records:
        pct = r.get("pct_of_ceiling")
        rows.append([r["method"], r["verify"], weights_cell(r), r["matmul"], str(r["block_size"]),
                     f"{r['decode_ms_per_token']:.3f}", format_spread(r.get("spread")), f"{r['tokens_per_s']:.1f}",
                     f"{r['speedup_vs_ar']:.2f}x", _opt(r.get("tau"), ".2f"),
                     _opt(r.get("ceiling_ms_per_token"), ".3f"), "-" if pct is None else f"{pct:.0f}%",
                     _opt(r.get("predicted_ms_per_token"), ".3f"), _opt(r.get("mismatches"), "")])
    return rows


def table_notes(records: list[dict]) -> list[str]:
    """What the table's numbers rest on: baselines, spreads, per-plan details, then the run's notes."""
    lines = []
    if records:
        r = records[0]
        stock = f"; stock: {r['stock_baseline']}" if r.get("stock_baseline") else ""
        lines.append(f"speedup over AR = the fastest ar plan on dense weights (not W12) measured in this run: "
                     f"{r['baseline']}{stock}; "
                     "spread: (max - min) / median of the time per token over the repeats (with one repeat, over "
                     "the batches); ceiling: the cost model's floor per output token; pred: its prediction from "
                     "the device's measured rates (conf/gpu/rates/)")
    for r in records:
        if r.get("acceptance_length_upstream") is not None:
            lines.append(f"{r['method']}: tau {r['tau']:.2f} (tokens emitted per verification step within the budget); "
                         f"upstream DFlash's mean acceptance length {r['acceptance_length_upstream']:.2f} (also counts "
                         "the tokens the budget cut off)")
        if r.get("speedup_at_profile_tau") is not None:
            lines.append(f"{r['method']}: oracle acceptance, tau {r['tau']:.2f} measured vs {r['profile_tau']:.2f} "
                         f"in the profile; {r['ms_per_step']:.3f} ms per step ({r['step_vs_ar_step']:.2f}x an AR "
                         f"step) -> {r['speedup_at_profile_tau']:.2f}x at the profile's tau")
        if r.get("mesh", "1x1") != "1x1":
            lines.append(f"{r['method']}: sharded over a {r['mesh']} mesh (data x tensor devices)")
        split = (r.get("stats") or {}).get("time_split")
        if split:
            lines.append(f"{r['method']}: time split (profiled pass) " + ", ".join(
                f"{k} {100 * v:.0f}%" for k, v in split.items()))
        if r.get("attribution"):
            lines += prediction.format_attribution(r["method"], r["attribution"])
        if r.get("forcing"):
            lines.append(f"{r['method']}: {r['forcing']['summary']}")
    notes = {r["notes"] for r in records if r.get("notes")}
    lines += [f"note: {n}" for n in sorted(notes)]
    return lines


def format_table(records: list[dict]) -> str:
    """The table as the run prints it (fixed-width columns), its notes under it."""
    width = max([4] + [len(r["method"]) for r in records]) + 2
    widths = [(width, False)] + [(w, right) for _, w, right in COLUMNS]

    def line(cells):
        return "".join(f"{c:>{w}}" if right else f"{c:<{w}}" for c, (w, right) in zip(cells, widths))

    head = line(["plan"] + [h for h, _, _ in COLUMNS])
    return "\n".join([head, "-" * len(head)] + [line(row) for row in table_rows(records)] + table_notes(records))


def format_markdown(records: list[dict], title: str = "Results") -> str:
    """The same table and notes in markdown: what `summary.md` holds."""
    cols = ["plan"] + [h for h, _, _ in COLUMNS]
    out = [f"# {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in table_rows(records)]
    notes = table_notes(records)
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def format_responses(records: list[dict], width: int = 600) -> str:
    """The decoded replies a run recorded, for the console: each prompt's last line(s), then its reply."""
    lines = []
    for rec in records:
        for i, r in enumerate(rec.get("responses", ())):
            prompt = r["prompt"].replace("<|im_start|>", "").replace("<|im_end|>", "").strip()
            prompt = prompt[-300:] if len(prompt) > 300 else prompt
            reply = r["response"] if len(r["response"]) <= width else r["response"][:width] + " ..."
            lines += [f"--- prompt {i} (...{len(r['prompt'])} chars) ---", prompt,
                      f"--- reply ({r['tokens']} tokens) ---", reply.strip(), ""]
    return "\n".join(lines)
