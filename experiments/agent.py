"""The optimization loop on one deployment: `python experiments/agent.py target=... gpu=... agent.rounds=N`.

Hydra composes `conf/agent.yaml` (the config groups of `experiments/run.py` plus an `agent` block).
Progress goes to the console as it happens; the output directory gets `round_<i>.md`, `best_by_round.png`,
`summary.json` and the winning plan as `decoding/<name>.yaml` (copy it into conf/decoding/ and run
`experiments/run.py decoding=<name>`). The same command after an interrupt resumes from memory.
"""

import logging
from pathlib import Path

import jax
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from specpilot.agent import cluster_security, loop, sandbox
from specpilot.harness import config_schema, devices, entry, fit

config_schema.register()
NOISY = ("jax._src.xla_bridge", "absl", "orbax", "distributed", "optuna")
for noisy in NOISY:
    logging.getLogger(noisy).setLevel(logging.WARNING)


@entry.app(config_path="../conf", config_name="agent")
def main(cfg: DictConfig) -> None:
    shared = devices.share_gpu_memory()  # the driver, its workers and candidates share the GPU: none reserves it all
    hydra_dir = Path(HydraConfig.get().runtime.output_dir)
    for noisy in NOISY:  # again, after Hydra has configured logging
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        agent = loop.agent_conf(cfg.get("agent"))
        sandbox.require(agent.sandbox)  # before any model is built: a host that cannot contain proposed code
        if agent.scheduler:
            cluster_security.check_scheduler(agent.scheduler, cluster_security.security(agent.tls))
        rest = OmegaConf.to_container(cfg, resolve=True)
        rest.pop("agent", None)
        run_cfg = config_schema.typed(OmegaConf.create(rest))
        devices.setup(run_cfg)
        if shared:  # the driver gives back what its references free; its workers keep pooling, up to a cap
            devices.start_backends_returning_memory()
            devices.cap_started_processes(agent.worker_gpu_fraction)
        config_schema.validate(run_cfg)
        fit.preflight(run_cfg, config_schema.build_plans(run_cfg))  # the device and its memory, before any round
        out_dir = run_cfg.output_dir or str(hydra_dir)
        if run_cfg.compile_cache:  # the gate's references compile once per deployment too
            jax.config.update("jax_compilation_cache_dir", str(Path(run_cfg.cache_dir).expanduser() / "xla"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        summary = loop.Loop(run_cfg, agent, out_dir, progress=lambda m: print(m, flush=True)).run()
    except Exception as e:
        entry.report(e)
    for r in summary["rounds"]:
        best = r["best_s_per_token"]
        print(f"round {r['index']}: best {'-' if best is None else f'{1e3 * best:.3f}'} ms/token")
    print(f"winning plan: {summary['plan_file']}")
    print(f"results: {out_dir}")


if __name__ == "__main__":
    main()
