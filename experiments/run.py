"""Run one deployment with every configured method: `python experiments/run.py target=... gpu=...`.

Hydra composes `conf/config.yaml`; sweeps use multirun (`-m bench.batch_size=1,4,8`). Results go to
`results.jsonl` / `results.csv` in the run's output directory, and a table is printed.
"""

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from specpilot import config_schema, runner  # noqa: E402

config_schema.register()
for noisy in ("jax._src.xla_bridge", "absl", "orbax"):  # "no TPU" and per-checkpoint INFO lines
    logging.getLogger(noisy).setLevel(logging.WARNING)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    cfg = config_schema.typed(cfg)
    out_dir = cfg.output_dir or HydraConfig.get().runtime.output_dir
    records = runner.run(cfg, out_dir)
    print(runner.format_table(records))
    print(f"results: {out_dir}/results.jsonl")


if __name__ == "__main__":
    main()
