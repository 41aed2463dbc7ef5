"""The sandbox every piece of proposed code runs in: the command line and environment of a process with no
network, a read-only view of the file system but for a size-capped scratch folder, the evaluator's
folders hidden, no secrets, an unprivileged uid, limits on memory, processes, open files, file size and
CPU time, and a PID namespace so that ending it ends everything it started (bubblewrap). Design notes:
docs/design/agent.md; what it guarantees: the README's "What the sandbox guarantees".
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pallas_kernels
import specpilot

log = logging.getLogger(__name__)

BWRAP, NONE = "bwrap", "none"
MODES = (BWRAP, NONE)
SCRATCH = "/tmp"  # inside the sandbox: HOME, TMPDIR, the compile cache; a tmpfs of `Limits.scratch_mb`
UID_BASE, UID_SPAN = 2 ** 30, 2 ** 20  # each sandbox a uid of its own: RLIMIT_NPROC counts only its tasks
FIX = ("install bubblewrap (`apt-get install bubblewrap`; `make install` does it) on a host that allows "
       "namespaces, or set {key}=none to run proposed code unsandboxed knowingly")
# variables a candidate may inherit (device selection, XLA/JAX flags, thread counts), never one that looks
# like a credential; everything else (the LLM key named by agent.llm.api_key_env included) stays outside
PASSED = ("JAX_", "XLA_", "TF_CPP_", "CUDA_", "NVIDIA_", "NCCL_", "OMP_", "MKL_", "OPENBLAS_", "LD_LIBRARY_PATH",
          "LANG", "LC_ALL", "TZ", "PYTHONHASHSEED", "SPECPILOT_DEVICE_GROUP")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSW", "CREDENTIAL", "AUTH")

# Runs first inside the sandbox: the resource limits, then exec of the real command (a preexec_fn would
# make Popen fork a multithreaded parent, e.g. a driver that has started jax).
PRELUDE = ("import json, os, resource, sys\n"
           "for name, value in json.loads(sys.argv[1]).items():\n"
           "    resource.setrlimit(getattr(resource, name), (value, value))\n"
           "os.execv(sys.argv[2], sys.argv[2:])\n")


class SandboxUnavailable(RuntimeError):
    """agent.sandbox=bwrap on a host that cannot provide it (the message names the fix)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one sandboxed process may use (`memory_mb` None or 0: no address-space limit)."""

    memory_mb: int | None = 4096  # RLIMIT_AS
    cpu_s: int = 3600  # RLIMIT_CPU: CPU seconds, all threads together
    processes: int = 256 + 16 * (os.cpu_count() or 1)  # RLIMIT_NPROC: tasks (threads count), this uid
    open_files: int = 4096  # RLIMIT_NOFILE
    file_mb: int = 256  # RLIMIT_FSIZE: the largest file it may write (out.json and stderr too)
    scratch_mb: int = 1024  # its tmpfs: HOME, TMPDIR, its own XLA compile cache

    @classmethod
    def for_deadline(cls, timeout_s: float, memory_mb: int | None, **kw) -> "Limits":
        """CPU time to match a wall-clock deadline on every core, plus a minute."""
        return cls(memory_mb=memory_mb, cpu_s=int(timeout_s * (os.cpu_count() or 1)) + 60, **kw)

    def rlimits(self) -> dict:
        out = {"RLIMIT_CPU": self.cpu_s, "RLIMIT_NPROC": self.processes, "RLIMIT_NOFILE": self.open_files,
               "RLIMIT_FSIZE": self.file_mb * 2 ** 20}
        if self.memory_mb:
            out["RLIMIT_AS"] = int(self.memory_mb) * 2 ** 20
        return out


def check_mode(mode: str, key: str = "agent.sandbox") -> str:
    if mode not in MODES:
        raise ValueError(f"{key}: {mode!r} is not one of {', '.join(MODES)}")
    return mode


def project_roots() -> list[str]:
    """The folders the project's packages import from (PYTHONPATH inside the sandbox)."""
    return sorted({str(Path(m.__file__).resolve().parents[1]) for m in (specpilot, pallas_kernels)})


def minimal_env(extra: dict, base: dict | None = None, scratch: str = SCRATCH) -> dict:
    """A process's environment built from scratch: PATH, HOME and TMPDIR in its scratch, the project on
    PYTHONPATH (then `base`'s own PYTHONPATH: packages installed with --target import from there), the
    device and XLA variables of `base` (default os.environ) that name no credential, and
    `extra` (its device group's) on top."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items()
           if k.startswith(PASSED) and not any(w in k.upper() for w in SECRET_WORDS)}
    env.update(PATH=os.pathsep.join(dict.fromkeys([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin",
                                                   "/bin"])),
               HOME=scratch, TMPDIR=scratch, USER="sandbox", LOGNAME="sandbox", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(dict.fromkeys(
                   project_roots() + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p])))
    return {**env, **extra}


def _hidden_ancestor(path: Path) -> Path | None:
    """The outermost folder above `path` that others may not enter (a home folder), else None."""
    for parent in reversed(path.parents):
        try:
            if not parent.stat().st_mode & stat.S_IXOTH:
                return parent
        except OSError:
            return None
    return None


def _under(path: Path, folders) -> bool:
    return any(path == f or f in path.parents for f in folders)


@dataclasses.dataclass
class Command:
    argv: list[str]
    env: dict
    uid: int | None  # the uid the process runs as (files it must write are given to it), None: ours


def command(argv: list[str], *, mode: str, limits: Limits, env: dict, reads=(), writes=(),
            hide=(), python: str = sys.executable) -> Command:
    """The command line running `argv` in the sandbox (`mode` bwrap) or only under `limits` (none).
    `reads`: files and folders it must see (bound read-only where they would be hidden); `writes`: files it
    may write (bound read-write; give them to `Command.uid` first); `hide`: folders it must not see (the
    evaluator's workdir), besides /tmp and any folder others may not enter."""
    limited = [python, "-c", PRELUDE, json.dumps(limits.rlimits()), *argv]
    if check_mode(mode) == NONE:
        return Command(limited, env, None)
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    reads = [Path(p).resolve() for p in [*reads, sys.prefix, sys.base_prefix, Path(python).resolve().parent,
                                         *project_roots()] if Path(p).exists()]
    writes = [Path(p).resolve() for p in writes]
    hidden = {Path(SCRATCH)} | {Path(h).resolve() for h in hide}
    hidden |= {a for a in (_hidden_ancestor(p) for p in reads + writes) if a is not None}
    hidden = sorted(h for h in hidden if not _under(h, hidden - {h}))  # the outermost only
    uid = UID_BASE + secrets.randbelow(UID_SPAN)
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev"]
    for dev in sorted(glob.glob("/dev/nvidia*")):  # GPU groups: the driver's device files
        args += ["--dev-bind", dev, dev]
    args += ["--perms", "1777", "--size", str(2 ** 20), "--tmpfs", "/dev/shm", "--proc", "/proc"]
    for h in hidden:
        if h == Path(SCRATCH):
            args += ["--perms", "1777", "--size", str(limits.scratch_mb * 2 ** 20), "--tmpfs", SCRATCH]
        else:
            args += ["--tmpfs", str(h)]
    reads = sorted({p for p in reads if _under(p, hidden)})
    reads = [p for p in reads if not _under(p, set(reads) - {p})]  # inside another bound folder: bound with it
    made: set = set()
    for p, how in [(p, "--ro-bind") for p in reads] + [(p, "--bind") for p in writes]:
        top = next((h for h in hidden if _under(p, [h])), None)
        for parent in reversed(p.parents):  # folders bwrap would otherwise make private (0700)
            if top is not None and top in parent.parents and parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", str(parent)]
        args += [how, str(p), str(p)]
    args += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
             "--die-with-parent", "--new-session", "--clearenv", "--chdir", SCRATCH]
    for k, v in env.items():
        args += ["--setenv", k, str(v)]
    if os.geteuid() == 0:  # bwrap keeps no user namespace; setpriv drops to the sandbox's own uid inside
        args += ["--cap-add", "CAP_SETUID,CAP_SETGID", "--", shutil.which("setpriv") or "setpriv",
                 f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--inh-caps=-all",
                 "--bounding-set=-all"]
    else:  # an unprivileged bwrap: a user namespace, mapped to our own uid
        uid = None
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns", "--"]
    return Command(args + limited, env, uid)


def give(path: Path, uid: int | None) -> None:
    """Let the sandbox's uid write `path` (an existing file)."""
    if uid is not None:
        os.chown(path, uid, uid)


def _uid_alive(uid: int) -> bool:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        uids = next((ln.split()[1:] for ln in text.splitlines() if ln.startswith("Uid:")), [])
        state = next((ln.split()[1] for ln in text.splitlines() if ln.startswith("State:")), "")
        if str(uid) in uids and state not in ("Z", "X"):
            return True
    return False


class Process:
    """A started sandboxed command, ended with its whole process tree by `kill`; `returncode` is the
    command's (negative: the signal that ended it), whether bwrap ran it or not."""

    def __init__(self, cmd: Command, **popen):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd.argv, env=cmd.env, start_new_session=True, **popen)

    @property
    def returncode(self) -> int | None:
        rc = self.proc.returncode
        if rc is not None and self.cmd.argv[0].endswith("bwrap") and 128 < rc < 128 + 65:
            return -(rc - 128)  # bwrap exits 128 + the signal that ended its command
        return rc

    def kill(self) -> None:
        """SIGKILL to its session, and wait: bwrap's PID namespace dies with it (--die-with-parent), and
        with the namespace's first process every process in it, a child that called setsid too."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        if self.cmd.uid is not None:  # the namespace's teardown is asynchronous: wait for its last process
            end = time.monotonic() + 10.0
            while _uid_alive(self.cmd.uid) and time.monotonic() < end:
                time.sleep(0.05)


@functools.lru_cache(maxsize=None)
def _probe(python: str) -> str | None:
    """Why a sandboxed `python` cannot run here, or None when it can."""
    try:
        cmd = command([python, "-c", "print('sandboxed')"], mode=BWRAP, limits=Limits(memory_mb=None),
                      env=minimal_env({}), python=python)
    except SandboxUnavailable as e:
        return str(e)
    try:
        done = subprocess.run(cmd.argv, env=cmd.env, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    if done.returncode != 0 or done.stdout.strip() != "sandboxed":
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return f"a probe run failed: {last}"
    return None


_warned: set = set()


def require(mode: str, key: str = "agent.sandbox", python: str = sys.executable) -> None:
    """SandboxUnavailable (one line naming the fix) when `mode` is bwrap and this host cannot run a
    sandboxed process; a warning, once per process, for none."""
    if check_mode(mode, key) == NONE:
        if key not in _warned:
            _warned.add(key)
            log.warning("%s=none: proposed code runs without the sandbox (network, files, secrets reachable)",
                        key)
        return
    why = _probe(python)
    if why is not None:
        raise SandboxUnavailable(f"{key}=bwrap: cannot run proposed code in a sandbox on this host ({why}); "
                                 + FIX.format(key=key))
