"""Device set-up before a run touches a device: simulated CPU devices, multi-host initialisation, the compile cache.

Design choices:
- Both must happen before jax creates its backends, so entry points call `setup(cfg)` first, right
  after the config is validated; a call once the backends exist fails with an error that says so,
  rather than running on a device set other than the one asked for.
- `simulated_cpu_devices=N` sets jax's CPU device count (the `--xla_force_host_platform_device_count`
  flag's config twin): sharded plans then run on a machine without accelerators, which is how the
  tests check them.
- `distributed.enabled` calls `jax.distributed.initialize`: with `auto` jax reads the cluster's
  environment (SLURM, Open MPI, Kubernetes); otherwise the coordinator's host:port, the number of
  processes and this process's id are given explicitly, as on hosts started by hand. Every process then
  sees the global device list, so a plan's mesh may span hosts.
"""

from __future__ import annotations

from pathlib import Path

import jax


class DeviceSetupError(RuntimeError):
    """Devices were asked for after jax had created its backends, or a distributed set-up is incomplete."""


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", None))


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
