"""Candidates evaluated in parallel on Dask distributed (on loopback, or across hosts over TLS), each in
its own sandboxed process (`sandbox`), timed from outside.

Each task starts a candidate process (limits, deadline, its device group's devices only), sends it one
"go" per timed repeat and times each answer itself; a crash, hang, out-of-memory or escape attempt loses
that candidate only, reported as a status with a reason, never raised. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from dask.distributed import Client, Nanny, Scheduler, SpecCluster, as_completed

from specpilot.agent import sandbox as sb
from specpilot.agent import warm_pool
from specpilot.agent.candidate_io import (  # noqa: F401  (the evaluator's names for callers and tests)
    BAD_OUTPUT, CHECK, CRASHED, GROUP_ENV, KILLED, OK, OOM, TIMEOUT, TIMING, VARIANT_REJECTED, Channel,
    candidate_env, device_group_labels, failure, group_env, group_label, nanny_injected, parse_group,
    prepared_spec, self_reported_decode, spec_reads, timing, timing_lock_held)
from specpilot.agent.cluster_security import TLSConf, check_scheduler, security


# a worker process reads Dask's log level for its `distributed` loggers from this as it imports distributed
DASK_LOG_ENV = "DASK_LOGGING__DISTRIBUTED"


def log_level(level: str | int) -> int:
    """A logging level from its name ("warning", "INFO") or number; ValueError naming the valid names."""
    if isinstance(level, int):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(f"agent.dask_log_level: {level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    return value


def set_dask_log_level(level: int) -> None:
    """Every `distributed.*` logger of this process at `level` (per-connection INFO lines drown the progress)."""
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("distributed")] + ["distributed"]:
        logging.getLogger(name).setLevel(level)


LOOPBACK = "127.0.0.1"


def evaluate_candidate(spec: dict, *, timeout_s: float, memory_mb: int | None, workdir: str,
                       python: str = sys.executable, timing_lock: str | None = None,
                       group: str | None = None, sandbox: str = sb.BWRAP) -> dict:
    """Run one candidate process in the sandbox and time it (a Dask task; also callable directly). Never
    raises.

    `timing_lock`: the name of a cluster-wide lock held around the timed runs, so candidates sharing one
    device build and compile in parallel but are timed one at a time (waiting for it does not count
    against the timeout; GPU groups take none). `group`: the device group the process may see (default:
    the worker's, `SPECPILOT_DEVICE_GROUP`; none: every device). `sandbox`: bwrap, or none (no isolation
    but the limits). The workdir (every candidate's folder) is hidden from the process; its spec is bound
    read-only and its out.json writable."""
    group = group if group is not None else os.environ.get(GROUP_ENV) or None
    if spec.get("stage") == "check":
        group = "cpu:"  # checks need no accelerator
    if group and parse_group(group)[0] == "gpu":
        timing_lock = None
    Path(workdir).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{spec['name']}-", dir=workdir))
    spec_path, out_path, err_path = folder / "spec.json", folder / "out.json", folder / "stderr.txt"
    base = {"name": spec["name"], "stage": spec.get("stage", "full"), "folder": str(folder), "wall_s": [],
            "group": group}
    spec = prepared_spec(spec, sandbox, folder)
    spec_path.write_text(json.dumps(spec, default=list))
    out_path.touch()
    program = spec.get("program")
    argv = [python, program] if program else [python, "-m", "specpilot.agent.candidate"]
    try:
        sb.require(sandbox, python=python)
        cmd = sb.command([*argv, str(spec_path), str(out_path)], mode=sandbox, python=python,
                         limits=sb.Limits.for_deadline(timeout_s, memory_mb), env=candidate_env(group),
                         reads=[spec_path, *spec_reads(spec)], writes=[out_path], hide=[workdir])
        sb.give(out_path, cmd.uid)
    except (sb.SandboxUnavailable, ValueError, OSError) as e:
        return {**base, "status": CRASHED, "reason": f"not started: {e}"}
    t_start = time.monotonic()
    with open(err_path, "wb") as err:
        proc = sb.Process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    try:
        return _drive(proc, spec, base, timeout_s, t_start, timing_lock, out_path, err_path)
    finally:
        proc.kill()  # whatever it left running: the whole sandbox
        shutil.rmtree(folder / "xla", ignore_errors=True)  # sandbox=none: its own compile cache


def _drive(proc: sb.Process, spec: dict, base: dict, timeout_s: float, t_start: float, timing_lock: str | None,
           out_path: Path, err_path: Path) -> dict:
    """The evaluator's side of the protocol: ready, one go/done per timed repeat (timed here), end."""
    chan = Channel(proc.proc, t_start + timeout_s)
    walls = []
    try:
        line = chan.readline()
        if line is None or not line.startswith("ready"):
            proc.proc.wait(timeout=max(1.0, chan.deadline - time.monotonic()))
            status, reason = failure(proc, err_path, CRASHED)
            return {**base, "status": status, "reason": f"before ready: {reason}"}
        waited = time.monotonic()
        base = {**base, "ready_s": waited - t_start}  # process start, deployment, compiles, warm-up
        with timing_lock_held(timing_lock):
            chan.deadline += time.monotonic() - waited
            for _ in range(0 if base["stage"] == "check" else int(spec.get("repeats", 1))):
                t0 = time.perf_counter()
                chan.send("go")
                line = chan.readline()
                walls.append(time.perf_counter() - t0)
                if line != "done":
                    proc.proc.wait(timeout=max(1.0, chan.deadline - time.monotonic()))
                    status, reason = failure(proc, err_path, CRASHED)
                    return {**base, "status": status, "reason": f"during timed run {len(walls)}: {reason}"}
        chan.send("end")
        proc.proc.wait(timeout=max(1.0, chan.deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        proc.kill()
        return {**base, "status": TIMEOUT, "reason": f"no answer within {timeout_s:.0f} s", "wall_s": walls}
    except (BrokenPipeError, OSError):
        proc.kill()
        status, reason = failure(proc, err_path, CRASHED)
        return {**base, "status": status, "reason": reason, "wall_s": walls}
    if proc.returncode != 0 or out_path.stat().st_size == 0:
        status, reason = failure(proc, err_path, CRASHED)
        return {**base, "status": status, "reason": f"after the timed runs: {reason}", "wall_s": walls}
    try:
        out = json.loads(out_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return {**base, "status": BAD_OUTPUT, "reason": f"out.json is not JSON: {e}", "wall_s": walls}
    if not isinstance(out, dict):
        return {**base, "status": BAD_OUTPUT, "reason": "out.json is not a JSON object", "wall_s": walls}
    if base["stage"] == "check":
        return {**base, "status": OK, "reason": "", "checked": out.get("checked") or []}
    return {**base, **timing(walls, spec, out)}


class Evaluator:
    """A Dask cluster: one timing worker per device group (`groups`), or `workers` workers sharing the
    devices with `timing_slots` timing units each; plus `check_workers` CPU-only workers for checks.
    A local cluster listens on 127.0.0.1 only; `address` (an existing scheduler) elsewhere needs `tls`.
    `sandbox`: how candidates are isolated (`sandbox.MODES`), checked here before any cluster starts."""

    def __init__(self, workers: int = 2, *, timeout_s: float = 300.0, memory_mb: int | None = 4096,
                 workdir: str | Path, timing_slots: int = 1, address: str | None = None,
                 timing_lock: str | None = "specpilot-timing", groups: list[str] | None = None,
                 check_workers: int = 0, dask_log_level: str | int = "WARNING", sandbox: str = sb.BWRAP,
                 tls: TLSConf | dict | None = None):
        level = log_level(dask_log_level)
        sb.require(sandbox)  # no cluster, no candidate, on a host that cannot contain them
        sec = security(tls)
        if address:
            check_scheduler(address, sec)
        self.sandbox = sandbox
        set_dask_log_level(level)
        # local workers are processes spawned from this one: they inherit the level through the environment
        self._saved_env = os.environ.get(DASK_LOG_ENV)
        os.environ[DASK_LOG_ENV] = logging.getLevelName(level).lower()
        self.timeout_s, self.memory_mb, self.timing_lock = float(timeout_s), memory_mb, timing_lock
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.groups = [g for g in (groups or []) if parse_group(g)] or None
        self.checks = int(check_workers)
        if address:  # an existing scheduler (SPECPILOT_DEVICE_GROUP=gpu:0 dask-worker --resources device_group=1)
            self.cluster, self.client = None, Client(address, security=sec)
        else:
            self.cluster = _cluster(self.groups, int(workers), int(timing_slots), self.checks, level)
            self.client = Client(self.cluster)

    def evaluate(self, specs: Iterable[dict], progress: Callable[[dict], None] | None = None,
                 warm: bool = False) -> list[dict]:
        """Every spec's result, in the order given; `progress(result)` hears each as it finishes. `warm`:
        the plan-only specs run together in a timing worker's warm worker (`warm_pool`), timed in turn,
        the first of them kept loaded; the others each in a process of their own."""
        specs = list(specs)
        together = [i for i, s in enumerate(specs) if warm and warm_pool.plan_only(s)]
        kw = dict(timeout_s=self.timeout_s, memory_mb=self.memory_mb, workdir=str(self.workdir),
                  timing_lock=self.timing_lock, sandbox=self.sandbox, pure=False)
        futures = {}  # future -> the indices of the specs it answers
        if together:
            fut = self.client.submit(warm_pool.evaluate_warm, [specs[i] for i in together], resources={TIMING: 1},
                                     key=f"warm-{len(together)}-{time.monotonic_ns()}", **kw)
            futures[fut] = together
        for i, s in enumerate(specs):
            if i not in together:
                fut = self.client.submit(evaluate_candidate, s, resources={self._resource(s): 1},
                                         key=f"candidate-{i}-{s['name']}-{time.monotonic_ns()}", **kw)
                futures[fut] = [i]
        results: list[dict | None] = [None] * len(specs)
        for fut in as_completed(list(futures)):
            idx = futures[fut]
            try:
                got = fut.result()
            except Exception as e:  # the worker itself died: these candidates only
                got = [{"name": specs[i]["name"], "status": CRASHED, "reason": f"worker lost: {type(e).__name__}: {e}",
                        "wall_s": []} for i in idx]
            for i, res in zip(idx, got if isinstance(got, list) else [got]):
                results[i] = res
                if progress:
                    progress(res)
        return results  # type: ignore[return-value]

    def _resource(self, spec: dict) -> str:
        return CHECK if spec.get("stage") == "check" and self.checks else TIMING

    def close(self) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        if self._saved_env is None:
            os.environ.pop(DASK_LOG_ENV, None)
        else:
            os.environ[DASK_LOG_ENV] = self._saved_env

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cluster(groups: list[str] | None, workers: int, timing_slots: int, checks: int, level: int = logging.WARNING):
    """A local Dask cluster of worker processes (one thread each) on loopback, no dashboards: a timing
    worker per device group (its group in its environment), else `workers` timing workers; and `checks`
    CPU-only workers."""

    def worker(resources: dict, env: dict | None = None) -> dict:
        return {"cls": Nanny, "options": {"nthreads": 1, "memory_limit": 0, "resources": resources,
                                          "env": env or {}, "silence_logs": level, "host": LOOPBACK,
                                          "dashboard": False, "dashboard_address": f"{LOOPBACK}:0"}}

    if groups:
        specs = {f"group-{i}": worker({TIMING: 1}, {GROUP_ENV: g}) for i, g in enumerate(groups)}
    else:
        specs = {f"worker-{i}": worker({TIMING: timing_slots}) for i in range(workers)}
    specs.update({f"check-{i}": worker({CHECK: 1}, {GROUP_ENV: "cpu:"}) for i in range(checks)})
    # no dashboard, and the scheduler's HTTP server on a free loopback port: no "port 8787 in use" warning
    scheduler = {"cls": Scheduler, "options": {"host": LOOPBACK, "dashboard": False,
                                               "dashboard_address": f"{LOOPBACK}:0"}}
    return SpecCluster(workers=specs, scheduler=scheduler, silence_logs=level)
