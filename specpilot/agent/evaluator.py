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
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import dask
import distributed  # noqa: F401  (registers the nanny's configuration with dask.config)
from dask.distributed import Client, Lock, Nanny, Scheduler, SpecCluster, as_completed, get_worker

from specpilot import sharding
from specpilot.agent import sandbox as sb
from specpilot.agent.cluster_security import TLSConf, check_scheduler, security

OK, CRASHED, TIMEOUT, OOM, KILLED, BAD_OUTPUT = "ok", "crashed", "timeout", "oom", "killed", "bad_output"
VARIANT_REJECTED = "variant_rejected"  # a kernel variant failed its reference check (or its source check)
TIMING, CHECK = "device_group", "cpu_check"  # worker resources: a timing job's group, a CPU check
GROUP_ENV = "SPECPILOT_DEVICE_GROUP"  # a worker's devices: "<platform>:<id>,<id>..."
OOM_MARKERS = ("MemoryError", "RESOURCE_EXHAUSTED", "std::bad_alloc", "Cannot allocate memory",
               "out of memory")
# RESOURCE_EXHAUSTED that is a kernel's launch limit, not memory running out: the config is invalid there
LAUNCH_LIMIT_MARKERS = ("Shared memory size limit exceeded", "out of resource: shared memory",
                        "registers exceeded")


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


class _Channel:
    """Line protocol with a child over its stdin/stdout, every read bounded by a deadline."""

    def __init__(self, proc: subprocess.Popen, deadline: float):
        self.proc, self.deadline, self.buf = proc, deadline, b""
        self.sel = selectors.DefaultSelector()
        self.sel.register(proc.stdout, selectors.EVENT_READ)

    def readline(self) -> str | None:
        """The next line, or None if the child closed its stdout; raises TimeoutError at the deadline."""
        while b"\n" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not self.sel.select(timeout=left):
                continue
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def send(self, line: str) -> None:
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()


def _tail(path: Path, size: int = 2000) -> str:
    """The end of a file that may be large (a candidate's stderr, capped by its file-size limit)."""
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode(errors="replace")


def _failure(proc: sb.Process, err_path: Path, default: str) -> tuple[str, str]:
    tail = _tail(err_path)
    rc = proc.returncode
    if rc is not None and rc < 0 and -rc == signal.SIGKILL:
        return KILLED, f"killed by signal 9{': ' + tail.splitlines()[-1] if tail.strip() else ''}"
    if rc is not None and rc < 0:
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        return default, f"killed by {name}{': ' + tail.strip().splitlines()[-1] if tail.strip() else ''}"
    if any(m in tail for m in LAUNCH_LIMIT_MARKERS):
        last = next(ln for ln in reversed(tail.splitlines()) if any(m in ln for m in LAUNCH_LIMIT_MARKERS))
        return default, f"a kernel exceeds the device's launch limits (exit {rc}): {last.strip()}"
    if any(m in tail for m in OOM_MARKERS):
        return OOM, f"out of memory (exit {rc}): {tail.strip().splitlines()[-1] if tail.strip() else ''}"
    last = tail.strip().splitlines()[-1] if tail.strip() else "no stderr"
    if rc == 3 and last.startswith("variant-rejected:"):
        return VARIANT_REJECTED, last[len("variant-rejected:"):].strip()
    return default, f"exit {rc}: {last}"


def group_label(platform: str, ids: Iterable[int]) -> str:
    """The name of a device group: "gpu:0,1" (device ids), "cpu:0,1" (simulated CPU devices), "cpu:" (none)."""
    if platform not in ("gpu", "cpu"):
        raise ValueError(f"device groups are GPUs or CPU devices, not {platform!r}")
    return f"{platform}:{','.join(str(int(i)) for i in ids)}"


def parse_group(label: str) -> tuple[str, list[int]]:
    platform, sep, ids = label.partition(":")
    if not sep or platform not in ("gpu", "cpu"):
        raise ValueError(f"{GROUP_ENV}={label!r}: expected '<gpu|cpu>:<id>,<id>...'")
    try:
        return platform, [int(i) for i in ids.split(",") if i.strip()]
    except ValueError:
        raise ValueError(f"{GROUP_ENV}={label!r}: device ids must be integers") from None


def group_env(label: str | None, base: dict | None = None) -> dict:
    """The variables a candidate process of group `label` runs with: only its devices visible (a CPU
    group's device count joins `base`'s XLA_FLAGS, default os.environ's)."""
    if not label:
        return {}
    platform, ids = parse_group(label)
    env = {GROUP_ENV: label}
    if platform == "gpu":
        if not ids:
            raise ValueError(f"{GROUP_ENV}={label!r}: a GPU group names at least one device")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
        return env
    flags = [f for f in (os.environ if base is None else base).get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
               XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={max(1, len(ids))}"]))
    return env


def nanny_injected() -> dict:
    """The variables a Dask nanny sets in its worker's environment (`distributed.nanny.pre-spawn-environ`:
    MALLOC_TRIM_THRESHOLD_=65536 and one thread for OpenMP, MKL and OpenBLAS by default)."""
    return {k: str(v) for k, v in (dask.config.get("distributed.nanny.pre-spawn-environ") or {}).items()}


def candidate_env(group: str | None, base: dict | None = None) -> dict:
    """The environment of a candidate process, built from scratch (`sandbox.minimal_env`): from its worker's
    (`base`, default os.environ) only device and XLA variables, less what the Dask nanny injected (a
    variable still holding the value the nanny sets), plus its device group's. A candidate is timed in
    the environment a deployment runs in: measured on the CPU, the nanny's MALLOC_TRIM_THRESHOLD_ made a
    stock step of the default deployment 4.3x slower (decode 4.2 s vs 0.97 s)."""
    env = dict(os.environ if base is None else base)
    for key, value in nanny_injected().items():
        if env.get(key) == value:
            del env[key]
    return sb.minimal_env(group_env(group, env), env)


def device_group_labels(mesh, devices) -> list[str]:
    """One label per group of `sharding.device_groups(mesh, devices)` (jax devices, or ints for ids)."""
    groups = sharding.device_groups(mesh, devices)
    platform = "cpu" if all(getattr(d, "platform", "cpu") == "cpu" for d in devices) else "gpu"
    return [group_label(platform, [getattr(d, "id", d) for d in g]) for g in groups]


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _timing_lock(name: str | None):
    """A cluster-wide lock around the timed runs (None, or outside a Dask worker: none)."""
    if not name:
        return _NoLock()
    try:
        get_worker()
    except ValueError:
        return _NoLock()
    return Lock(name)


def _prepared(spec: dict, mode: str, folder: Path) -> dict:
    """The spec as the sandboxed process reads it: fresh inputs for its variants' reference check, its own
    compile cache in its scratch (never the shared one), the cache folder as an absolute path (its HOME
    is its scratch)."""
    if spec.get("variants"):  # the reference check's inputs: fresh, drawn here, per candidate
        spec = {**spec, "variant_check": {**spec.get("variant_check", {}), "seed": secrets.randbits(63)}}
    if spec.get("compile_cache"):
        spec = {**spec, "compile_cache": f"{sb.SCRATCH}/xla" if mode == sb.BWRAP else str(folder / "xla")}
    if (spec.get("config") or {}).get("cache_dir"):
        spec = {**spec, "config": {**spec["config"], "cache_dir": str(Path(spec["config"]["cache_dir"]).expanduser())}}
    return spec


def _reads(spec: dict) -> list[str]:
    """What a candidate must see of the file system beyond the project and Python: its program, its
    variants' modules, the deployment's caches (weights, tokenizers; read-only)."""
    paths = [spec.get("program"), *[v.get("path") for v in spec.get("variants") or []],
             (spec.get("config") or {}).get("cache_dir")]
    return [p for p in paths if p and Path(p).exists()]


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
    spec = _prepared(spec, sandbox, folder)
    spec_path.write_text(json.dumps(spec, default=list))
    out_path.touch()
    program = spec.get("program")
    argv = [python, program] if program else [python, "-m", "specpilot.agent.candidate"]
    try:
        sb.require(sandbox, python=python)
        cmd = sb.command([*argv, str(spec_path), str(out_path)], mode=sandbox, python=python,
                         limits=sb.Limits.for_deadline(timeout_s, memory_mb), env=candidate_env(group),
                         reads=[spec_path, *_reads(spec)], writes=[out_path], hide=[workdir])
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
    chan = _Channel(proc.proc, t_start + timeout_s)
    walls = []
    try:
        line = chan.readline()
        if line is None or not line.startswith("ready"):
            proc.proc.wait(timeout=max(1.0, chan.deadline - time.monotonic()))
            status, reason = _failure(proc, err_path, CRASHED)
            return {**base, "status": status, "reason": f"before ready: {reason}"}
        waited = time.monotonic()
        with _timing_lock(timing_lock):
            chan.deadline += time.monotonic() - waited
            for _ in range(0 if base["stage"] == "check" else int(spec.get("repeats", 1))):
                t0 = time.perf_counter()
                chan.send("go")
                line = chan.readline()
                walls.append(time.perf_counter() - t0)
                if line != "done":
                    proc.proc.wait(timeout=max(1.0, chan.deadline - time.monotonic()))
                    status, reason = _failure(proc, err_path, CRASHED)
                    return {**base, "status": status, "reason": f"during timed run {len(walls)}: {reason}"}
        chan.send("end")
        proc.proc.wait(timeout=max(1.0, chan.deadline - time.monotonic()))
    except (TimeoutError, subprocess.TimeoutExpired):
        proc.kill()
        return {**base, "status": TIMEOUT, "reason": f"no answer within {timeout_s:.0f} s", "wall_s": walls}
    except (BrokenPipeError, OSError):
        proc.kill()
        status, reason = _failure(proc, err_path, CRASHED)
        return {**base, "status": status, "reason": reason, "wall_s": walls}
    if proc.returncode != 0 or out_path.stat().st_size == 0:
        status, reason = _failure(proc, err_path, CRASHED)
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


def timing(walls: list[float], spec: dict, out: dict) -> dict:
    """The evaluator's numbers for a finished candidate: its median wall time per output token (the
    output tokens the spec asked for), and its tokens and stats, checked for shape."""
    tokens = out.get("tokens") or []
    n_prompts, new = len(spec["prompts"]), int(spec["new_tokens"])
    if len(tokens) != len(walls) or any(len(t) != n_prompts or any(len(row) != new for row in t) for t in tokens):
        return {"status": BAD_OUTPUT, "reason": f"expected {len(walls)} timed runs of {n_prompts} x {new} tokens",
                "wall_s": walls}
    batch = int(spec["config"]["bench"]["batch_size"])
    output_tokens = (n_prompts // batch) * new  # per sequence, over the batches
    ordered = sorted(walls)
    median = ordered[(len(ordered) - 1) // 2]
    return {"status": OK, "reason": "", "wall_s": walls, "s_per_token": median / output_tokens,
            "decode_s_per_token": self_reported_decode(out),
            "spread": (ordered[-1] - ordered[0]) / median if median > 0 else 0.0,
            "tokens": tokens, "stats": out.get("stats") or {}, "self_reported_s": out.get("self_reported_s"),
            "plan": out.get("plan"), "checked": out.get("checked") or []}


def self_reported_decode(out: dict) -> float | None:
    """The candidate's own median decode seconds per decoded token (prefill left out), or None. Its own
    clock: used only to rank the cheap stage for pruning (a short run's wall time is mostly prefill),
    never by the gate, which times every accepted candidate itself."""
    try:
        per = sorted(float(s) / float(n) for s, n in zip(out.get("decode_s") or [], out.get("decode_tokens") or [])
                     if float(n) > 0)
    except (TypeError, ValueError):
        return None
    return per[(len(per) - 1) // 2] if per and per[0] > 0 else None


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

    def evaluate(self, specs: Iterable[dict], progress: Callable[[dict], None] | None = None) -> list[dict]:
        """Every spec's result, in the order given; `progress(result)` hears each as it finishes."""
        specs = list(specs)
        futures = [self.client.submit(evaluate_candidate, s, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                      workdir=str(self.workdir), timing_lock=self.timing_lock, sandbox=self.sandbox,
                                      resources={self._resource(s): 1}, pure=False,
                                      key=f"candidate-{i}-{s['name']}-{time.monotonic_ns()}")
                   for i, s in enumerate(specs)]
        index = {f.key: i for i, f in enumerate(futures)}
        results: list[dict | None] = [None] * len(specs)
        for fut in as_completed(futures):
            try:
                res = fut.result()
            except Exception as e:  # the worker itself died: this candidate only
                res = {"name": specs[index[fut.key]]["name"], "status": CRASHED,
                       "reason": f"worker lost: {type(e).__name__}: {e}", "wall_s": []}
            results[index[fut.key]] = res
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
