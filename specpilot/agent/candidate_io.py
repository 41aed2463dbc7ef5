"""A candidate process seen from the driver: the statuses its end is reported by, its environment (device
group, no secrets, nothing the Dask nanny injected), its line protocol with deadlines, how its failure is
read from its exit and stderr, and how its timed runs become the evaluator's numbers. Shared by the
one-process-per-candidate evaluator and the warm worker's pool. Design notes: docs/design/agent.md.
"""

from __future__ import annotations

import os
import secrets
import selectors
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

import dask
import distributed  # noqa: F401  (registers the nanny's configuration with dask.config)
from dask.distributed import Lock, get_worker

from specpilot import sharding
from specpilot.agent import sandbox as sb

OK, CRASHED, TIMEOUT, OOM, KILLED, BAD_OUTPUT = "ok", "crashed", "timeout", "oom", "killed", "bad_output"
VARIANT_REJECTED = "variant_rejected"  # a kernel variant failed its reference check (or its source check)
TIMING, CHECK = "device_group", "cpu_check"  # worker resources: a timing job's group, a CPU check
GROUP_ENV = "SPECPILOT_DEVICE_GROUP"  # a worker's devices: "<platform>:<id>,<id>..."
OOM_MARKERS = ("MemoryError", "RESOURCE_EXHAUSTED", "std::bad_alloc", "Cannot allocate memory",
               "out of memory")
# RESOURCE_EXHAUSTED that is a kernel's launch limit, not memory running out: the config is invalid there
LAUNCH_LIMIT_MARKERS = ("Shared memory size limit exceeded", "out of resource: shared memory",
                        "registers exceeded")


def out_of_memory(text: str) -> bool:
    """Whether an error's text says memory ran out (`OOM_MARKERS`, any case; not a kernel's launch limit)."""
    low = str(text).lower()
    return any(m.lower() in low for m in OOM_MARKERS) and not any(m in str(text) for m in LAUNCH_LIMIT_MARKERS)


class Channel:
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


def failure(proc: sb.Process, err_path: Path, default: str) -> tuple[str, str]:
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


def timing_lock_held(name: str | None):
    """A cluster-wide lock around the timed runs (None, or outside a Dask worker: none)."""
    if not name:
        return _NoLock()
    try:
        get_worker()
    except ValueError:
        return _NoLock()
    return Lock(name)


def prepared_spec(spec: dict, mode: str, folder: Path) -> dict:
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


def spec_reads(spec: dict) -> list[str]:
    """What a candidate must see of the file system beyond the project and Python: its program, its
    variants' modules, the deployment's caches (weights, tokenizers; read-only)."""
    paths = [spec.get("program"), *[v.get("path") for v in spec.get("variants") or []],
             (spec.get("config") or {}).get("cache_dir")]
    return [p for p in paths if p and Path(p).exists()]


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
