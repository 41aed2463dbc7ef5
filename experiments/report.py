"""Report a run or multirun folder: `python experiments/report.py multirun/2026-11-29/10-00-00`.

Writes report.md (a markdown table) and PNG plots into the folder (or --out) and prints the table.
"""

import argparse

from specpilot.harness.report import report


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folder", help="a run or multirun output folder holding results.jsonl files")
    ap.add_argument("--out", default=None, help="where to write report.md and plots (default: folder)")
    args = ap.parse_args(argv)
    try:
        table, plots = report(args.folder, args.out)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}")
    print(table)
    for p in plots:
        print(f"plot: {p}")


if __name__ == "__main__":
    main()
