"""Kills a writer at a chosen point, for the fault-injection tests: run as the child process of
test_fault_injection.py by a scenario script (`main(SCENARIOS)`).

Modes: `calls` sends the process SIGKILL at the N-th call or return it makes (Python functions and C
functions alike, in every thread); `kill-bytes` lets no file grow past N bytes and restores SIGXFSZ's
default, so the kernel kills the process in the middle of the write that crosses N; `full-bytes` keeps
SIGXFSZ ignored (as Python starts), so that write fails with EFBIG as on a full disk. `count` runs the
writer whole and prints how many calls it made (the range `calls` draws from).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import threading
from pathlib import Path


class Scenario:
    """One writer and what a later run does with its output: `prepare` (unhooked set-up), `write` (the
    writer under test), `read` (a later run: use the output or rebuild it; returns comparable data) and
    `expected` (that data when version `version` was written whole). `output`: what `write` writes
    (a file or a folder under the scenario's folder)."""

    output = ""

    def prepare(self, folder: Path, version: int) -> None:
        pass

    def write(self, folder: Path, version: int) -> None:
        raise NotImplementedError

    def read(self, folder: Path, version: int):
        raise NotImplementedError

    def expected(self, folder: Path, version: int):
        raise NotImplementedError


def _kill_after(n: int):
    calls = [0]

    def hook(frame, event, arg):
        if event in ("call", "c_call"):
            calls[0] += 1
            if calls[0] >= n:
                os.kill(os.getpid(), signal.SIGKILL)
    return hook, calls


def main(scenarios: dict[str, Scenario]) -> None:
    name, folder, version = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    mode, n = sys.argv[4], int(sys.argv[5])
    scenario = scenarios[name]
    scenario.prepare(folder, version)
    if mode in ("calls", "count"):
        hook, calls = _kill_after(n if mode == "calls" else 1 << 62)
        threading.setprofile(hook)
        sys.setprofile(hook)
        scenario.write(folder, version)
        sys.setprofile(None)
        threading.setprofile(None)
        print(calls[0])
        return
    if mode == "kill-bytes":
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    elif mode != "full-bytes":
        raise SystemExit(f"unknown mode {mode}")
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    scenario.write(folder, version)
