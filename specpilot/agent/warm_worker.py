"""The warm worker: `python -m specpilot.agent.warm_worker`, one long-lived process per timing worker that
keeps a deployment (weights, prepared formats, compiled programs) between candidates and rounds and runs
plan-only candidates on it, each as its own jitted programs. Plan-only means no proposed code: a spec with
kernel variants or a program of its own runs in a fresh sandboxed process instead (`evaluator`).

It answers one JSON line per JSON line on stdin: load (build and warm up a spec's plan), go (one run of a
loaded plan, timed by the driver), result (its tokens and stats), retain (drop every other plan), end.
Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
import traceback
from typing import Callable

from specpilot.agent import candidate
from specpilot.decoding import aot
from specpilot.harness import config_schema, deploy, fit, methods, shapes

# config keys a spec may change without a new deployment: its plan, its prompts' count and length, its
# output length (the worker gives every plan a copy of the deployment with its own prompts)
PER_SPEC_KEYS = {"decoding": ("plans", "profile_split"), "bench": ("num_prompts", "prompt_len", "new_tokens")}


def deployment_key(spec: dict) -> str:
    """What a deployment is built from: the spec's config without the keys each plan sets for itself."""
    config = json.loads(json.dumps(spec["config"]))
    for section, keys in PER_SPEC_KEYS.items():
        for k in keys:
            (config.get(section) or {}).pop(k, None)
    return json.dumps(config, sort_keys=True, default=str)


@dataclasses.dataclass
class Loaded:
    """A warmed-up plan: its deployment copy, how to run it, and its timed runs so far."""

    plan: object
    dep: deploy.Deployment
    run: Callable[[], methods.MethodRun]
    workload: str
    profile: bool = True  # the stage split after the timed runs (`candidate.out_record`)
    runs: list = dataclasses.field(default_factory=list)
    self_times: list = dataclasses.field(default_factory=list)
    timed_compiles: int = 0  # programs compiled inside its timed runs (should stay 0: all compiled at load)
    programs: set = dataclasses.field(default_factory=set)  # the compiled programs it ran (`aot.recording`)


class WarmWorker:
    def __init__(self):
        self.key: str | None = None
        self.base: deploy.Deployment | None = None
        self.loaded: dict[str, Loaded] = {}
        self.references: dict[tuple, list] = {}  # (prompts, new_tokens) -> the AR reference's tokens
        self.reference_programs: set = set()  # what the references ran: kept for the next round's

    def load(self, spec: dict) -> dict:
        """Build `spec`'s plan on the kept deployment (built first when the spec's differs), warm it up
        (every step compiled), and keep it under the spec's name."""
        if spec.get("variants") or spec.get("program"):
            raise ValueError("a warm worker runs plan-only candidates (no kernel variants, no program)")
        t0 = time.perf_counter()
        cfg = candidate.configure(spec)
        config_schema.validate(cfg)
        plans = config_schema.build_plans(cfg)
        plan = next(p for p in plans if p.name == spec["name"])
        key = deployment_key(spec)
        built = key != self.key
        if built:
            self.loaded.clear()
            self.references.clear()
            self.reference_programs.clear()
            self.base = self.key = None  # a build that raises leaves no half-kept deployment
            self.base, self.key = deploy.build(cfg, plans), key
        else:
            fit.preflight(cfg, plans, held=[e.plan for e in self.loaded.values()])  # its weights are held
            deploy.check_meshes(plans, self.base.cfg, int(cfg.bench.batch_size), self.base.drafter)
        prompts = [list(map(int, p)) for p in spec["prompts"]]
        new = int(cfg.bench.new_tokens)
        longest, block = max(len(p) for p in prompts), max(p.block_size for p in plans)
        # a copy per plan: its own prompts and lengths, the weights and their prepared formats shared
        dep = dataclasses.replace(self.base, prompts=prompts, new_tokens=new, reference_tokens=None,
                                  profile_split=False, cache_len=shapes.cache_len(longest, new, block))
        with aot.recording() as programs:
            if plan.uses_drafter and methods.replays_reference(dep.drafter[0]):
                ref_key = (json.dumps(prompts), new)
                if ref_key not in self.references:  # the oracle replays the AR reference
                    with aot.recording() as reference:
                        self.references[ref_key] = methods.run_plan(dep, plans[0]).tokens
                    self.reference_programs |= reference
                dep.reference_tokens = self.references[ref_key]
            run = candidate.workload_run(dep, plan, spec)
            warm = run()
        self.loaded[spec["name"]] = Loaded(plan, dep, run, spec.get("workload", "harness"),
                                            bool(spec.get("profile", True)), programs=programs)
        return {"loaded": spec["name"], "tokens": len(warm.tokens), "load_s": time.perf_counter() - t0,
                "built": built}

    def go(self, name: str) -> dict:
        entry = self.loaded[name]
        before = aot.total_compiles()
        t0 = time.perf_counter()
        with aot.recording() as programs:
            entry.runs.append(entry.run())
        entry.self_times.append(time.perf_counter() - t0)
        entry.programs |= programs
        entry.timed_compiles += aot.total_compiles() - before
        return {"done": name}

    def result(self, name: str) -> dict:
        """What a candidate process writes to its out.json (`candidate.main`), for a loaded plan."""
        e = self.loaded[name]
        with aot.recording() as programs:  # the stage split's own programs
            out = candidate.out_record(e.dep, e.plan, e.runs, e.self_times, e.workload, [], e.profile)
        e.programs |= programs
        return {"result": {**out, "timed_compiles": e.timed_compiles}}

    def retain(self, names: list[str]) -> dict:
        """Drop every loaded plan but `names`, and every prepared weight format none of them uses; under
        an address-space limit (`agent.memory_mb`) also the compiled programs only dropped plans ran,
        whose memory mappings count toward it (the references' stay: the next round's reuse them)."""
        self.loaded = {n: e for n, e in self.loaded.items() if n in names}
        if self.base is not None:
            used = set().union(*[self.base.prepared_keys(e.plan) for e in self.loaded.values()])
            for k in [k for k in self.base.prepared if k not in used]:
                del self.base.prepared[k]
        dropped = 0
        if address_space_limited():
            dropped = aot.keep_only(self.reference_programs.union(*[e.programs for e in self.loaded.values()]))
        return {"retained": sorted(self.loaded), "programs_dropped": dropped}

    def handle(self, message: dict) -> dict:
        cmd = message.get("cmd")
        if cmd == "load":
            return self.load(message["spec"])
        if cmd == "go":
            return self.go(message["name"])
        if cmd == "result":
            return self.result(message["name"])
        if cmd == "retain":
            return self.retain(list(message.get("names") or []))
        raise ValueError(f"unknown warm worker command {cmd!r}")


def address_space_limited() -> bool:
    """Whether this process runs under an address-space limit (the evaluator's `memory_mb`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return soft != resource.RLIM_INFINITY


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed goes to stderr
    sys.stdout = sys.stderr
    worker = WarmWorker()
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:  # ends when the driver closes stdin or dies
        message = json.loads(line)
        if message.get("cmd") == "end":
            break
        print(f"== {message.get('cmd')} {message.get('name') or (message.get('spec') or {}).get('name', '')}",
              file=sys.stderr, flush=True)
        try:
            answer = worker.handle(message)
        except Exception as e:  # a plan that cannot be built or run: this candidate only
            traceback.print_exc()
            answer = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:2000]}
        proto.write(json.dumps(answer, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
