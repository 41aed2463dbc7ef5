"""Every config composes and types check; impossible values fail with messages naming the key."""

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from pallas_kernels.w12_mosaic import W12MosaicConfig
from specpilot.harness import config_schema
from specpilot.harness.config_schema import ConfigValueError, build_plans, typed, validate
from specpilot import plan as plan_mod
from specpilot.harness.deploy import build_target
from specpilot.models.config import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
config_schema.register()


TINY = ["target=tiny_random", "drafter=none", "decoding=ar", "bench=default"]


def _compose(overrides=(), base=TINY):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return typed(compose(config_name="config", overrides=[*base, *overrides]))


def _fixups(group, option):
    """Companion choices an option needs to form a valid deployment."""
    if (group, option) in (("target", "embedded"), ("drafter", "embedded"), ("bench", "heldout")):
        return ["target=embedded", "drafter=embedded", "decoding=stock", "bench=heldout"]
    if (group, option) == ("drafter", "smollm2"):
        return ["target=smollm2", "bench=chat"]  # the drafter shipped for SmolLM2 (nothing is fetched here)
    if group == "bench" and option in ("chat", "chat_default", "humaneval", "humaneval_chat"):
        return ["target=smollm2"]  # text prompts need a target with a tokenizer (nothing is fetched here)
    if group == "decoding" and option != "ar":
        extra = ["drafter=random"]  # speculative methods need a drafter
        if "w12" in option:
            extra.append("target.dtype=bfloat16")  # the 12-bit format encodes bf16 weights
        if "twin" in option or option == "step":
            extra.append("target.dtype=bfloat16")  # the Mosaic kernel's bf16 twin multiplies bf16 weights
        return extra
    return []


def test_default_config_composes_and_validates():
    cfg = _compose(base=())
    validate(cfg)
    assert (cfg.target.source, cfg.drafter.source, cfg.bench.prompts) == ("smollm2", "packaged", "chat")
    assert cfg.bench.stop_at_eos


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", ["target", "drafter", "gpu", "decoding", "bench", "experiment"])
def test_every_option_composes(group):
    for option in _options(group):
        if group == "experiment":
            cfg = _compose([f"experiment={option}"], base=())
        else:
            cfg = _compose([*_fixups(group, option), f"{group}={option}"])
        if not any(c.source in ("hf", "dflash", "gguf") and not c.path for c in (cfg.target, cfg.drafter)):
            validate(cfg)


@pytest.mark.parametrize("override,match", [
    ("drafter.block_size=0", "drafter.block_size"),
    ("bench.batch_size=8", "bench.batch_size"),
    ("bench.cache_len=16", "bench.cache_len"),
    ("decoding.plans.stock.verify=warp", "decoding.plans.stock.verify: 'warp' is not one of"),
    ("decoding.plans.stock.verify=tree", "decoding.plans.stock.tree: a tree plan needs tree"),
    ("decoding.plans.stock.verify=two_level", "decoding.plans.stock.tree: a tree plan needs tree"),
    ("decoding=tree decoding.plans.tree_n16.tree.nodes=1", "decoding.plans.tree_n16.tree.nodes: a tree verifies"),
    ("decoding=tree decoding.plans.tree_n16.tree.nodes=40 decoding.plans.tree_n16.tree.depth=4",
     "decoding.plans.tree_n16.tree.nodes: 40 exceeds the 31 nodes"),
    ("decoding=tree decoding.plans.tree_n16.tree.depth=4 decoding.plans.tree_n16.tree.branching=1",
     "decoding.plans.tree_n16.tree.nodes: 16 exceeds the 5 nodes"),
    ("decoding=tree decoding.plans.tree_n16.tree.branching=0", "decoding.plans.tree_n16.tree.branching: must be"),
    ("decoding=tree decoding.plans.tree_n16.block_size=8", "decoding.plans.tree_n16.block_size: a tree plan's block size"),
    ("decoding=tree drafter=random drafter.block_size=8", "decoding.plans.tree_n16.tree.depth: a depth-15 tree needs a drafter block of 16"),
    ("decoding.plans.stock.weights=w11", "decoding.plans.stock.weights"),
    ("decoding.plans.stock.block_size=1", "decoding.plans.stock.block_size"),
    ("decoding.plans.stock.batching.policy=eager", "decoding.plans.stock.batching.policy: 'eager'"),
    ("decoding.plans.stock.batching.verify=sparse", "decoding.plans.stock.batching.verify: 'sparse'"),
    ("decoding.plans.stock.batching.draft_budget=tree", "decoding.plans.stock.batching.draft_budget"),
    ("decoding.plans.stock.batching.token_budget=1", "decoding.plans.stock.batching.token_budget: must be"),
    ("decoding.plans.stock.verify=ar decoding.plans.stock.batching.verify=packed",
     "decoding.plans.stock.batching.verify: 'packed' needs a chain plan"),
    ("decoding.plans.stock.batching.streams=0", "decoding.plans.stock.batching.streams: must be a positive"),
    ("decoding.plans.stock.batching.streams=3", "decoding.plans.stock.batching.streams: 3 stream sizes need verify: packed"),
    ("decoding.plans.stock.batching.pricing=model", "decoding.plans.stock.batching.pricing: 'model' is not one of"),
    ("decoding.plans.stock.batching.pricing=measured", "decoding.plans.stock.batching.pricing: measured prices packed"),
    ("decoding.plans.stock.batching.kv=pages", "decoding.plans.stock.batching.kv: 'pages' is not one of"),
    ("decoding.plans.stock.batching.kv=paged decoding.plans.stock.batching.page_size=0",
     "decoding.plans.stock.batching.page_size: must be a positive integer"),
    ("decoding.plans.stock.batching.kv=paged decoding.plans.stock.batching.overlap=halves",
     "decoding.plans.stock.batching.kv: paged K/V is not implemented with batching.overlap"),
    ("decoding.plans.stock.kernels.matmul.implementation=[cuda]", "decoding.plans.stock.kernels.matmul"),
    ("decoding.plans.stock.kernels.matmul.implementation=[]", "decoding.plans.stock.kernels.matmul"),
    ("+decoding.plans.stock.kernels.matmul.config.block_k=64", "decoding.plans.stock.kernels.matmul: .*block_k"),
    ("decoding.plans.stock.weights=w12 target.dtype=float32", "the 12-bit weight format encodes bfloat16"),
    ("target.source=cloud", "target.source"),
    ("target.init=uniform", "target.init"),
    ("drafter=oracle drafter.acceptance_trace=/nonexistent/run", "no results.jsonl"),
    ("gpu.matmul.w12=[cuda]", "gpu.matmul.w12"),
    ("gpu.ar_baselines=[[xla],[tpu]]", "gpu.ar_baselines.1"),
    ("gpu.ar_baselines=[]", "gpu.ar_baselines"),
    ("bench.prompts=poems", "bench.prompts"),
    ("decoding.top_p=1.5", "decoding"),
    ("target=hf", "target.path"),
    ("drafter=embedded", "drafter.source"),
    ("bench=heldout", "bench.prompts"),
    ("decoding=stock", "needs a drafter"),
    ("decoding=ar_w12_twin target.dtype=float32", "the Mosaic GPU kernel multiplies bfloat16 weights"),
    ("drafter=oracle decoding=stock decoding.plans.stock.block_size=32", "an oracle drafter replays a profile"),
    ("decoding.plans.stock.w12_matrices=[qkv]", "decoding.plans.stock.w12_matrices: chooses what a w12 plan"),
    ("decoding.plans.stock.weights=w12 target.dtype=bfloat16 decoding.plans.stock.w12_matrices=[mlp]",
     "w12_matrices: a non-empty list of distinct matrix classes from qkv, o, gate_up, down, lm_head, fc"),
    # a plan the recorded trace file does not name, and the file has no model to sample one from
    ("drafter=oracle_trace drafter.num_layers=1 decoding=two_level",
     "plan 'tree_n16' has no trace in .* no acceptance model"),
    # the calibrated file's model samples chains and trees, not an early exit's first level
    ("drafter=oracle_trace drafter.num_layers=1 drafter.step_trace=docs/results/trace_ddtree_calibrated.json "
     "decoding=two_level", "'early_exit' first level has no trace here"),
])
def test_impossible_values_fail_clearly(override, match):
    base = [*TINY, "drafter=random"] if "decoding.plans." in override and "drafter=" not in override else TINY
    if "decoding.plans.stock" in override and "decoding=" not in override:
        base = [*base, "decoding=stock"]
    with pytest.raises(ConfigValueError, match=match):
        validate(_compose(override.split(), base=base))


def test_typos_and_wrong_types_fail_at_composition():
    with pytest.raises(ConfigCompositionException):
        _compose(["bench.new_tokenz=5"])
    # Hydra's own suggestion after a typo (`+key`) bypasses the group schema: typed() still refuses it
    with pytest.raises(ConfigValueError, match="blok_size"):
        _compose(["+drafter.blok_size=8"])
    with pytest.raises(ConfigValueError, match="wieghts"):
        _compose(["decoding=stock", "+decoding.plans.stock.wieghts=w12"])
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["bench.new_tokens=many"])
    with pytest.raises(ConfigCompositionException):
        _compose(["target=qwen9"])


PLAN_FLIPS = [  # (override, plan field, value as the Plan holds it)
    ("decoding.plans.stock.verify=ar", "verify", "ar"),
    ("decoding.plans.stock.weights=w12", "weights", "w12"),
    ("decoding.plans.stock.block_size=4", "block_size", 4),
    ("decoding.plans.stock.kernels.matmul.implementation=[triton,xla]", "kernels.matmul.implementation",
     ("triton", "xla")),
    ("decoding.plans.stock.kernels.matmul.implementation=[mosaic,xla] "
     "+decoding.plans.stock.kernels.matmul.config.large_n=16384", "kernels.matmul.config",
     W12MosaicConfig(large_n=16384)),
    ("decoding.plans.stock.batching.policy=static", "batching.policy", "static"),
    ("decoding.plans.stock.batching.draft_budget=confidence", "batching.draft_budget", "confidence"),
    ("decoding.plans.stock.batching.verify=packed", "batching.verify", "packed"),
    ("decoding.plans.stock.batching.token_budget=24", "batching.token_budget", 24),
    ("decoding.plans.stock.batching.verify=packed decoding.plans.stock.batching.streams=4", "batching.streams", 4),
    ("decoding.plans.stock.batching.draft_budget=confidence decoding.plans.stock.batching.verify=packed "
     "decoding.plans.stock.batching.pricing=measured", "batching.pricing", "measured"),
    ("decoding.plans.stock.batching.kv=paged", "batching.kv", "paged"),
    ("decoding.plans.stock.batching.page_size=32", "batching.page_size", 32),
    ("decoding.plans.stock.batching.pages=4096", "batching.pages", 4096),
]


@pytest.mark.parametrize("override,field,value", PLAN_FLIPS)
def test_each_plan_field_flips_from_the_command_line(override, field, value):
    """One override changes one field of one plan, and nothing else of the run's plans."""
    base = [*TINY, "drafter=random", "decoding=stock", "target.dtype=bfloat16"]
    before = {p.name: p for p in build_plans(_compose(base=base))}
    cfg = _compose(override.split(), base=base)
    validate(cfg)
    after = {p.name: p for p in build_plans(cfg)}
    # a stock plan flipped to verify=ar is itself XLA's bf16 ar plan: the baseline is not added twice
    assert set(after) == (set(before) - {"ar"} if field == "verify" else set(before))
    got = after["stock"]
    for part in field.split("."):
        got = getattr(got, part)
    assert got == value
    for name in after:
        if name != "stock":
            assert after[name] == before[name]
    changed = [f.name for f in dataclasses.fields(before["stock"])
               if getattr(before["stock"], f.name) != getattr(after["stock"], f.name)]
    if field == "verify":  # an ar plan verifies one token: its block size follows
        assert set(changed) == {"verify", "block_size"}
    else:
        assert changed == [field.split(".")[0]]


def test_ar_baselines_are_the_devices_candidates_and_plans_can_be_one():
    """gpu.ar_baselines adds a bf16 ar plan per implementation unless the run's plans already hold it."""
    plans = build_plans(_compose(["gpu=h200", "target.dtype=bfloat16"], base=[*TINY, "drafter=random", "decoding=stock"]))
    assert [(p.name, p.kernels.matmul.implementation) for p in plans] == [
        ("ar", ("xla",)), ("ar_mosaic", ("mosaic", "xla")), ("stock", ("xla",))]
    plans = build_plans(_compose(["gpu=h200", "decoding=ar_w12_twin", "target.dtype=bfloat16"]))
    assert [p.name for p in plans] == ["ar", "ar_twin", "ar_w12"]
    assert plans[2].kernels.matmul.implementation == ("mosaic", "xla")  # the gpu's default for w12 weights
    # no Mosaic candidate for a float32 target (the kernel multiplies bf16 weights)
    plans = build_plans(_compose(["gpu=h200"], base=[*TINY, "drafter=random", "decoding=stock"]))
    assert [p.name for p in plans] == ["ar", "stock"]


def test_reserved_plan_fields_fail_naming_the_field():

    kw = dict(drafter_block_size=4, default_matmul={"bf16": ["xla"], "w12": ["xla"]})
    with pytest.raises(plan_mod.PlanError, match="decoding.plans.t.tree: tree shapes belong to tree verification"):
        plan_mod.build("t", {"verify": "chain", "tree": {"nodes": 8, "depth": 3, "branching": 2}}, **kw)
    with pytest.raises(plan_mod.PlanError, match="decoding.plans.t.tree.depth: missing"):
        plan_mod.build("t", {"verify": "tree", "tree": {"nodes": 8, "branching": 2}}, **kw)
    with pytest.raises(plan_mod.PlanError, match="decoding.plans.t.tree: unknown key.*'width'"):
        plan_mod.build("t", {"verify": "tree", "tree": {"nodes": 8, "depth": 3, "branching": 2, "width": 4}}, **kw)
    tree = plan_mod.build("t", {"verify": "tree", "tree": {"nodes": 8, "depth": 3, "branching": 2}}, **kw)
    assert (tree.block_size, tree.tree) == (8, plan_mod.TreeShape(8, 3, 2))
    assert plan_mod.build("t", {"verify": "tree", "tree": {"nodes": 3, "depth": 3, "branching": 1}}, **kw).block_size == 4
    with pytest.raises(plan_mod.PlanError, match="decoding.plans.t.two_level: a two_level plan needs"):
        plan_mod.build("t", {"verify": "two_level", "tree": {"nodes": 8, "depth": 3, "branching": 2}}, **kw)
    with pytest.raises(plan_mod.PlanError, match="decoding.plans.t.block_size: a chain plan needs a drafter"):
        plan_mod.build("t", {"verify": "chain"}, drafter_block_size=None, default_matmul=kw["default_matmul"])
    p = plan_mod.build("t", {"verify": "chain", "weights": "w12"}, **kw)
    assert hash(p) == hash(plan_mod.build("t", {"verify": "chain", "weights": "w12"}, **kw))  # frozen, hashable


def test_multirun_sweeps_one_plan_axis():
    """A multirun over one plan field composes one config per value (Hydra's sweeper expands the axis)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    (sweep,) = parser.parse_overrides(["decoding.plans.stock.block_size=4,8,16"])
    values = list(sweep.sweep_iterator())
    blocks = [build_plans(_compose([f"decoding.plans.stock.block_size={v}"],
                                   base=[*TINY, "drafter=random", "decoding=stock"]))[-1].block_size for v in values]
    assert blocks == [4, 8, 16]


def test_heads_not_dividing_fail_clearly():

    cfg = _compose(["target.model.num_key_value_heads=3"])
    with pytest.raises(ConfigError, match="num_kv_heads"):
        build_target(cfg.target, cfg.drafter, 0)
