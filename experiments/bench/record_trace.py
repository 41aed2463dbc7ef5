"""Record per-step acceptance traces from a trained pair: `python experiments/bench/record_trace.py --out FILE
[overrides]` (the run's config, e.g. `decoding=tree_budgets`, SmolLM2 + its packaged drafter by default).

Every chain, tree and two_level plan of the run decodes the bench's prompts one step per call and keeps how
many drafts each verification step accepted (a chain of block Bs as the tree of Bs nodes, depth Bs - 1,
branching 1, which accepts the same). FILE holds {"source", "methods": {plan name: {"verify", "shape",
"tau", "accepted": [...]}}}: what `drafter=oracle_trace drafter.step_trace=FILE` replays at another shape.
A chain plan's entry also holds "confidence": quantile tables of the drafter's top-1 probability for
accepted, first-rejected and later drafts (`models.confidence_trace`), what `drafter.confidence_trace=FILE`
gives an oracle drafter.
"""

import dataclasses
import json
import logging
import sys
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig

from specpilot.decoding import tree, two_level
from specpilot.harness import config_schema, deploy
from specpilot.models.confidence_trace import confidence_table

config_schema.register()
logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
OUT = None
OVERRIDES: list[str] = []


def record(dep, plan) -> tuple[list[int], dict | None]:
    """Per-step accepted drafts of `plan` over the deployment's batches (rows in order, steps in order),
    and for a chain plan the confidence table of its draft positions (else None)."""
    target, params = dep.target_for(plan), dep.params_for(plan)
    drafter, dparams = dep.drafter_for(plan)
    kw = dict(sampling=dep.sampling, key=dep.key, cache_len=dep.cache_len, stop_token=dep.stop_token,
              record_steps=True)
    accepted, steps_all, top1_all = [], [], []
    for batch in dep.batches():
        if plan.verify == "chain":
            res = tree.generate(target, params, drafter, dparams, batch, dep.new_tokens, nodes=plan.block_size,
                                depth=plan.block_size - 1, branching=1, **kw)
        elif plan.verify == "tree":
            t = plan.tree
            res = tree.generate(target, params, drafter, dparams, batch, dep.new_tokens, nodes=t.nodes,
                                depth=t.depth, branching=t.branching, **kw)
        else:
            t, lv = plan.tree, plan.two_level
            res = two_level.generate(target, params, drafter, dparams, batch, dep.new_tokens, nodes=t.nodes,
                                     depth=t.depth, branching=t.branching, first=lv.first, keep=lv.keep,
                                     exit_layer=lv.exit_layer, **kw)
        steps = res.stats.accepted_per_step  # [steps, B], -1 where a row had stopped
        for row in range(steps.shape[1]):
            accepted += [int(a) for a in steps[:, row] if a >= 0]
        steps_all.append(steps.reshape(-1))
        top1_all.append(res.stats.draft_top1_per_step.reshape(-1, res.stats.draft_top1_per_step.shape[-1]))
    if plan.verify != "chain":
        return accepted, None
    return accepted, confidence_table(np.concatenate(top1_all), np.concatenate(steps_all))


@hydra.main(version_base=None, config_path="../../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    cfg = config_schema.typed(cfg)
    config_schema.validate(cfg)
    plans = config_schema.build_plans(cfg)
    dep = deploy.build(cfg, plans)
    methods = {}
    for plan in plans:
        if plan.verify == "ar":
            continue
        accepted, confidence = record(dep, plan)
        shape = dataclasses.asdict(plan.tree) if plan.tree is not None else {"block_size": plan.block_size}
        if plan.two_level is not None:
            shape["two_level"] = dataclasses.asdict(plan.two_level)
        methods[plan.name] = {"verify": plan.verify, "shape": shape, "tau": float(np.mean(accepted)) + 1.0,
                              "accepted": accepted}
        if confidence is not None:
            methods[plan.name]["confidence"] = confidence
        print(f"{plan.name}: {len(accepted)} steps, tau {methods[plan.name]['tau']:.3f}"
              + ("" if confidence is None else f"; confidence counts {confidence['counts']}, "
                 f"means {confidence['mean']}"))
    source = (f"experiments/bench/record_trace.py {' '.join(OVERRIDES)}: target {cfg.target.name}, "
              f"drafter {cfg.drafter.name}, bench {cfg.bench.name} "
              f"({len(dep.batches()) * dep.batch_size} prompts x {dep.new_tokens} tokens), greedy; "
              f"{'; '.join(dep.notes)}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"source": source, "methods": methods}, indent=1) + "\n")
    print(f"trace: {OUT}")


if __name__ == "__main__":
    if "--out" not in sys.argv[1:-1]:
        sys.exit("usage: record_trace.py --out FILE [hydra overrides]")
    i = sys.argv.index("--out")
    OUT = Path(sys.argv[i + 1]).expanduser()
    del sys.argv[i:i + 2]
    OVERRIDES = sys.argv[1:]
    main()
