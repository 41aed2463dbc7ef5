"""Proposers: the cost-model-guided order, Optuna's ask/tell with pruning, the registry."""

import pytest
from agent_helpers import toy_cfg

from specpilot.agent import proposers as props
from specpilot.agent import space as sp
from specpilot.agent.loop import agent_conf
from specpilot.harness import deploy
from specpilot.harness.config_schema import build_plans
from specpilot.costmodel import roofline, counts, prediction
from specpilot.costmodel.rates import Rates

INCUMBENT = {"verify": "chain", "weights": "bf16", "block_size": 4}


@pytest.fixture(scope="module")
def gpu_space():
    cfg = toy_cfg("target.dtype=bfloat16")
    return cfg, sp.build_space(cfg, platform="gpu")


def _attribution(stages, classes):
    return {"stages": [{"stage": s, "lost_ms": v} for s, v in stages],
            "classes": [{"stage": "verify", "class": c, "lost_ms": v} for c, v in classes]}


def test_guided_targets_the_largest_gap_first(gpu_space):
    _, space = gpu_space
    verify_bound = _attribution([("verify", 5.0), ("draft", 1.0)], [("attention", 0.5), ("matmul", 0.2)])
    got = props.GuidedProposer().propose(props.Context(space, INCUMBENT, verify_bound, set()), 3)
    assert [p.rewrite for p in got][:2] == [{"verify": "ar"}, {"verify": "tree", "tree.nodes": 8, "tree.depth": 3,
                                                               "tree.branching": 2}]
    assert got[2].rewrite == {"verify": "two_level", "tree.nodes": 8, "tree.depth": 3, "tree.branching": 2,
                              "two_level.first": "drafter_confidence", "two_level.keep": 4}
    assert "verify loses 5.000 ms" in got[0].why
    matmul_bound = _attribution([("verify", 0.1)], [("matmul", 9.0), ("attention", 0.1)])
    got = props.GuidedProposer().propose(props.Context(space, INCUMBENT, matmul_bound, set()), 3)
    assert [list(p.rewrite)[0] for p in got] == ["weights", "kernels.matmul.implementation",
                                                "kernels.matmul.implementation"]
    tried = {sp.rewrite_key({"weights": "w12"})}
    got = props.GuidedProposer().propose(props.Context(space, INCUMBENT, matmul_bound, tried), 1)
    assert got[0].rewrite != {"weights": "w12"}


def test_guided_reads_a_real_attribution():
    cfg = toy_cfg()
    space = sp.build_space(cfg)
    plan = build_plans(cfg)[-1]
    dep = deploy.build(cfg, build_plans(cfg))
    setting = prediction.Setting(counts.Shape.from_deployment(dep, 40), Rates.for_gpu(cfg.gpu),
                                 roofline.Hardware.from_conf(cfg.gpu))
    att = prediction.attribute(plan, setting, prediction.Measurement(5e-3, 1.0, {"draft": 0.2, "verify": 0.7,
                                                                               "bookkeeping": 0.1}))
    first = props.GuidedProposer.targets(att)[0][0]
    assert first == att["stages"][0]["stage"] or first == att["classes"][0]["class"]
    got = props.GuidedProposer().propose(props.Context(space, sp.plan_fields(plan), att, set()), 2)
    assert got and all(space.choice(f) is not None for p in got for f in p.rewrite)


def test_optuna_asks_distinct_rewrites_and_prunes(gpu_space):
    _, space = gpu_space
    opt = props.OptunaProposer(seed=0)
    ctx = props.Context(space, INCUMBENT, None, set())
    got = opt.propose(ctx, 4)
    assert len(got) == 4 and len({sp.rewrite_key(p.rewrite) for p in got}) == 4 and all(p.cheap for p in got)
    # successive halving at rung 1 (reduction factor 2): a trial is kept if it is in the best half so far
    for p, t in zip(got[:3], (1.0, 0.9, 0.8)):
        assert not opt.should_prune(p, t)
        opt.observe(p, t, "accepted")
    assert opt.should_prune(got[3], 50.0)
    opt.observe(got[3], None, "pruned")
    states = [t.state.name for t in opt.study.trials if t.number in {p.handle.number for p in got}]
    assert states == ["COMPLETE", "COMPLETE", "COMPLETE", "PRUNED"]
    # config fields only ride with their own implementation
    for p in got:
        for f in p.rewrite:
            if ".config." in f:
                choice = space.choice(f)
                assert choice.when_holds(p.rewrite.get(choice.when[0], ["xla"]))


def test_registry_names_and_errors():
    assert {"guided", "optuna", "memory"} <= set(props.REGISTRY)
    with pytest.raises(ValueError, match="unknown 'oracle'"):
        props.make(["guided", "oracle"])

    @props.register("fixed")
    class Fixed(props.Proposer):
        name = "fixed"

        def __init__(self, seed=0):
            pass

        def propose(self, ctx, n):
            return [props.Proposal({"block_size": 2}, self.name, "always")]

    try:
        assert [type(p).__name__ for p in props.make(["fixed"])] == ["Fixed"]
    finally:
        del props.REGISTRY["fixed"]


def test_integrate_combines_compatible_survivors(gpu_space):
    _, space = gpu_space
    ctx = props.Context(space, INCUMBENT, None, set(), survivors=[{"block_size": 8}, {"weights": "w12"}])
    got = props.IntegrateProposer().propose(ctx, 3)
    assert [p.rewrite for p in got] == [{"block_size": 8, "weights": "w12"}, {"block_size": 8}, {"weights": "w12"}]
    clash = props.Context(space, INCUMBENT, None, set(), survivors=[{"block_size": 8}, {"block_size": 2}])
    assert [p.rewrite for p in props.IntegrateProposer().propose(clash, 3)] == [{"block_size": 8}, {"block_size": 2}]


def test_agent_block_errors_name_the_key():
    assert agent_conf({"rounds": 3}).rounds == 3
    with pytest.raises(ValueError, match="agent.roundz"):
        agent_conf({"roundz": 3})
    with pytest.raises(ValueError, match="agent.workers: must be >= 1"):
        agent_conf({"workers": 0})
    with pytest.raises(ValueError, match="agent.proposers: unknown 'oracle'"):
        agent_conf({"proposers": ["guided", "oracle"]})
    with pytest.raises(ValueError, match="names 'llm' but agent.llm.url is not set"):
        agent_conf({"proposers": ["guided", "llm"]})
    with pytest.raises(ValueError, match="agent.llm.modle"):
        agent_conf({"llm": {"url": "http://localhost:8000/v1", "modle": "m"}})


def test_proposers_skip_plans_that_lost_clearly_nearby():
    """guided's first choice lost clearly at a near deployment (memory's `losses`): it proposes the next."""
    cfg = toy_cfg()
    space = sp.build_space(cfg)
    incumbent = sp.plan_fields(space.check("inc", {"verify": "chain", "block_size": 4}))
    ctx = props.Context(space, incumbent, None, set())
    first = props.REGISTRY["guided"]().propose(ctx, 1)[0].rewrite
    lost = space.rewrite("probe", incumbent, first)[0]
    ctx = props.Context(space, incumbent, None, set(), avoid={sp.rewrite_key(lost): "0.28x at qwen3_8b"})
    assert ctx.avoided(first) == "0.28x at qwen3_8b"
    again = props.REGISTRY["guided"]().propose(ctx, 1)[0].rewrite
    assert again != first and ctx.avoided(again) is None
