"""Plan-only candidates evaluated in a warm worker (`warm_worker`): one long-lived sandboxed process per
timing worker keeps the deployment and its compiled programs, so a candidate costs its own compiles and
runs, not a process start, a weight load and the incumbent's compiles again. The candidates of one call
are timed in turn, repeat by repeat (the order rotating), so a drift of the machine's speed falls on all
of them alike. A candidate that kills or hangs the worker loses alone: the worker restarts and the rest
run again. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specpilot.agent import candidate_io as ev
from specpilot.agent import sandbox as sb

log = logging.getLogger(__name__)

WARM_CPU_S = 7 * 24 * 3600  # RLIMIT_CPU of a worker that lives for a whole run; each answer has its deadline


def plan_only(spec: dict) -> bool:
    """Whether a spec may run in a warm worker: no kernel variants, no program of its own, not a check."""
    return not spec.get("variants") and not spec.get("program") and spec.get("stage") != "check"


class WorkerDied(RuntimeError):
    """The warm worker closed its output (it crashed or was killed)."""


class WarmProcess:
    """A started warm worker and its line protocol; every answer is awaited with a deadline."""

    def __init__(self, key: tuple, *, group: str | None, sandbox: str, memory_mb: int | None, python: str,
                 reads: list[str], workdir: str):
        self.key = key
        self.folder = Path(tempfile.mkdtemp(prefix="warm-", dir=workdir))
        self.err_path = self.folder / "stderr.txt"
        cmd = sb.command([python, "-m", "specpilot.agent.warm_worker"], mode=sandbox, python=python,
                         limits=sb.Limits(memory_mb=memory_mb, cpu_s=WARM_CPU_S), env=ev.candidate_env(group),
                         reads=reads, hide=[workdir])
        with open(self.err_path, "wb") as err:
            self.proc = sb.Process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        self.chan = ev.Channel(self.proc.proc, 0.0)
        self.pid: int | None = None  # the worker's own, from its ready line
        self.start_s: float | None = None  # from its start to its ready line (imports, no deployment)

    def ask(self, message: dict | None, timeout_s: float) -> dict:
        """The answer to `message` (None: the first line); TimeoutError past the deadline, WorkerDied when it
        ended."""
        self.chan.deadline = time.monotonic() + timeout_s
        try:
            if message is not None:
                self.chan.send(json.dumps(message, default=list))
            line = self.chan.readline()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(str(e)) from None
        if line is None:
            raise WorkerDied("it closed its output")
        return json.loads(line)

    def failure(self) -> tuple[str, str]:
        """(status, reason) of a worker that died or hung, once it is ended."""
        self.kill()
        return ev.failure(self.proc, self.err_path, ev.CRASHED)

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        try:
            self.chan.send(json.dumps({"cmd": "end"}))
            self.proc.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


_PROCESSES: dict[tuple, WarmProcess] = {}  # this process's warm worker (one at a time), by how it was started


def _close_all() -> None:
    for p in list(_PROCESSES.values()):
        p.close()
    _PROCESSES.clear()


atexit.register(_close_all)


def _process(key: tuple, timeout_s: float, **start) -> WarmProcess:
    """The warm worker started as `key` says, started (and its ready line awaited) when there is none."""
    proc = _PROCESSES.get(key)
    if proc is not None and proc.proc.proc.poll() is None:
        return proc
    _close_all()
    t0 = time.monotonic()
    proc = WarmProcess(key, **start)
    try:
        proc.pid = proc.ask(None, timeout_s)["ready"]
        proc.start_s = time.monotonic() - t0
    except (WorkerDied, TimeoutError, json.JSONDecodeError, KeyError, TypeError):
        status, reason = proc.failure()
        raise WorkerDied(f"{status}: {reason}") from None
    _PROCESSES[key] = proc
    return proc


def _discard(proc: WarmProcess) -> None:
    proc.kill()
    _PROCESSES.pop(proc.key, None)


def evaluate_warm(specs: list[dict], *, timeout_s: float, memory_mb: int | None, workdir: str,
                  python: str = sys.executable, timing_lock: str | None = None, group: str | None = None,
                  sandbox: str = sb.BWRAP) -> list[dict]:
    """Every plan-only spec's result (as `evaluator.evaluate_candidate` gives it), in order, from this
    process's warm worker (a Dask task; also callable directly). Never raises. `timeout_s` bounds each
    answer: a plan's build and warm-up, each timed run. The first spec's plan stays loaded afterwards (the
    incumbent); the others are dropped."""
    group = group if group is not None else os.environ.get(ev.GROUP_ENV) or None
    if group and ev.parse_group(group)[0] == "gpu":
        timing_lock = None
    Path(workdir).mkdir(parents=True, exist_ok=True)
    results: dict[int, dict] = {}
    for i, spec in enumerate(specs):
        if not plan_only(spec):
            results[i] = {**_base(spec, group, None), "status": ev.CRASHED,
                          "reason": "not plan-only: kernel variants and programs run in their own process"}
    while len(results) < len(specs):
        todo = [i for i in range(len(specs)) if i not in results]
        ready = [ev.prepared_spec(specs[i], sandbox, Path(workdir)) for i in todo]
        reads = sorted({r for s in ready for r in ev.spec_reads(s)})
        key = (group, sandbox, memory_mb, python, tuple(reads))
        try:
            sb.require(sandbox, python=python)
            proc = _process(key, timeout_s, group=group, sandbox=sandbox, memory_mb=memory_mb, python=python,
                            reads=reads, workdir=workdir)
        except (sb.SandboxUnavailable, ValueError, OSError, WorkerDied) as e:
            for i in todo:
                results[i] = {**_base(specs[i], group, None), "status": ev.CRASHED,
                              "reason": f"the warm worker did not start: {e}"}
            break
        _attempt(proc, dict(zip(todo, ready)), specs, results, timeout_s, timing_lock, group)
    return [results[i] for i in range(len(specs))]


def _base(spec: dict, group: str | None, folder: Path | None) -> dict:
    return {"name": spec["name"], "stage": spec.get("stage", "full"), "folder": str(folder) if folder else None,
            "wall_s": [], "group": group, "warm": True}


def _retry_fresh(proc: WarmProcess, started: float | None, error: str) -> bool:
    """Whether a worker kept from earlier calls ran out of memory: it holds what those calls compiled and
    kept, so it is discarded and this call's plans run again in a fresh one (a fresh worker's own out of
    memory is the candidate's failure)."""
    if started is not None or not ev.out_of_memory(error):
        return False
    log.warning("the warm worker ran out of memory with what earlier rounds left in it; starting a fresh one")
    _discard(proc)
    return True


def _attempt(proc: WarmProcess, ready: dict[int, dict], specs: list[dict], results: dict, timeout_s: float,
             timing_lock: str | None, group: str | None) -> None:
    """Load, time in turn and collect `ready` (index -> prepared spec) in one worker; a candidate that
    kills or hangs it gets its failure in `results`, and the worker is discarded (the caller runs the rest
    again in a new one)."""
    current = None
    started, proc.start_s = proc.start_s, None  # reported with the call that started it only
    base = {i: {**_base(specs[i], group, proc.folder), "worker_pid": proc.pid, "worker_start_s": started}
            for i in ready}
    try:
        loaded, ready_s = [], {}
        for i, spec in ready.items():
            current, t0 = i, time.monotonic()
            answer = proc.ask({"cmd": "load", "spec": spec}, timeout_s)
            if "error" in answer and _retry_fresh(proc, started, answer["error"]):
                return
            if "error" in answer:
                results[i] = {**base[i], "status": ev.CRASHED, "reason": f"before ready: {answer['error']}"}
                continue
            loaded.append(i)
            ready_s[i] = time.monotonic() - t0
            base[i]["deployment_built"] = bool(answer.get("built"))
        walls: dict[int, list[float]] = {i: [] for i in loaded}
        repeats = {i: int(specs[i].get("repeats", 1)) for i in loaded}
        with ev.timing_lock_held(timing_lock):
            for r in range(max(repeats.values(), default=0)):
                if not loaded:  # every plan failed in its timed runs
                    break
                turn = loaded[r % len(loaded):] + loaded[:r % len(loaded)]  # each plan first in turn
                for i in [i for i in turn if len(walls[i]) < repeats[i]]:
                    current, t0 = i, time.perf_counter()
                    answer = proc.ask({"cmd": "go", "name": specs[i]["name"]}, timeout_s)
                    walls[i].append(time.perf_counter() - t0)
                    if "error" in answer and _retry_fresh(proc, started, answer["error"]):
                        for j in ready:  # this call's plans all run again in a fresh worker
                            results.pop(j, None)
                        return
                    if "error" in answer:
                        results[i] = {**base[i], "status": ev.CRASHED, "wall_s": walls[i],
                                      "reason": f"during timed run {len(walls[i])}: {answer['error']}"}
                        loaded.remove(i)
        for i in loaded:
            current = i
            answer = proc.ask({"cmd": "result", "name": specs[i]["name"]}, timeout_s)
            if "result" not in answer:
                results[i] = {**base[i], "status": ev.BAD_OUTPUT, "wall_s": walls[i],
                              "reason": f"after the timed runs: {answer.get('error')}"}
                continue
            results[i] = {**base[i], "ready_s": ready_s[i], **ev.timing(walls[i], specs[i], answer["result"]),
                          "timed_compiles": answer["result"].get("timed_compiles")}
        current = None
        first = next(iter(ready))
        proc.ask({"cmd": "retain", "names": [specs[first]["name"]] if first in loaded else []}, timeout_s)
    except TimeoutError:
        proc.kill()
        if current is not None:
            results[current] = {**base[current], "status": ev.TIMEOUT, "reason": f"no answer within {timeout_s:.0f} s"}
        _discard(proc)
    except (WorkerDied, json.JSONDecodeError):
        status, reason = proc.failure()
        if current is not None:
            results[current] = {**base[current], "status": status, "reason": reason}
        _discard(proc)
