"""A plan's draft width (`Plan.draft_width`): checked, given to a block drafter by the deployment (refused for
a drafter that replays a reference), counted by the cost model like the drafter's own setting, lossless
through the harness, and a choice of the loop's rewrite space."""

import dataclasses

import numpy as np
import pytest

from agent_helpers import toy_cfg
from specpilot.agent import space as sp
from specpilot.costmodel.counts import step_counts
from specpilot.decoding import ar, spec
from specpilot.harness import deploy, shapes
from specpilot.harness.config_errors import ConfigValueError
from specpilot.harness.config_schema import build_plans
from specpilot.models import drafter as dr
from specpilot.plan import Plan, PlanError, build


def test_the_field_is_checked_and_read_from_config():
    assert Plan("stock", verify="chain", block_size=4, draft_width=8).draft_width == 8
    assert Plan("stock", verify="chain", block_size=4).draft_width is None
    for bad in (0, -2, 2.5, True):
        with pytest.raises(PlanError, match=r"decoding\.plans\.stock\.draft_width: must be a positive"):
            Plan("stock", verify="chain", block_size=4, draft_width=bad)
    with pytest.raises(PlanError, match=r"decoding\.plans\.ar\.draft_width: an ar plan drafts nothing"):
        Plan("ar", verify="ar", draft_width=4)
    plan = build("wide", {"verify": "chain", "block_size": 4, "draft_width": 8}, drafter_block_size=8,
                 default_matmul={"bf16": ["xla"]})
    assert plan.draft_width == 8 and sp.plan_fields(plan)["draft_width"] == 8
    assert "draft_width" not in sp.plan_fields(dataclasses.replace(plan, draft_width=None))


@pytest.fixture(scope="module")
def toy():
    cfg = toy_cfg()
    plans = {p.name: p for p in build_plans(cfg)}
    plans["narrow"] = dataclasses.replace(plans["stock"], name="narrow", block_size=4)
    plans["wide"] = dataclasses.replace(plans["narrow"], name="wide", draft_width=8)
    return cfg, plans, deploy.build(cfg, list(plans.values()))


def test_the_deployment_drafts_as_wide_as_the_plan_says_and_stays_lossless(toy):
    cfg, plans, dep = toy
    assert dep.drafter_for(plans["narrow"])[0].draft_width is None
    drafter, dparams = dep.drafter_for(plans["wide"])
    assert isinstance(drafter, dr.BlockDrafter) and drafter.draft_width == 8
    prompts = [p[:12] for p in dep.prompts[:2]]
    want = ar.generate(dep.target_for(plans["ar"]), dep.params_for(plans["ar"]), prompts, 10).tokens
    got = spec.generate(dep.target_for(plans["wide"]), dep.params_for(plans["wide"]), drafter, dparams, prompts, 10,
                        block_size=4).tokens
    np.testing.assert_array_equal(np.asarray(got)[:, :10], np.asarray(want)[:, :10])


def test_a_replaying_drafter_refuses_a_draft_width(toy):
    cfg, plans, dep = toy
    replay = dataclasses.replace(dep, drafter=(dr.ReplayDrafter(vocab_size=dep.cfg.vocab_size, block_size=8), None))
    with pytest.raises(ConfigValueError, match=r"decoding\.plans\.wide\.draft_width: a ReplayDrafter does not draft"):
        replay.drafter_for(plans["wide"])


def test_the_cost_model_counts_the_plan_s_width_over_the_drafter_s(toy):
    cfg, plans, dep = toy
    shape = shapes.cost_shape(cfg, list(plans.values()))
    assert shape.draft_width == 0  # the toy drafter's own setting: as wide as the plan's block
    narrow = step_counts(plans["narrow"], shape).select("draft").total("flops")
    wide = step_counts(plans["wide"], shape).select("draft").total("flops")
    as_drafter = step_counts(plans["narrow"], dataclasses.replace(shape, draft_width=8)).select("draft").total("flops")
    assert wide == as_drafter and wide > 1.5 * narrow


def test_the_rewrite_space_offers_widths_for_a_block_drafter_only():
    space = sp.build_space(toy_cfg())
    choice = space.choice("draft_width")
    assert choice.values == (4, 8) and choice.targets == ("draft",)
    assert choice.applies({"verify": "chain"}) and not choice.applies({"verify": "tree"})
    assert sp.build_space(toy_cfg("drafter.source=oracle")).choice("draft_width") is None
