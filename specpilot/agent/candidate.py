"""One candidate plan in its own process: `python -m specpilot.agent.candidate <spec.json> <out.json>`.

It builds the spec's deployment on the gate's prompts, warms the plan up, then runs it once per "go" line
on stdin and answers "done" on stdout, so the evaluator holds the clock; the tokens of every timed run go
to out.json for the gate. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import jax
from omegaconf import OmegaConf

from specpilot.agent.engine_workload import PREFILL_CHUNK, EngineWorkload
from specpilot.harness import config_schema, deploy, devices, kernel_variants, methods, shapes  # tests patch methods.run_plan

PROTOCOL_READY, PROTOCOL_GO, PROTOCOL_DONE, PROTOCOL_END = "ready", "go", "done", "end"
VARIANT_REJECTED = "variant-rejected"  # the last stderr line of a candidate whose kernel variant failed


def configure(spec: dict):
    """The spec's composed config with its plan and prompts, typed; the process's devices set up."""
    cfg = OmegaConf.create(spec["config"])
    group = os.environ.get("SPECPILOT_DEVICE_GROUP", "")
    if group.startswith("cpu:"):  # the evaluator's group of simulated CPU devices, not the driver's count
        cfg.simulated_cpu_devices = len([i for i in group[4:].split(",") if i.strip()]) or None
    prompts = [list(map(int, p)) for p in spec["prompts"]]
    cfg.decoding.plans = {spec["name"]: spec["fields"]}
    cfg.bench.num_prompts = len(prompts)
    cfg.bench.prompt_len = max(int(cfg.bench.prompt_len), max(len(p) for p in prompts))
    if spec.get("new_tokens"):
        cfg.bench.new_tokens = int(spec["new_tokens"])
    cfg.decoding.profile_split = False
    cfg = config_schema.typed(cfg)
    devices.setup(cfg)
    if spec.get("compile_cache"):
        jax.config.update("jax_compilation_cache_dir", str(spec["compile_cache"]))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return cfg


def build(spec: dict, cfg=None):
    """(deployment, plan, plans) of a spec: the composed config with the spec's plan and prompts."""
    cfg = configure(spec) if cfg is None else cfg
    prompts = [list(map(int, p)) for p in spec["prompts"]]
    config_schema.validate(cfg)
    plans = config_schema.build_plans(cfg)
    dep = deploy.build(cfg, plans)
    dep.prompts = prompts  # the gate's draw, whatever prompt set the config names
    longest, block = max(len(p) for p in prompts), max(p.block_size for p in plans)
    dep.cache_len = shapes.cache_len(longest, dep.new_tokens, block)
    plan = next(p for p in plans if p.name == spec["name"])
    return dep, plan, plans


def load_variants(spec: dict) -> list[dict] | None:
    """The spec's kernel variants loaded and checked against their references (what was checked), or
    None after printing why one was rejected (the last stderr line the evaluator reads)."""
    if not spec.get("variants"):
        return []
    try:
        return kernel_variants.load_and_check(spec["variants"], spec["variant_check"]["shapes"],
                                              int(spec["variant_check"]["seed"]))
    except kernel_variants.VariantRejected as e:
        print(f"{VARIANT_REJECTED}: {e}", file=sys.stderr, flush=True)
        return None


def check_stage(spec: dict, proto, out_path: str) -> int:
    """A "check" stage: the variants' reference checks only, on the CPU, no deployment (no config needed)."""
    checked = load_variants(spec)
    if checked is None:
        return 3
    proto.write(f"{PROTOCOL_READY} 0\n")
    for line in sys.stdin:
        if line.strip() == PROTOCOL_END:
            break
    Path(out_path).write_text(json.dumps({"name": spec["name"], "checked": checked, "tokens": []}))
    return 0


def main(spec_path: str, out_path: str) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr
    sys.stdout = sys.stderr
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("stage") == "check":
        return check_stage(spec, proto, out_path)
    cfg = configure(spec)
    checked = load_variants(spec)  # kernel variants: loaded and checked before anything runs
    if checked is None:
        return 3
    dep, plan, plans = build(spec, cfg)
    if plan.uses_drafter and methods.replays_reference(dep.drafter[0]):
        dep.reference_tokens = methods.run_plan(dep, plans[0]).tokens  # the oracle replays the AR reference
    run = workload_run(dep, plan, spec)
    warm = run()  # compiles every step
    proto.write(f"{PROTOCOL_READY} {len(warm.tokens)}\n")
    runs, self_times = [], []
    for line in sys.stdin:
        command = line.strip()
        if command == PROTOCOL_END:
            break
        if command != PROTOCOL_GO:
            raise ValueError(f"unknown evaluator command {command!r}")
        t0 = time.perf_counter()
        r = run()
        self_times.append(time.perf_counter() - t0)
        runs.append(r)
        proto.write(f"{PROTOCOL_DONE}\n")
    out = out_record(dep, plan, runs, self_times, spec.get("workload", "harness"), checked,
                     bool(spec.get("profile", True)))
    Path(out_path).write_text(json.dumps(out, default=str))
    return 0


def workload_run(dep, plan, spec: dict) -> Callable[[], methods.MethodRun]:
    """One run of the spec's plan: the harness's fixed batch, or the prompts as requests through the engine."""
    workload = spec.get("workload", "harness")
    if workload == "engine":
        return EngineWorkload(dep, plan, prefill_chunk=int(spec.get("prefill_chunk") or PREFILL_CHUNK)).run
    if workload == "harness":
        return lambda: methods.run_plan(dep, plan)
    raise ValueError(f"agent.workload: {workload!r} is not one of harness, engine")


def out_record(dep, plan, runs: list, self_times: list, workload: str, checked: list, profile: bool = True) -> dict:
    """What the evaluator reads of a candidate: the tokens of every timed run, its own times (reported,
    never trusted) and the plan's stats, with `profile` from one profiled pass after the timed runs for a
    drafting plan on the harness (the stage split: its stage programs compile, so only the incumbent and a
    winner ask for it)."""
    stats = dict(runs[-1].stats) if runs else {}
    if profile and runs and plan.uses_drafter and workload == "harness":
        dep.profile_split = True
        try:
            stats = dict(methods.run_plan(dep, plan).stats)
        finally:
            dep.profile_split = False
    return {"name": plan.name, "plan": plan.describe(), "tokens": [r.tokens for r in runs],
            "self_reported_s": self_times, "decode_s": [r.decode_s for r in runs],
            "decode_tokens": [r.decode_tokens for r in runs], "stats": stats,
            "batches": len(dep.batches()), "new_tokens": dep.new_tokens, "checked": checked}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m specpilot.agent.candidate <spec.json> <out.json>", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
