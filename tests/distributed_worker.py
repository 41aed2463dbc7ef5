"""One process of a two-process run (tests/test_distributed.py): `python distributed_worker.py PID PORT OUT`.

Initialises jax.distributed through the run config's `distributed` block, decodes a tiny dense target on
this process's own device (the reference) and on a tensor-parallel mesh spanning both processes, and
writes both token arrays to OUT as JSON.
"""

import json
import sys

from omegaconf import OmegaConf

from specpilot.harness import devices
from specpilot import sharding
from specpilot.decoding import ar, spec
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.config import ModelConfig


def main(pid: int, port: int, out: str) -> None:
    devices.setup(OmegaConf.create({"simulated_cpu_devices": None, "distributed": {
        "enabled": True, "auto": False, "coordinator_address": f"localhost:{port}", "num_processes": 2,
        "process_id": pid, "local_device_ids": None}}))
    import jax
    import jax.numpy as jnp

    from helpers import random_params

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
    params = random_params(dense.param_shapes(cfg), 0.5, 0)  # the same values in both processes
    prompts = [[1, 2, 3, 9, 4], [5, 9, 11, 40, 7, 3]]
    local = jax.device_put(params, jax.local_devices()[0])
    reference = ar.generate(dense.target(cfg, jnp.float32), local, prompts, 20).tokens
    mesh = sharding.make_mesh(sharding.MeshShape(tensor=2))
    target = dense.target(cfg, jnp.float32, mesh)
    placed = sharding.shard_params(jax.tree.map(lambda x: jax.device_get(x), params), mesh)
    sharded_ar = ar.generate(target, placed, prompts, 12).tokens
    replay = dr.ReplayDrafter(cfg.vocab_size, 8, shift=1, wrong_every=3)
    ref = jnp.asarray(dr.replay_reference(prompts, reference.tolist()))
    chain = spec.generate(target, placed, replay, ref, prompts, 12, block_size=4).tokens
    with open(out, "w") as f:
        json.dump({"processes": jax.process_count(), "devices": jax.device_count(),
                   "reference": reference[:, :12].tolist(), "ar": sharded_ar.tolist(), "chain": chain.tolist()}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
