"""Writers killed at random points: each writer runs in a child process that is sent SIGKILL at its N-th
function call, killed by the kernel in the middle of the write that takes a file past N bytes, or has that
write fail as on a full disk (`fault_hooks`). Then a later run reads the output as the project does and
must get the complete old version, the complete new one, or rebuild it: it never raises and never returns
partial data, and a second read finds the cache whole (no warning).

The default suite kills the writers that need no jax at a few points; `-m slow` adds the writers of
weights, exports and training state and more points."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import fault_writers_data
import fault_writers_models
from specpilot import atomic_io

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _child(script: Path, name: str, folder: Path, mode: str, n: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)]), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(script), name, str(folder), "1", mode, str(n)],
                          capture_output=True, text=True, env=env, timeout=600)


def _largest_file(output: Path) -> int:
    files = [output] if output.is_file() else [p for p in output.rglob("*") if p.is_file()]
    return max((p.stat().st_size for p in files), default=1)


def _kill_points(script: Path, scenarios: dict, name: str, tmp_path: Path, picks: int, seed: int,
                 thorough: bool) -> list[tuple[str, int]]:
    """(mode, N) points: `picks` call counts drawn over the whole write, and byte limits within its
    largest file (a kill at a third and two thirds and a full disk at half of it; `thorough` False: a
    kill and a full disk at half)."""
    probe = tmp_path / "probe"
    counted = _child(script, name, probe, "count", 0)
    assert counted.returncode == 0, counted.stderr[-3000:]
    calls = int(counted.stdout.split()[-1])
    rng = random.Random(seed)
    points = [("calls", rng.randint(1, max(1, calls * 9 // 10))) for _ in range(picks)]  # short of the end
    size = _largest_file(probe / scenarios[name].output)
    fractions = ((("kill-bytes", 1 / 3), ("kill-bytes", 2 / 3), ("full-bytes", 1 / 2)) if thorough
                 else (("kill-bytes", 1 / 2), ("full-bytes", 1 / 2)))
    return points + [(mode, max(1, int(size * f))) for mode, f in fractions]


def _exercise(script: Path, scenarios: dict, name: str, tmp_path: Path, picks: int, seed: int = 0,
              overwrite: bool = True, thorough: bool = True) -> None:
    scenario = scenarios[name]
    new = scenario.expected(tmp_path / "expected", 1)
    old = scenario.expected(tmp_path / "expected", 0) if overwrite else None
    exits = set()
    for i, (mode, n) in enumerate(_kill_points(script, scenarios, name, tmp_path, picks, seed, thorough)):
        for previous in ((False, True) if overwrite else (False,)):
            folder = tmp_path / f"case{i}-{mode}-{n}-{'over' if previous else 'fresh'}"
            folder.mkdir()
            if previous:  # a complete older version is there when the writer is killed
                scenario.prepare(folder, 0)
                scenario.write(folder, 0)
            proc = _child(script, name, folder, mode, n)
            if mode != "full-bytes":
                assert proc.returncode in (0, -signal.SIGKILL, -signal.SIGXFSZ), proc.stderr[-3000:]
            exits.add((mode, proc.returncode))
            where = f"{name} {mode}={n}{' over an older version' if previous else ''}: exit {proc.returncode}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", atomic_io.CacheRebuildWarning)
                got = scenario.read(folder, 1)  # never raises
            assert got == new or (previous and got == old), f"{where}: a later run read partial data"
            with warnings.catch_warnings():
                warnings.simplefilter("error", atomic_io.CacheRebuildWarning)
                assert scenario.read(folder, 1) == got, where  # whole now: read again, no rebuild
    # the points did kill the writer mid-way (a write that finished first would test nothing)
    assert ("calls", -signal.SIGKILL) in exits and ("kill-bytes", -signal.SIGXFSZ) in exits, exits


DATA, MODELS = TESTS / "fault_writers_data.py", TESTS / "fault_writers_models.py"


@pytest.mark.parametrize("name", sorted(fault_writers_data.SCENARIOS))
def test_a_killed_data_writer_leaves_a_whole_cache_or_none(name, tmp_path):
    _exercise(DATA, fault_writers_data.SCENARIOS, name, tmp_path, picks=1, thorough=False)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(fault_writers_data.SCENARIOS))
def test_a_data_writer_killed_at_many_points(name, seed, tmp_path):
    _exercise(DATA, fault_writers_data.SCENARIOS, name, tmp_path, picks=6, seed=seed)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(fault_writers_models.SCENARIOS))
def test_a_killed_weights_or_training_writer_leaves_a_whole_output_or_none(name, tmp_path):
    _exercise(MODELS, fault_writers_models.SCENARIOS, name, tmp_path, picks=3,
              overwrite=name != "training")  # a run's settings are fixed: no older version to keep
