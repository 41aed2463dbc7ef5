"""Devices before a run builds anything: simulated CPU devices, multi-host initialisation and how
processes sharing a GPU allocate its memory (all before jax starts its backends), the persistent compile
cache, and the check that the `gpu` config names the device jax sees (its rates, kernels and records are
that device's)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import jax
from jax._src import xla_bridge

from specpilot.harness.config_errors import ConfigValueError


class DeviceMismatchError(ConfigValueError):
    """The `gpu` config describes another device than the one jax sees."""


class DeviceSetupError(RuntimeError):
    """Devices were asked for after jax had created its backends, or a distributed set-up is incomplete."""


def _backends_started() -> bool:
    return bool(getattr(xla_bridge, "_backends", None))


# jax's allocator settings (XLA_CLIENT_MEM_FRACTION is the newer name of the fraction): a user who sets
# any of them chooses for every process
GPU_MEMORY_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
                   "XLA_PYTHON_CLIENT_ALLOCATOR")


def share_gpu_memory(environ=None) -> bool:
    """Let processes that share a GPU (the loop's driver, its warm workers and candidates) allocate as
    they go instead of each reserving 75% of it up front: the second process would otherwise get only
    what the first left, and its compiles, autotuning and kernel loads fail for want of memory (jax's
    GPU memory notes name concurrent processes as the common cause of OOM and this as a fix). Sets
    XLA_PYTHON_CLIENT_PREALLOCATE=false in `environ` (default os.environ: inherited by the processes
    started from here) unless one of GPU_MEMORY_VARS is set; True when it set it. Called before jax
    starts its backends, it covers this process too; after, only the processes it starts."""
    env = os.environ if environ is None else environ
    if any(k in env for k in GPU_MEMORY_VARS):
        return False
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return True


def cap_started_processes(fraction: float | None, environ=None) -> None:
    """Let each process started from here pool at most `fraction` of a GPU (XLA_PYTHON_CLIENT_MEM_FRACTION
    in `environ`, default os.environ, which they inherit); None leaves jax's default. Call it after this
    process's backends have started, so that the cap is theirs only."""
    if fraction is not None:
        (os.environ if environ is None else environ)["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{float(fraction):g}"


def start_backends_returning_memory() -> bool:
    """Start this process's jax backends with the platform allocator, which gives each freed buffer back
    to the device instead of keeping it in a pool, and leave the environment as it was, so that the
    processes started from here keep the pooling allocator. For the loop's driver: it holds the
    gate's deployment and runs the AR reference and the forcing scorer between rounds, times nothing, and
    a pool kept from those runs is memory its workers' compiles and autotuning then lack. Does nothing
    (False) when a GPU_MEMORY_VARS variable was set by the user or the backends have started."""
    env = os.environ
    if _backends_started() or env.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false" \
            or "XLA_PYTHON_CLIENT_ALLOCATOR" in env:
        return False
    env["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    try:
        jax.devices()  # the backends read the allocator now, once
    finally:
        del env["XLA_PYTHON_CLIENT_ALLOCATOR"]
    return True


def setup(cfg) -> None:
    """Apply `cfg.simulated_cpu_devices` and `cfg.distributed` (a typed run config)."""
    n = cfg.get("simulated_cpu_devices")
    dist = cfg.get("distributed")
    if n is None and not (dist and dist.enabled):
        return
    if _backends_started():
        if n is not None and jax.device_count("cpu") == int(n) and not (dist and dist.enabled):
            return  # a second run in the same process (a Hydra sweep) with the same devices
        raise DeviceSetupError("simulated_cpu_devices / distributed must be set before jax starts its "
                               "backends (something in this process already used a device)")
    if n is not None:
        jax.config.update("jax_num_cpu_devices", int(n))
    if dist and dist.enabled:
        initialize_distributed(dist)


def initialize_distributed(dist) -> None:
    """`jax.distributed.initialize` from a `distributed` config block (see `DistributedConf`). CPU
    devices of different processes exchange data through gloo (GPUs use NCCL; the setting is CPU-only)."""
    if not dist.auto:
        missing = [k for k in ("coordinator_address", "num_processes", "process_id") if dist.get(k) is None]
        if missing:
            raise DeviceSetupError("distributed.enabled without auto needs "
                                   + ", ".join("distributed." + k for k in missing))
        if not 0 <= int(dist.process_id) < int(dist.num_processes):
            raise DeviceSetupError(f"distributed.process_id={dist.process_id} is not in "
                                   f"0..{int(dist.num_processes) - 1}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if dist.auto:
        jax.distributed.initialize()
        return
    ids = dist.get("local_device_ids")
    jax.distributed.initialize(coordinator_address=str(dist.coordinator_address),
                               num_processes=int(dist.num_processes), process_id=int(dist.process_id),
                               local_device_ids=None if ids is None else [int(i) for i in ids])


def enable_compile_cache(folder: Path) -> None:
    """jax's persistent compilation cache: a later run with the same shapes loads its executables
    instead of compiling them (on 2 CPU cores, compiling a 30-layer model's steps takes most of a run).
    Timings never include compiles either way: every timed step is compiled ahead of time."""
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def gpu_matches(name: str, platform: str, device_kind: str) -> bool:
    """Whether a `gpu` config named `name` describes a device: `cpu` the CPU platform (simulated devices
    included); another name a word of the device's kind (h200: "NVIDIA H200", not "NVIDIA GH200")."""
    name = name.lower()
    if platform == "cpu" or name == "cpu":
        return platform == "cpu" and name == "cpu"
    return re.search(rf"(?<![a-z0-9]){re.escape(name)}(?![a-z0-9])", device_kind.lower()) is not None


def gpu_name_for(platform: str, device_kind: str) -> str | None:
    """The `gpu=` option a device's kind suggests (NVIDIA H200 -> h200), or None."""
    if platform == "cpu":
        return "cpu"
    m = re.search(r"(?<![a-z0-9])([a-z]{1,2}\d{2,4}[a-z]?)(?![a-z0-9])", device_kind.lower())
    return m.group(1) if m else None


def check_gpu(cfg) -> str | None:
    """Refuse (DeviceMismatchError, one line) a `gpu` config that does not name the device jax sees,
    unless `gpu.allow_mismatch`; then return the note a run's records carry. Call it after `setup`."""
    dev = jax.devices()[0]
    platform, kind = dev.platform, getattr(dev, "device_kind", "") or dev.platform
    name = str(cfg.gpu.name)
    if gpu_matches(name, platform, kind):
        return None
    count = jax.device_count()
    seen = f"{'a CPU' if platform == 'cpu' else kind} ({platform}, {count} device{'s' if count > 1 else ''})"
    if cfg.gpu.get("allow_mismatch"):
        return f"the gpu={name} config on {seen} (gpu.allow_mismatch)"
    fix = gpu_name_for(platform, kind)
    fix = f"gpu={fix}" if fix else "the gpu config of this device"
    raise DeviceMismatchError(f"gpu={name} but jax sees {seen}; use {fix}, or gpu.allow_mismatch=true to run "
                              f"the {name} config on this device anyway")
