"""Tree and two-level step counts against brute force: the jaxprs of `decoding.tree`'s real phases.

As `test_costmodel_counts`: for each stage, `costmodel_bruteforce` walks the jaxpr of the phase the tree
loop jits (`tree.draft_phase`, `verify_phase`, `accept_phase`) and sums 2*M*N*K over every dot_general
(weight products apart from attention / recurrence products) and the bytes of every weight leaf it
reads; the counts must equal them exactly. A two-level step is `two_level.two_level_step`'s pieces in
its order: the draft phase, then the first level (stage verify) with the verify phase over the kept
nodes, then the accept phase; the whole step's dot FLOPs are checked against that step's jaxpr too.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import costmodel_bruteforce as bf
from specpilot.costmodel import prediction
from specpilot.costmodel.counts import StepCounts, step_counts
from specpilot.costmodel.rates import Rates
from specpilot.costmodel.roofline import Hardware
from specpilot.decoding import spec, tree, two_level
from specpilot.plan import Kernels, OpChoice, Plan, TreeShape, TwoLevel
from test_costmodel_counts import B, DENSE, HYBRID, _compare, _setup

NODES, DEPTH, BRANCHING = 6, 3, 2


def _tree_setup(cfg, dtype, fused=False, oracle=False, tied=False, first=None, keep=None, exit_layer=None):
    chain, tp, dp, state, shape = _setup(cfg, dtype, DEPTH + 1, fused, oracle, tied)
    kw = dict(target=chain.target, drafter=chain.drafter, nodes=NODES, depth=DEPTH, branching=BRANCHING,
              max_new_tokens=16)
    setup = (tree.TreeSetup(**kw) if first is None
             else two_level.TwoLevelSetup(**kw, first=first, keep=keep, exit_layer=exit_layer))
    state = jax.eval_shape(functools.partial(spec._initial_state, setup), state.last, state.target_state,
                           state.draft_state, state.key, state.budget, state.sampling)
    return setup, tp, dp, state, shape


def _tree_plan(first=None, keep=None, exit_layer=None, **kw):
    shape = TreeShape(NODES, DEPTH, BRANCHING)
    if first is None:
        return Plan("tree", verify="tree", block_size=shape.width, tree=shape, **kw)
    return Plan("two_level", verify="two_level", block_size=shape.width, tree=shape,
                two_level=TwoLevel(first, keep, exit_layer), **kw)


CASES = [(DENSE, jnp.float32, False, False, False), (DENSE, jnp.bfloat16, True, False, True),
         (DENSE, jnp.float32, False, True, False), (HYBRID, jnp.float32, False, False, False),
         (HYBRID, jnp.bfloat16, False, True, True)]
IDS = ["dense", "dense-bf16-fused-tied", "dense-oracle", "hybrid", "hybrid-bf16-oracle-tied"]


@pytest.mark.parametrize("cfg,dtype,fused,oracle,tied", CASES, ids=IDS)
def test_tree_step_counts_match_the_jaxpr(cfg, dtype, fused, oracle, tied):
    setup, tp, dp, state, shape = _tree_setup(cfg, dtype, fused, oracle, tied)
    counts = step_counts(_tree_plan(), shape)

    s1, tr = jax.eval_shape(functools.partial(tree.draft_phase, setup), tp, dp, state)
    m, wb = bf.count(lambda w, st: tree.draft_phase(setup, w[0], w[1], st), (tp, dp), state)
    _compare(counts.select("draft"), m, wb)

    s2, tlog, taps = jax.eval_shape(functools.partial(tree.verify_phase, setup), tp, s1, tr)
    m, wb = bf.count(lambda w, st, t: tree.verify_phase(setup, w, st, t), tp, s1, tr)
    _compare(counts.select("verify"), m, wb)

    m, wb = bf.count(lambda w, st, t, tl, tx: tree.accept_phase(setup, w[0], w[1], st, t, tl, tx),
                     (tp, dp), s2, tr, tlog, taps)
    _compare(counts.select("accept"), m, wb)

    whole, _ = bf.count(lambda w, st: tree.tree_step(setup, w[0], w[1], st), (tp, dp), state)
    assert counts.dot_flops == whole.weight_dot_flops + whole.other_dot_flops


def _first_level(setup):
    """`two_level.two_level_step`'s first level: the drafted tree -> the kept subtree."""
    def first(tp, state, full, logprobs):
        scores = two_level.first_level_scores(setup.first, setup.exit_layer, setup.depth, setup.target, tp,
                                              state.target_state, full, logprobs)
        return two_level.select_subtree(full, scores, setup.keep)[0]

    return first


def _named(counts, prefix, keep=True):
    return StepCounts(tuple(k for k in counts.kernels if k.name.startswith(prefix) == keep))


@pytest.mark.parametrize("cfg,first_level,exit_layer", [(DENSE, "early_exit", 1), (HYBRID, "early_exit", 2),
                                                         (HYBRID, "drafter_confidence", None)],
                         ids=["dense-early-exit", "hybrid-early-exit", "hybrid-confidence"])
def test_two_level_counts_match_the_jaxpr(cfg, first_level, exit_layer):
    """The step cut at `two_level_step`'s pieces: the draft phase; the first level and the verify phase
    over the kept nodes (both stage verify: two forwards, each reading its layers' weights); the accept."""
    keep = 4
    setup, tp, dp, state, shape = _tree_setup(cfg, jnp.float32, first=first_level, keep=keep,
                                              exit_layer=exit_layer)
    counts = step_counts(_tree_plan(first_level, keep, exit_layer), shape)
    first = _first_level(setup)
    logprobs = jax.ShapeDtypeStruct((B, DEPTH, cfg.vocab_size), jnp.float32)  # the drafter's [B, Bs - 1, V]

    s1, full = jax.eval_shape(functools.partial(tree.draft_phase, setup), tp, dp, state)
    m, wb = bf.count(lambda w, st: tree.draft_phase(setup, w[0], w[1], st), (tp, dp), state)
    _compare(counts.select("draft"), m, wb)

    verify = counts.select("verify")
    kept = jax.eval_shape(first, tp, s1, full, logprobs)
    m, wb = bf.count(first, tp, s1, full, logprobs)
    _compare(_named(verify, "first_level."), m, wb)
    s2, tlog, taps = jax.eval_shape(functools.partial(tree.verify_phase, setup), tp, s1, kept)
    m, wb = bf.count(lambda w, st, t: tree.verify_phase(setup, w, st, t), tp, s1, kept)
    _compare(_named(verify, "first_level.", keep=False), m, wb)

    m, wb = bf.count(lambda w, st, k, tl, tx: tree.accept_phase(setup, w[0], w[1], st, k, tl, tx),
                     (tp, dp), s2, kept, tlog, taps)
    _compare(counts.select("accept"), m, wb)

    whole, _ = bf.count(lambda w, st: two_level.two_level_step(setup, w[0], w[1], st), (tp, dp), state)
    assert counts.dot_flops == whole.weight_dot_flops + whole.other_dot_flops
    # an early exit's layers run over all nodes, the full forward over the kept ones
    rows = lambda c: {k.m for k in c.kernels if k.cls == "matmul"}  # noqa: E731
    assert rows(_named(verify, "first_level.")) == ({B * NODES} if exit_layer else set())
    assert rows(_named(verify, "target.")) == {B * keep}


def test_two_level_drafter_confidence_costs_the_kept_forward_only():
    _, _, _, _, shape = _tree_setup(DENSE, jnp.float32)
    full = step_counts(_tree_plan(), shape)
    cut = step_counts(_tree_plan("drafter_confidence", 3), shape)
    assert cut.select("draft").total("weight_bytes") == full.select("draft").total("weight_bytes")
    matrices = lambda c: c.select("verify", ("matmul", "lm_head")).total("weight_bytes")  # noqa: E731
    assert matrices(cut) == matrices(full)
    per_row = lambda c: c.select("verify", ("matmul", "lm_head")).dot_flops  # noqa: E731
    assert per_row(cut) * NODES == pytest.approx(per_row(full) * 3)


def test_tree_attention_kernel_reads_the_prefix_and_the_block():
    _, _, _, _, shape = _tree_setup(DENSE, jnp.float32)
    xla = step_counts(_tree_plan(), shape).select("verify", "attention")

    kernel_plan = _tree_plan(kernels=Kernels(tree_attention=OpChoice(("triton", "xla"))))
    triton = step_counts(kernel_plan, shape).select("verify", "attention")
    assert triton.total("flops") / xla.total("flops") == pytest.approx((shape.context + NODES) / shape.slots)
    assert triton.total("floor_bytes") == xla.total("floor_bytes")


def test_bad_tree_shapes_are_refused_by_name():
    _, _, _, _, shape = _tree_setup(HYBRID, jnp.float32)
    deep = TreeShape(8, 5, 2)  # the drafter's block is depth + 1 = 4
    with pytest.raises(ValueError, match="tree.depth"):
        step_counts(Plan("deep", verify="tree", block_size=deep.width, tree=deep), shape)
    wide = TreeShape(12, 3, 3)  # the hybrid target keeps 8 per-node snapshots
    with pytest.raises(ValueError, match="tree.nodes"):
        step_counts(Plan("wide", verify="tree", block_size=wide.width, tree=wide), shape)
    with pytest.raises(ValueError, match="two_level.exit_layer"):
        step_counts(_tree_plan("early_exit", 4, HYBRID.num_layers), shape)
    with pytest.raises(ValueError, match="no drafter"):
        step_counts(_tree_plan(), dataclasses.replace(shape, drafter=None))


RATES = Rates("test", copy_gbs=10.0, launch_us=2.0, host_step_us=5.0, dispatch_us=7.0, matmul_tflops=1.0)


@pytest.mark.parametrize("first,keep,exit_layer", [(None, None, None), ("early_exit", 4, 1),
                                                   ("drafter_confidence", 3, None)],
                         ids=["tree", "early-exit", "confidence"])
def test_predict_times_tree_plans_per_token_at_tau(first, keep, exit_layer):
    _, _, _, _, shape = _tree_setup(DENSE, jnp.float32)
    plan = _tree_plan(first, keep, exit_layer)
    setting = prediction.Setting(shape, RATES, Hardware(100.0, 10.0))
    p = prediction.predict(plan, setting, tau=2.5)
    assert set(p.stages) == {"draft", "verify", "accept"}
    assert p.per_token_s == pytest.approx(p.step_s / 2.5)
    for st in p.stages:
        assert p.floors[st] <= p.stages[st]
    # tau is tokens per step: at most the deepest path plus the bonus token, whatever the node budget
    assert prediction.predict(plan, setting, tau=DEPTH + 1).tau == DEPTH + 1
    with pytest.raises(ValueError, match="tau must be in"):
        prediction.predict(plan, setting, tau=DEPTH + 1.5)
    att = prediction.attribute(plan, setting, prediction.Measurement(per_token_s=1e-3, tau=2.0))
    assert att["measured_ms_per_step"] == pytest.approx(2.0)
    assert sum(r["measured_ms"] for r in att["stages"]) == pytest.approx(2.0)
