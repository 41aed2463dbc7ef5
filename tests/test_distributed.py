"""Multi-host decoding: two processes joined by jax.distributed (the run config's `distributed` block),
a tensor-parallel mesh spanning them, tokens equal to one device's (tests/distributed_worker.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from specpilot.harness import devices

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_decode_sharded_as_one_device(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "XLA_FLAGS": "",
           "JAX_PLATFORMS": "cpu"}
    outs = [tmp_path / f"out{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed_worker.py"), str(i), str(port),
                               str(outs[i])], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-2000:] for log in logs)
    for out in outs:
        got = json.loads(out.read_text())
        assert got["processes"] == 2 and got["devices"] == 2  # one CPU device per process, both in the mesh
        assert got["ar"] == got["reference"] and got["chain"] == got["reference"]


def test_incomplete_distributed_config_fails_naming_the_keys():
    from omegaconf import OmegaConf

    dist = OmegaConf.create({"enabled": True, "auto": False, "coordinator_address": "localhost:1",
                             "num_processes": None, "process_id": None, "local_device_ids": None})
    with pytest.raises(devices.DeviceSetupError, match="distributed.num_processes, distributed.process_id"):
        devices.initialize_distributed(dist)
    bad = OmegaConf.merge(dist, {"num_processes": 2, "process_id": 2})
    with pytest.raises(devices.DeviceSetupError, match=r"process_id=2 is not in 0..1"):
        devices.initialize_distributed(bad)


@pytest.mark.slow
def test_run_entry_point_over_two_processes(tmp_path):
    """`experiments/run.py` with the `distributed` block on two processes: sharded plans span both,
    token forcing is clean, and only process 0 writes results (~2 min on 2 cores)."""
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    common = ["target=tiny_random", "drafter=oracle", "drafter.num_layers=1", "drafter.block_size=4",
              "drafter.tau=2.5", "decoding=sharded", "bench=default", "bench.num_prompts=2", "bench.new_tokens=12",
              "decoding.profile_split=false", "distributed.enabled=true",
              f"distributed.coordinator_address=localhost:{port}", "distributed.num_processes=2"]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "experiments" / "run.py"), *common,
                               f"distributed.process_id={i}", f"output_dir={tmp_path / f'out{i}'}",
                               f"hydra.run.dir={tmp_path / f'hydra{i}'}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-2000:] for log in logs)
    records = {r["method"]: r for r in map(json.loads, (tmp_path / "out0" / "results.jsonl").read_text().splitlines())}
    assert records["stock_tp2"]["mismatches"] == 0 and records["ar_tp2"]["mismatches"] == 0
    assert not (tmp_path / "out1" / "results.jsonl").exists()
