"""Run one deployment with every plan of its run: `python experiments/run.py target=... gpu=...`.

Hydra composes `conf/config.yaml`; sweeps use multirun (`-m decoding.plans.stock.block_size=4,8,16`).
Results go to `results.jsonl` / `results.csv` in the run's output directory, and a table is printed. A
mistake or a failed run prints one line (the traceback with HYDRA_FULL_ERROR=1) and leaves no output
folder of its own behind. Kernel variants a plan file carries are checked in a sandboxed process first.
"""

import logging
import tempfile
from pathlib import Path

import jax
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from specpilot.harness import config_schema, devices, entry, plan_variants, runner

config_schema.register()
for noisy in ("jax._src.xla_bridge", "absl", "orbax"):  # "no TPU" and per-checkpoint INFO lines
    logging.getLogger(noisy).setLevel(logging.WARNING)
log = logging.getLogger("run")
VARIANT_CHECK_S, VARIANT_CHECK_MB = 900, 8192  # one sandboxed reference check: deadline, address space


def check_variants_sandboxed(cfg) -> None:
    """Every kernel variant the config carries, loaded and checked against its op's reference in a
    sandboxed process (`decoding.variants_sandbox`), before this process runs any of its code."""
    if not cfg.decoding.get("variants"):
        return
    from specpilot.agent import evaluator, sandbox  # Dask and the sandbox only for a run that carries variants
    config_schema.validate(cfg)
    checks = plan_variants.sandbox_checks(cfg, config_schema.build_plans(cfg))
    mode = str(cfg.decoding.variants_sandbox)
    sandbox.require(mode, key="decoding.variants_sandbox")
    with tempfile.TemporaryDirectory(prefix="specpilot-variant-check-") as work:
        for spec in checks:
            res = evaluator.evaluate_candidate(spec, timeout_s=VARIANT_CHECK_S, memory_mb=VARIANT_CHECK_MB,
                                               workdir=work, sandbox=mode)
            what = f"kernel variant {spec['variant']} ({spec['op']}) in plan {spec['plan']!r}"
            if res["status"] != evaluator.OK:
                reason = res["reason"].removeprefix("before ready: ")
                reason = reason.removeprefix(f"{spec['variant']} ({spec['op']}): ")
                raise plan_variants.VariantError(f"{what}: {reason}")
            calls = sum(c.get("calls", 0) for c in res.get("checked") or [])
            log.info("%s matched its reference in %d checked calls in the sandbox (%s)", what, calls, mode)


@entry.app(config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    hydra_dir = Path(HydraConfig.get().runtime.output_dir)
    out_dir = None
    try:
        cfg = config_schema.typed(cfg)
        devices.setup(cfg)  # simulated CPU devices, jax.distributed: before anything touches a device
        check_variants_sandboxed(cfg)  # before this process imports or runs any variant's code
        out_dir = cfg.output_dir or str(hydra_dir)
        if cfg.compile_cache:
            devices.enable_compile_cache(Path(cfg.cache_dir).expanduser() / "xla")
        records = runner.run(cfg, out_dir)  # the device, memory and drafter checks run before the build
    except Exception as e:
        entry.discard_if_empty(hydra_dir)
        if out_dir is not None:
            entry.discard_if_empty(Path(out_dir))
        entry.report(e)
    print(runner.format_table(records))
    shown = runner.format_responses(records)
    if shown:
        print(shown)
    if jax.process_index() == 0:  # multi-host runs: process 0 writes the results
        print(f"results: {out_dir}/results.jsonl")


if __name__ == "__main__":
    main()
