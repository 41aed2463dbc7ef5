"""Shared by the agent tests: a toy deployment's composed config, and candidate spec construction."""

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specpilot.harness.config_schema import register, typed

ROOT = Path(__file__).resolve().parents[1]
TOY = ("target=tiny_random", "drafter=random", "drafter.num_layers=1", "drafter.block_size=8",
       "decoding=stock", "bench=default", "bench.new_tokens=16")


def toy_cfg(*overrides, cache_dir=None):
    register()
    extra = [f"cache_dir={cache_dir}"] if cache_dir else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return typed(compose(config_name="config", overrides=[*TOY, *extra, *overrides]))


def spec(cfg, name, fields, prompts, *, repeats=2, program=None, new_tokens=None):
    out = {"name": name, "fields": fields, "config": OmegaConf.to_container(cfg, resolve=True), "prompts": prompts,
           "new_tokens": int(new_tokens or cfg.bench.new_tokens), "repeats": repeats,
           "compile_cache": str(Path(cfg.cache_dir).expanduser() / "xla")}
    if program:
        out["program"] = str(program)
    return out


# a candidate program speaking the evaluator's protocol without building a deployment (fast): zeros
HONEST_PROGRAM = """
import json, sys
spec = json.load(open(sys.argv[1]))
print("ready", flush=True)
runs = 0
for line in sys.stdin:
    if line.strip() == "end":
        break
    runs += 1
    print("done", flush=True)
tokens = [[[0] * spec["new_tokens"] for _ in spec["prompts"]] for _ in range(runs)]
json.dump({"tokens": tokens, "stats": {}, "self_reported_s": [0.0] * runs}, open(sys.argv[2], "w"))
"""
