"""The evaluator on Dask: a crash, a hang, an out-of-memory, a kill -9 or a lie lose that candidate only."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from agent_helpers import HONEST_PROGRAM

from specpilot.agent import evaluator as ev
from specpilot.agent import loop
from specpilot.harness import devices
from specpilot.sharding import MeshError, MeshShape

HONEST = HONEST_PROGRAM
BAD = {
    "crash": "raise RuntimeError('injected crash')",
    "hang": "import time\nprint('ready', flush=True)\ntime.sleep(1000)",
    "oom": "x = bytearray(3 * 2**30)",
    # jax's words for a Triton config over the H200's shared memory: a bad config, not memory running out
    "smem": "raise RuntimeError('RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 1064960, "
            "available: 232448')",
    "kill9": "import os, signal\nprint('ready', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)",
    "short": HONEST.replace('spec["new_tokens"]', '(spec["new_tokens"] - 1)'),
}


def _spec(name, program):
    return {"name": name, "program": str(program), "fields": {}, "config": {"bench": {"batch_size": 1}},
            "prompts": [[1, 2, 3], [4, 5, 6]], "new_tokens": 4, "repeats": 2}


def test_failures_are_isolated_and_named(tmp_path):
    programs = {}
    for name, body in {"honest": HONEST, **BAD}.items():
        programs[name] = tmp_path / f"{name}.py"
        programs[name].write_text(textwrap.dedent(body))
    with ev.Evaluator(2, timeout_s=8, memory_mb=1024, workdir=tmp_path / "work") as e:
        seen = []
        results = e.evaluate([_spec(n, p) for n, p in programs.items()], progress=seen.append)
        by = {r["name"]: r for r in results}
        assert [r["name"] for r in results] == list(programs)  # in the order given
        assert sorted(r["name"] for r in seen) == sorted(programs)  # each heard as it finished
        assert by["honest"]["status"] == ev.OK and len(by["honest"]["wall_s"]) == 2
        assert by["honest"]["s_per_token"] == sorted(by["honest"]["wall_s"])[0] / (2 * 4)
        assert by["crash"]["status"] == ev.CRASHED and "injected crash" in by["crash"]["reason"]
        assert by["hang"]["status"] == ev.TIMEOUT and "within 8 s" in by["hang"]["reason"]
        assert by["oom"]["status"] == ev.OOM and "MemoryError" in by["oom"]["reason"]
        assert by["smem"]["status"] == ev.CRASHED and "launch limits" in by["smem"]["reason"]
        assert by["kill9"]["status"] == ev.KILLED and "signal 9" in by["kill9"]["reason"]
        assert by["short"]["status"] == ev.BAD_OUTPUT and "2 x 4 tokens" in by["short"]["reason"]
        # the cluster still evaluates after all that
        again = e.evaluate([_spec("honest2", programs["honest"])])
        assert again[0]["status"] == ev.OK


SLOW = """
import json, sys, time
spec = json.load(open(sys.argv[1]))
print("ready", flush=True)
spans = []
for line in sys.stdin:
    if line.strip() == "end":
        break
    t0 = time.time()
    time.sleep(0.4)
    spans.append((t0, time.time()))
    print("done", flush=True)
tokens = [[[0] * spec["new_tokens"] for _ in spec["prompts"]] for _ in spans]
json.dump({"tokens": tokens, "spans": spans}, open(sys.argv[2], "w"))
"""


def test_candidates_sharing_a_device_are_timed_one_at_a_time(tmp_path):
    program = tmp_path / "slow.py"
    program.write_text(SLOW)
    with ev.Evaluator(2, timeout_s=30, memory_mb=1024, workdir=tmp_path / "work") as e:
        results = e.evaluate([_spec(f"slow{i}", program) for i in range(2)])
    assert all(r["status"] == ev.OK for r in results)
    spans = []
    for r in results:
        out = json.loads((Path(r["folder"]) / "out.json").read_text())
        spans.append((out["spans"][0][0], out["spans"][-1][1]))  # first go .. last done
    (a0, a1), (b0, b1) = sorted(spans)
    assert a1 <= b0  # the second candidate's timed runs start after the first's end


GROUPED = """
import json, os, sys, time
import jax
spec = json.load(open(sys.argv[1]))
print("ready", flush=True)
spans = []
for line in sys.stdin:
    if line.strip() == "end":
        break
    t0 = time.time()
    time.sleep(0.2)
    spans.append((t0, time.time()))
    print("done", flush=True)
tokens = [[[0] * spec["new_tokens"] for _ in spec["prompts"]] for _ in spans]
json.dump({"tokens": tokens, "spans": spans, "devices": jax.device_count(), "platform": jax.default_backend(),
           "group": os.environ.get("SPECPILOT_DEVICE_GROUP"),
           "nanny_env": {k: os.environ.get(k) for k in ("MALLOC_TRIM_THRESHOLD_", "OMP_NUM_THREADS")}},
          open(sys.argv[2], "w"))
"""


def test_device_groups_of_a_mesh_and_their_environment():
    assert ev.device_group_labels(MeshShape(1, 2), list(range(5))) == ["cpu:0,1", "cpu:2,3"]  # 4 is left over
    assert ev.group_env("gpu:2,3")["CUDA_VISIBLE_DEVICES"] == "2,3"
    env = ev.group_env("cpu:4,5,6")
    assert env["JAX_PLATFORMS"] == "cpu" and "--xla_force_host_platform_device_count=3" in env["XLA_FLAGS"]
    assert ev.group_env(None) == {}
    for bad in ("tpu:0", "gpu:", "gpu:a"):
        try:
            ev.group_env(bad)
        except ValueError as e:
            assert "SPECPILOT_DEVICE_GROUP" in str(e) or "GPU group" in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    try:
        ev.device_group_labels(MeshShape(2, 2), list(range(3)))
    except MeshError as e:
        assert "needs 4 devices" in str(e)
    else:
        raise AssertionError("a mesh larger than the devices was accepted")


def test_each_candidate_sees_only_its_group(tmp_path):
    """Four simulated CPU devices in groups of two (a 1x2 mesh): two timing workers, each candidate process
    sees its group's two devices, and a check stage runs on a CPU-only worker."""
    program = tmp_path / "grouped.py"
    program.write_text(GROUPED)
    groups = ev.device_group_labels(MeshShape(1, 2), list(range(4)))
    with ev.Evaluator(timeout_s=60, memory_mb=None, workdir=tmp_path / "work", groups=groups,
                      check_workers=1) as e:
        assert sorted(w["resources"].get(ev.TIMING, 0) for w in e.client.scheduler_info()["workers"].values()) \
            == [0, 1, 1]
        specs = [_spec(f"g{i}", program) for i in range(4)] + [{**_spec("check", program), "stage": "check"}]
        results = e.evaluate(specs)
    assert all(r["status"] == ev.OK for r in results), [r["reason"] for r in results]
    outs = [json.loads((Path(r["folder"]) / "out.json").read_text()) for r in results]
    assert [o["devices"] for o in outs[:4]] == [2, 2, 2, 2] and {o["platform"] for o in outs} == {"cpu"}
    assert {o["group"] for o in outs[:4]} == set(groups)  # both groups ran candidates
    assert outs[4]["group"] == "cpu:" and outs[4]["devices"] == 1 and results[4]["group"] == "cpu:"
    # the nannies set MALLOC_TRIM_THRESHOLD_ and OMP_NUM_THREADS in their workers; no candidate inherits them
    assert all(o["nanny_env"] == {"MALLOC_TRIM_THRESHOLD_": None, "OMP_NUM_THREADS": None} for o in outs)
    assert outs[4]["spans"] == []  # a check stage has no timed runs
    spans = sorted((o["spans"][0][0], o["spans"][-1][1]) for o in outs[:4])
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))  # one shared CPU: timed one at a time


def test_a_candidate_runs_without_what_the_nanny_injected_or_any_secret():
    injected = ev.nanny_injected()
    assert injected.get("MALLOC_TRIM_THRESHOLD_") == "65536"  # Dask's default, which slowed CPU steps 4x
    base = {"PATH": "/opt/private/bin", "MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "4",
            "OPENAI_API_KEY": "sk-test", "XLA_FLAGS": "--xla_dump_to=/x", "JAX_TOKEN": "t", "HOME": "/root"}
    env = ev.candidate_env("cpu:0", base)
    assert "MALLOC_TRIM_THRESHOLD_" not in env  # the nanny's value: dropped
    assert env["OMP_NUM_THREADS"] == "4"  # not the nanny's value (1): the user's own setting stays
    assert "OPENAI_API_KEY" not in env and "JAX_TOKEN" not in env  # built from scratch: no credential
    assert "/opt/private/bin" not in env["PATH"] and env["HOME"] == "/tmp" and env["TMPDIR"] == "/tmp"
    assert env["PYTHONUNBUFFERED"] == "1" and env["JAX_PLATFORMS"] == "cpu"
    assert "--xla_dump_to=/x" in env["XLA_FLAGS"] and "device_count=1" in env["XLA_FLAGS"]


def test_processes_sharing_a_gpu_allocate_as_they_go_unless_the_user_chose():
    # the loop's driver holds the gate's deployment on the GPU its workers time candidates on: with each
    # reserving 75% up front, the second process would get only what the first left
    env = {"PATH": "/usr/bin"}
    assert devices.share_gpu_memory(env) and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert ev.candidate_env("gpu:0", env)["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # inherited
    for var, value in (("XLA_PYTHON_CLIENT_MEM_FRACTION", ".3"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "true")):
        mine = {var: value}
        assert not devices.share_gpu_memory(mine) and mine == {var: value}
        assert ev.candidate_env("gpu:0", mine)[var] == value


def test_the_driver_alone_starts_with_the_returning_allocator():
    # the driver's pooled memory (its references' buffers) is what its workers' compiles then lack; its
    # workers and candidates, which time, keep the pooling allocator
    probe = ("import os, subprocess, sys\n"
             "from specpilot.harness import devices\n"
             "seen = {}\n"
             "import jax._src.xla_bridge as xb\n"
             "make = xb.backends\n"
             "def spy():\n"
             "    seen.setdefault('allocator', os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR'))\n"
             "    return make()\n"
             "xb.backends = spy\n"
             "shared = devices.share_gpu_memory()\n"
             "print(shared, devices.start_backends_returning_memory(), seen.get('allocator'),\n"
             "      os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR'), devices.start_backends_returning_memory())\n"
             "child = 'import os; print(os.environ.get(\"XLA_PYTHON_CLIENT_ALLOCATOR\"))'\n"
             "print(subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout.strip())\n")
    env = {k: v for k, v in os.environ.items() if k not in devices.GPU_MEMORY_VARS}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["True", "True", "platform", "None", "False", "None"], out.stdout + out.stderr
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = ".5"  # the user's choice: nothing changes
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split()[:2] == ["False", "False"], out.stdout + out.stderr


def test_the_processes_the_driver_starts_pool_at_most_their_share():
    # a worker's pool grows to its limit and stays (61 GB of an 80 GB H100 at jax's 75%), leaving the
    # driver's scorer too little beside it
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    devices.cap_started_processes(None, env)
    assert env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    devices.cap_started_processes(0.55, env)
    assert ev.candidate_env("gpu:0", env)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.55"  # inherited
    assert loop.agent_conf({"worker_gpu_fraction": 0.55}).worker_gpu_fraction == 0.55
    with pytest.raises(ValueError, match=r"agent.worker_gpu_fraction: must be in \(0, 1\), got 1.5"):
        loop.agent_conf({"worker_gpu_fraction": 1.5})


def test_the_cheap_stage_ranks_by_the_candidates_decode_time():
    """A short run's wall time is mostly prefill; the pruner ranks by the candidate's own decode time per
    decoded token (median over runs), and a report it cannot read gives None (the wall time is used)."""
    spec = {"prompts": [[1, 2]], "new_tokens": 3, "config": {"bench": {"batch_size": 1}}}
    out = {"tokens": [[[5, 6, 7]]] * 3, "decode_s": [0.4, 0.2, 0.3], "decode_tokens": [2, 2, 2]}
    res = ev.timing([1.0, 1.2, 1.1], spec, out)
    assert res["s_per_token"] == pytest.approx(1.1 / 3) and res["decode_s_per_token"] == pytest.approx(0.15)
    assert ev.self_reported_decode({"decode_s": ["x"], "decode_tokens": [2]}) is None
    assert ev.self_reported_decode({}) is None and ev.self_reported_decode({"decode_s": [0.0], "decode_tokens": [2]}) is None
