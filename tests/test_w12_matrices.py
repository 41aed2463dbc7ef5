"""A w12 plan of some matrix classes (`w12_matrices`): only those are encoded, the rest stay bf16 arrays for
XLA's dot, and since W12 decodes bit-exactly the plan's tokens are the bf16 plan's, checked by token forcing
through the run entry point."""

import json
import subprocess
import sys

import jax
import pytest

from agent_helpers import ROOT, toy_cfg
from specpilot.agent import space as sp
from specpilot.formats.w12 import W12
from specpilot.harness import deploy
from specpilot.harness.config_schema import build_plans
from specpilot.plan import W12_CLASSES, PlanError, build


def _kinds(params) -> dict:
    """Param name -> type name of each layer's linear matrices (the first layer), plus `fc` if present."""
    out = {k: type(v).__name__ for k, v in params["layers"][0].items() if getattr(v, "ndim", 0) == 2}
    if "fc" in params:
        out["fc"] = type(params["fc"]).__name__
    return out


def test_only_the_chosen_classes_are_encoded():
    cfg = toy_cfg("target.dtype=bfloat16", "decoding=w12",
                  "+decoding.plans.stock_w12.w12_matrices=[gate_up,down,fc]",
                  "+decoding.plans.ar_w12.w12_matrices=[qkv,o]")
    plans = {p.name: p for p in build_plans(cfg)}
    dep = deploy.build(cfg, list(plans.values()))
    target = _kinds(dep.params_for(plans["stock_w12"]))
    assert target == {"qkv": "ArrayImpl", "o": "ArrayImpl", "gate_up": "W12", "down": "W12"}
    assert _kinds(dep.params_for(plans["ar_w12"])) == {"qkv": "W12", "o": "W12", "gate_up": "ArrayImpl",
                                                        "down": "ArrayImpl"}
    _, draft = dep.drafter_for(plans["stock_w12"])
    drafted = _kinds(draft)
    assert drafted["fc"] == "W12" and drafted["gate"] == drafted["up"] == drafted["down"] == "W12"
    assert drafted["q"] == drafted["o"] == "ArrayImpl"
    every = _kinds(dep.params_for(build("all", {"verify": "ar", "weights": "w12"}, drafter_block_size=8,
                                        default_matmul={"w12": ["xla"], "bf16": ["xla"]})))
    assert set(every.values()) == {"W12"}
    assert sum(isinstance(x, W12) for x in jax.tree_util.tree_leaves(
        dep.params_for(plans["stock_w12"]), is_leaf=lambda x: isinstance(x, W12))) == 2 * len(dep.params["layers"])


def test_the_plan_field_is_checked_and_the_loop_can_choose_it():
    kw = dict(drafter_block_size=8, default_matmul={"w12": ["xla"], "bf16": ["xla"]})
    assert build("p", {"weights": "w12", "w12_matrices": ["down"]}, **kw).w12_params() == (("down",), False, False)
    assert build("p", {"weights": "w12"}, **kw).w12_matrices == tuple(W12_CLASSES)
    for fields, match in (({"weights": "bf16", "w12_matrices": ["down"]}, "chooses what a w12 plan encodes"),
                          ({"weights": "w12", "w12_matrices": []}, "a non-empty list"),
                          ({"weights": "w12", "w12_matrices": ["down", "down"]}, "distinct"),
                          ({"weights": "w12", "w12_matrices": ["mlp"]}, "matrix classes from qkv")):
        with pytest.raises(PlanError, match=f"decoding.plans.p.w12_matrices: .*{match}"):
            build("p", fields, **kw)
    space = sp.build_space(toy_cfg("target.dtype=bfloat16"))
    choice = space.choice("w12_matrices")
    assert choice is not None and not choice.applies({"verify": "chain", "weights": "bf16"})
    assert choice.applies({"verify": "chain", "weights": "w12"})
    rewrites = sp.single_field_rewrites(space, {"verify": "chain", "weights": "w12",
                                                "w12_matrices": list(W12_CLASSES)}, choice)
    assert {"w12_matrices": ["gate_up", "down"]} in rewrites and len(rewrites) == len(choice.values) - 1
    for rw in rewrites:
        assert not isinstance(space.check("c", sp.apply({"verify": "chain", "weights": "w12"}, rw)), str)
    # leaving w12 drops the classes with it
    assert "w12_matrices" not in sp.apply({"weights": "w12", "w12_matrices": ["down"]}, {"weights": "bf16"})


@pytest.mark.parametrize("kernel", ["xla", pytest.param("mosaic", marks=pytest.mark.slow)])
def test_partial_w12_plans_decode_the_bf16_tokens(tmp_path, kernel):
    """The encoded classes through XLA's decode or the Mosaic W12 kernel (interpreted on a CPU: 90 s), the
    bf16 ones through XLA's dot either way."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"), "target=tiny_random", "target.dtype=bfloat16",
         "drafter=oracle", "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=2.5", "decoding=w12",
         "+decoding.plans.stock_w12.w12_matrices=[gate_up,down,fc]", "+decoding.plans.ar_w12.w12_matrices=[qkv,o]",
         f"gpu.matmul.w12=[{kernel},xla]",
         "bench=default", "bench.num_prompts=1", "bench.new_tokens=8", f"output_dir={out}",
         f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    for name in ("ar_w12", "stock_w12"):
        assert records[name]["mismatches"] == 0 and records[name]["forcing"]["outputs_differ"] == 0, name
    assert records["stock_w12"]["plan"]["w12_matrices"] == ["gate_up", "down", "fc"]
