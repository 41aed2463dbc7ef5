"""The rewrite space: typed choices of a deployment, rewrites applied and checked by the harness's validation."""

import pytest
from agent_helpers import toy_cfg

from specpilot import plan as plan_mod
from specpilot.agent import space as sp
from specpilot.agent import proposers as props
from specpilot.agent.loop import distinct_plans
from specpilot.harness.config_schema import build_plans


@pytest.fixture(scope="module")
def toy():
    cfg = toy_cfg()
    return cfg, sp.build_space(cfg)


def test_space_of_a_cpu_deployment(toy):
    cfg, space = toy
    fields = [c.field for c in space.choices]
    assert fields == ["verify", "block_size", "tree.nodes", "tree.depth", "tree.branching", "two_level.first",
                      "two_level.keep", "draft_width", "two_level.exit_layer", "weights", "w12_matrices",
                      "kernels.matmul.implementation"]
    assert space.choice("verify").values == ("ar", "chain", "tree", "two_level")
    assert space.choice("block_size").values == (2, 3, 4, 6, 8)  # up to the drafter's block size
    assert space.choice("tree.depth").values == (2, 3, 5, 7)  # below the drafter's block size
    # no Pallas backend on a CPU: XLA, or the CPU rows kernel with XLA behind it
    assert space.choice("kernels.matmul.implementation").values == (("xla",), ("cpu_rows", "xla"))
    assert {c.field for c in space.targeting("verify")} == {"verify", "block_size", "tree.nodes", "tree.depth",
                                                            "tree.branching", "two_level.first", "two_level.keep",
                                                            "two_level.exit_layer"}
    assert {c.field for c in space.targeting("matmul")} == {"weights", "w12_matrices", "kernels.matmul.implementation"}


def test_gpu_space_lists_kernels_and_their_config_fields(toy):
    cfg, _ = toy
    space = sp.build_space(cfg, platform="gpu", devices=4)
    impls = space.choice("kernels.matmul.implementation").values
    assert ("triton", "xla") in impls and ("mosaic", "xla") in impls
    # the Mosaic kernel's pipeline depth, from its config dataclass: 2 halved and doubled
    assert space.choice("kernels.matmul.config.small_m_stages").values == (1, 2, 4)
    assert {"data": 2, "tensor": 2} in space.choice("mesh").values
    assert space.choice("kernels.gated_delta_rule.implementation") is None  # a dense target has none


def test_the_engine_workload_offers_only_what_the_engine_runs(toy):
    """The serving engine runs AR, chain and tree plans (`engine_checks.check_plan` refuses two-level ones):
    its space offers no two-level verification, so no round spends a candidate on a plan that cannot run."""
    from specpilot.serving.engine_checks import check_plan

    cfg, _ = toy
    space = sp.build_space(cfg, workload="engine")
    assert space.choice("verify").values == ("ar", "chain", "tree")
    inc = {"verify": "chain", "block_size": 4}
    for choice in space.choices:
        for rw in sp.single_field_rewrites(space, inc, choice):
            plan = space.check("candidate", sp.apply(inc, rw))
            if not isinstance(plan, str):
                check_plan(plan)
    # memory may bring a mechanism validated where the harness timed it: dropped here, with why
    dropped = space.rewrite("seed", inc, {"verify": "two_level", "tree.nodes": 8, "tree.depth": 3,
                                          "tree.branching": 2, "two_level.keep": 4})
    assert isinstance(dropped, sp.Dropped) and "not offered here: verify=\"two_level\"" in dropped.reason
    assert not isinstance(space.rewrite("seed", inc, {"verify": "tree", "tree.nodes": 8, "tree.depth": 3,
                                                      "tree.branching": 2}), sp.Dropped)


def test_rewrite_builds_the_plan_the_harness_builds(toy):
    cfg, space = toy
    incumbent = {"verify": "chain", "block_size": 4}
    fields, plan = space.rewrite("cand", incumbent, {"block_size": 6})
    assert fields["block_size"] == 6 and plan.block_size == 6
    # the same fields through the harness's own plan construction
    expected = plan_mod.build("cand", fields, drafter_block_size=8, default_matmul={"bf16": ["xla"], "w12": ["xla"]})
    assert plan == expected
    ar_fields, ar = space.rewrite("cand", incumbent, {"verify": "ar"})
    assert ar.verify == "ar" and ar.block_size == 1 and ar_fields["block_size"] is None


def test_impossible_rewrites_are_dropped_with_the_reason(toy):
    cfg, space = toy
    incumbent = {"verify": "chain", "block_size": 4}
    dropped = space.rewrite("cand", incumbent, {"weights": "w12"})
    assert isinstance(dropped, sp.Dropped) and "target.dtype" in dropped.reason  # float32 target
    assert "changes nothing" in space.rewrite("cand", incumbent, {"block_size": 4}).reason
    assert "not in the rewrite space" in space.rewrite("cand", incumbent, {"tree": {"nodes": 8}}).reason
    oracle = toy_cfg("drafter=oracle", "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=2.0")
    oracle_space = sp.build_space(oracle)
    _, smaller = oracle_space.rewrite("cand", {"verify": "chain"}, {"block_size": 2})  # the profile's first draft
    assert smaller.block_size == 2
    larger = oracle_space.rewrite("cand", {"verify": "chain"}, {"block_size": 8})
    assert isinstance(larger, sp.Dropped), larger


def test_feasible_space_leaves_out_what_fails_alone(toy):
    _, space = toy
    narrowed, removed = space.feasible({"verify": "chain", "block_size": 4})
    assert narrowed.choice("weights").values == ("bf16",)
    assert [d.rewrite for d in removed] == [{"weights": "w12"}]


def test_plan_fields_round_trip(toy):
    cfg, space = toy
    for plan in build_plans(cfg):
        again = space.check(plan.name, sp.plan_fields(plan))
        assert again == plan


def test_hybrid_target_space_has_the_recurrence_kernel():
    space = sp.build_space(toy_cfg("target=tiny_hybrid", "drafter=none", "decoding=ar"), platform="gpu")
    assert space.choice("kernels.gated_delta_rule.implementation").values == (("xla",), ("triton", "xla"))
    assert space.choice("kernels.gated_delta_rule.config.block_v").when == ("kernels.gated_delta_rule.implementation",
                                                                           "triton")
    assert space.choice("verify").values == ("ar",) and space.choice("block_size") is None  # no drafter


def test_tree_two_level_and_batching_fields_round_trip():
    # every field a plan has survives plan_fields: a winning tree or two-level plan is saved whole
    cfg = toy_cfg("decoding=two_level", "drafter.block_size=8",
                  "+decoding.plans.stock.batching={draft_budget: confidence, token_budget: 12}")
    space = sp.build_space(cfg)
    plans = build_plans(cfg)
    assert {p.verify for p in plans} >= {"tree", "two_level"}
    for plan in plans:
        assert space.check(plan.name, sp.plan_fields(plan)) == plan, plan.name


def test_rewrites_reaching_the_same_plan_run_once(toy):
    """Optuna may pair verify=ar with any block_size: the plans are one AR plan, timed once per round
    (measured on the CPU, two such candidates timed 20.45 and 22.88 ms/token: noise, not a finding)."""
    _, space = toy
    incumbent = {"verify": "chain", "block_size": 4}
    runnable = []
    for i, rw in enumerate(({"verify": "ar", "block_size": 8}, {"verify": "ar", "block_size": 3},
                            {"block_size": 2}, {"verify": "ar"})):
        fields, plan = space.rewrite(f"c{i}", incumbent, rw)
        runnable.append((None, props.Proposal(rw, "optuna", ""), f"c{i}", fields, plan, None))
    kept, repeats = distinct_plans(runnable)
    assert [x[2] for x in kept] == ["c0", "c2"]
    assert [(x[2], first) for x, first in repeats] == [("c1", "c0"), ("c3", "c0")]
    program = (None, props.Proposal({}, "given", ""), "c4", runnable[0][3], runnable[0][4], "/tmp/p.py")
    assert len(distinct_plans(runnable + [program])[0]) == 3  # a given program is another candidate


def test_the_block_size_is_not_proposed_to_an_ar_plan(toy):
    _, space = toy
    block = space.choice("block_size")
    assert sp.single_field_rewrites(space, {"verify": "ar"}, block) == []
    assert sp.single_field_rewrites(space, {"verify": "chain", "block_size": 4}, block)  # a drafting plan: yes


def test_a_weight_format_brings_the_devices_kernels_for_it():
    """w12 proposed alone over an incumbent whose plan names bf16's XLA dot runs w12's own kernel (the H200's
    gpu.matmul.w12: Mosaic), not the jnp decode path; naming the kernels in the rewrite keeps them."""
    cfg = toy_cfg("target.dtype=bfloat16", "gpu=h200")
    space = sp.build_space(cfg, platform="gpu")
    incumbent = sp.plan_fields(space.check("inc", {"verify": "chain", "block_size": 4}))
    assert incumbent["kernels"]["matmul"]["implementation"] == ["xla"]
    fields, plan = space.rewrite("cand", incumbent, {"weights": "w12"})
    assert plan.weights == "w12" and plan.kernels.matmul.implementation == tuple(cfg.gpu.matmul.w12)
    assert plan.kernels.matmul.implementation[0] == "mosaic"
    fields, plan = space.rewrite("cand", incumbent, {"weights": "w12", "kernels.matmul.implementation": ["xla"]})
    assert plan.kernels.matmul.implementation == ("xla",)


def test_a_chain_becomes_a_tree_and_back(toy):
    _, space = toy
    chain = sp.plan_fields(space.check("inc", {"verify": "chain", "block_size": 4}))
    verify = space.choice("verify")
    to_tree = next(rw for rw in sp.single_field_rewrites(space, chain, verify) if rw["verify"] == "tree")
    assert {rw["verify"] for rw in sp.single_field_rewrites(space, chain, verify)} == {"ar", "tree", "two_level"}
    assert to_tree == {"verify": "tree", "tree.nodes": 8, "tree.depth": 3, "tree.branching": 2}
    fields, plan = space.rewrite("t", chain, to_tree)
    assert plan.verify == "tree" and plan.tree == plan_mod.TreeShape(8, 3, 2)
    assert plan.block_size == plan.tree.width == 8  # the width, not the chain's 4
    assert space.check("t", fields) == plan  # the found fields build the same plan again
    # a tree's shape is searched, its block size is not
    assert not space.choice("block_size").applies(fields)
    assert {f: space.choice(f).applies(fields) for f in ("tree.nodes", "tree.depth", "tree.branching")} == \
        {"tree.nodes": True, "tree.depth": True, "tree.branching": True}
    assert not space.choice("tree.nodes").applies(chain)
    wider = space.rewrite("t2", fields, {"tree.nodes": 12})
    assert wider[1].tree == plan_mod.TreeShape(12, 3, 2) and wider[1].block_size == 12
    too_many = space.rewrite("t3", fields, {"tree.nodes": 64})  # a depth-3 binary tree has 15 nodes
    assert isinstance(too_many, sp.Dropped) and "tree.nodes" in too_many.reason
    back, plan = space.rewrite("c", fields, {"verify": "chain"})
    assert plan.verify == "chain" and plan.tree is None and "tree" not in back


def test_optuna_never_pairs_a_tree_with_a_block_size(toy):
    _, space = toy
    chain = sp.plan_fields(space.check("inc", {"verify": "chain", "block_size": 4}))
    space, _ = space.feasible(chain)  # as the loop searches it: w12 left out of a float32 target
    proposer = props.OptunaProposer(seed=3)
    ctx = props.Context(space, chain, None, set(), [], [], {})
    rewrites = [p.rewrite for p in proposer.propose(ctx, 24)]
    trees = [rw for rw in rewrites if rw.get("verify") == "tree"]
    assert trees, rewrites
    for rw in trees:
        assert "block_size" not in rw and {"tree.nodes", "tree.depth", "tree.branching"} <= set(rw)
        assert not isinstance(space.rewrite("t", chain, rw), sp.Dropped), rw  # a budget the tree can hold
    for rw in rewrites:
        if rw.get("verify", "chain") == "chain":
            assert not any(k.startswith("tree.") for k in rw)


def test_a_chain_becomes_a_two_level_tree_and_its_first_level_changes(toy):
    _, space = toy
    chain = sp.plan_fields(space.check("inc", {"verify": "chain", "block_size": 4}))
    to_two = next(rw for rw in sp.single_field_rewrites(space, chain, space.choice("verify"))
                  if rw["verify"] == "two_level")
    fields, plan = space.rewrite("t", chain, to_two)
    assert plan.verify == "two_level" and plan.tree == plan_mod.TreeShape(8, 3, 2)
    assert plan.two_level == plan_mod.TwoLevel("drafter_confidence", 4) and space.check("t", fields) == plan
    first = space.choice("two_level.first")
    exit_rw = next(rw for rw in sp.single_field_rewrites(space, fields, first))
    assert exit_rw["two_level.first"] == "early_exit" and exit_rw["two_level.exit_layer"] >= 1
    exited, plan = space.rewrite("e", fields, exit_rw)
    assert plan.two_level.first == "early_exit" and plan.two_level.exit_layer == exit_rw["two_level.exit_layer"]
    back, plan = space.rewrite("b", exited, {"two_level.first": "drafter_confidence"})
    assert plan.two_level == plan_mod.TwoLevel("drafter_confidence", 4)  # the exit layer went with early_exit
    _, plan = space.rewrite("c", back, {"verify": "chain"})
    assert plan.tree is None and plan.two_level is None
    assert not space.choice("two_level.keep").applies(chain) and space.choice("tree.nodes").applies(fields)


def test_optuna_two_level_plans_keep_fewer_nodes_than_their_tree(toy):
    _, space = toy
    chain = sp.plan_fields(space.check("inc", {"verify": "chain", "block_size": 4}))
    space, _ = space.feasible(chain)
    proposer = props.OptunaProposer(seed=5)
    rewrites = [p.rewrite for p in proposer.propose(props.Context(space, chain, None, set(), [], [], {}), 32)]
    two = [rw for rw in rewrites if rw.get("verify") == "two_level"]
    assert two, rewrites
    for rw in two:
        got = space.rewrite("t", chain, rw)
        assert not isinstance(got, sp.Dropped), (rw, got)


def test_optuna_asks_again_for_what_the_deployment_cannot_run(toy):
    """Through the engine most batching combinations are impossible (measured pricing without packed
    verification, paged K/V with it, ...): Optuna's proposals are all plans the deployment runs, and each
    impossible draw is told to the study as failed, so the sampler learns from it."""
    cfg, _ = toy
    space = sp.build_space(cfg, workload="engine")
    chain = sp.plan_fields(space.check("inc", {"verify": "chain", "block_size": 4}))
    space, _ = space.feasible(chain)
    proposer = props.OptunaProposer(seed=0)
    out = proposer.propose(props.Context(space, chain, None, set(), [], [], {}), 8)
    assert len(out) == 8
    for p in out:
        assert not isinstance(space.rewrite("t", chain, p.rewrite), sp.Dropped), p.rewrite
    failed = [t for t in proposer.study.trials if t.state == proposer.optuna.trial.TrialState.FAIL]
    assert failed, "no impossible draw: the test no longer exercises the check"


def test_an_early_exit_is_offered_only_where_the_target_s_layers_are_known(tmp_path):
    """A GGUF target not converted yet has no known layer count: the space offers no early exit (a first
    level without a layer to exit after would be an impossible plan); a random target's shape has them."""
    unknown = sp.build_space(toy_cfg("target=smollm2", "drafter.block_size=8", cache_dir=tmp_path))
    assert unknown.choice("two_level.first").values == ("drafter_confidence",)
    assert unknown.choice("two_level.exit_layer") is None
    known = sp.build_space(toy_cfg())
    assert known.choice("two_level.first").values == ("drafter_confidence", "early_exit")
    assert known.choice("two_level.exit_layer") is not None
