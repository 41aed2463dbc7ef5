"""Run one deployment with every configured method and write its results.

Design choices:
- AR always runs (it is the baseline that defines speedup) even when not listed, and its numbers are
  measured in the same process as every other method's.
- Each result record is self-describing: the deployment labels, the method, the device, jax's version,
  the date, and notes such as "random weights" or "oracle acceptance", which the report repeats.
- Records go to `results.jsonl` (one per method) and `results.csv` in the output directory.
"""

from __future__ import annotations

import csv
import datetime
import json
import platform
from pathlib import Path

import jax
from omegaconf import DictConfig, OmegaConf

from specpilot import costmodel, deploy
from specpilot.config_schema import validate
from specpilot.methods import METHODS, median_run

CSV_FIELDS = ("target", "drafter", "gpu", "batch_size", "prompts", "new_tokens", "method",
              "decode_ms_per_token", "tokens_per_s", "prefill_ms", "speedup_vs_ar", "tau",
              "mismatches", "notes")


def environment() -> dict:
    dev = jax.devices()[0]
    return {"device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
            "python": platform.python_version(), "date": datetime.date.today().isoformat()}


def run(cfg: DictConfig, out_dir: str | Path) -> list[dict]:
    validate(cfg)
    dep = deploy.build(cfg)
    methods = list(dict.fromkeys(["ar", *cfg.decoding.methods]))
    env = environment()
    runs = {}
    for name in methods:  # AR first: its tokens are the reference an oracle drafter replays
        runs[name] = median_run(METHODS[name], dep, int(cfg.bench.repeats))
        if name == "ar":
            dep.reference_tokens = runs["ar"].tokens
    ar_tpot = runs["ar"].decode_time_per_token
    hw = costmodel.Hardware.from_conf(cfg.gpu)
    mean_context = sum(len(p) for p in dep.prompts) / len(dep.prompts) + dep.new_tokens / 2
    ar_floor = costmodel.ar_ceiling_s(hw, dep.cfg, dep.batch_size, int(mean_context))
    records = []
    for name, r in runs.items():
        rec = dict(dep.labels)
        rec.update(
            method=name,
            decode_ms_per_token=1e3 * r.decode_time_per_token,
            tokens_per_s=dep.batch_size / r.decode_time_per_token,
            prefill_ms=1e3 * r.prefill_s / max(1, len(dep.batches())),
            speedup_vs_ar=ar_tpot / r.decode_time_per_token,
            ar_ceiling_ms_per_token=1e3 * ar_floor,
            tau=r.stats.get("tau"),
            mismatches=r.stats.get("mismatches"),
            notes="; ".join(dep.notes + r.stats.get("notes", [])),
            stats={k: v for k, v in r.stats.items() if k not in ("tau", "mismatches", "notes")},
            config=OmegaConf.to_container(cfg, resolve=True),
            **env,
        )
        records.append(rec)
    write(records, out_dir)
    return records


def write(records: list[dict], out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "a") as f:
        for rec in records:
            f.write(json.dumps(rec, default=str) + "\n")
    csv_path = out / "results.csv"
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(records)


def format_table(records: list[dict]) -> str:
    head = f"{'method':<10}{'ms/token':>10}{'tok/s':>10}{'speedup':>9}{'tau':>7}{'mismatch':>10}"
    lines = [head, "-" * len(head)]
    for r in records:
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        mm = str(r["mismatches"]) if r.get("mismatches") is not None else "-"
        lines.append(f"{r['method']:<10}{r['decode_ms_per_token']:>10.3f}{r['tokens_per_s']:>10.1f}"
                     f"{r['speedup_vs_ar']:>8.2f}x{tau:>7}{mm:>10}")
    notes = {r["notes"] for r in records if r.get("notes")}
    lines += [f"note: {n}" for n in sorted(notes)]
    return "\n".join(lines)
