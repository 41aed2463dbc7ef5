"""Compact decodes (`serving.compact`): the engine decodes only its decoding rows over the cache slots they
use, and each request's tokens stay those of `ar.generate` for it alone, across window sizes, row counts,
arrivals and departures; the plain decode is used where nothing is left to cut."""

import time

import numpy as np
import pytest

from specpilot.decoding import ar
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.serving import Engine, Request
from specpilot.serving import compact as cp
from engine_helpers import CFG, PROMPTS, TARGET, count_compiles, run_staggered
from helpers import random_params

NEW = [150, 40, 170, 12, 90, 160, 30, 120]  # long enough to cross the 128- and 256-slot windows
ARRIVALS = [0, 0, 1, 3, 3, 30, 60, 61]


@pytest.fixture(scope="module")
def params():
    return random_params(dense.param_shapes(CFG), 0.5, 0)


@pytest.fixture(scope="module")
def reference(params):
    return [row.tolist() for row in ar.generate(TARGET, params, PROMPTS, max(NEW)).tokens]


def test_shapes_and_choice():
    assert cp.buckets(4) == [1, 2] and cp.buckets(1) == [] and cp.windows(2080) == [128, 256, 512, 1024]
    assert cp.choose(1, 100, 4, 2080) == (1, 128)
    assert cp.choose(3, 300, 4, 2080) == (4, 512)
    assert cp.choose(4, 1500, 4, 2080) is None  # every row, every slot: the plain decode
    assert cp.choose(1, 1500, 1, 2080) is None and cp.choose(1, 100, 1, 2080) == (1, 128)
    assert set(cp.shapes(4, 400)) == {(a, w) for a in (1, 2, 4) for w in (128, 256, 400)} - {(4, 400)}


@pytest.mark.parametrize("plan", ["ar", "chain"])
def test_compact_decodes_equal_ar_per_request(params, reference, plan):
    drafter = dparams = None
    if plan == "chain":
        dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=4)
        drafter, dparams = dr.BlockDrafter(dcfg, CFG), random_params(dr.param_shapes(dcfg), 0.5, 1)
    engine = Engine(TARGET, params, drafter, dparams, slots=4, context_len=400, prefill_chunk=8, sampling=False,
                    compact=True)
    handles = run_staggered(engine, [Request(p, n) for p, n in zip(PROMPTS, NEW)], ARRIVALS, max_steps=2000)
    for i, h in enumerate(handles):
        assert h.tokens == reference[i][: NEW[i]], i
    windows = {int(k.split("x")[1]) for k, _ in engine._exes if k.startswith("compact")}
    assert {128, 256} <= windows, windows  # short rows attended over fewer slots than the state holds
    assert engine.stats.compact_calls > 0


def test_warm_up_compiles_every_compact_decode(params):
    engine = Engine(TARGET, params, slots=2, context_len=200, prefill_chunk=8, sampling=False, compact=True)
    engine.warm_up()
    with count_compiles() as compiles:
        handles = run_staggered(engine, [Request(p, 100) for p in PROMPTS[:3]], [0, 0, 5])
    assert compiles == [] and all(len(h.tokens) == 100 for h in handles)
    assert engine.stats.compact_calls > 0


def test_compact_off_decodes_every_slot(params, reference):
    engine = Engine(TARGET, params, slots=2, context_len=48, prefill_chunk=8, sampling=False, compact=False)
    handle = engine.submit(Request(PROMPTS[0], 20))
    engine.run()
    assert handle.tokens == reference[0][:20] and engine.stats.compact_calls == 0
    assert np.isclose(engine.stats.forward_tokens, 2 * engine.stats.decode_calls)


def test_background_compiles_leave_steps_on_the_plain_decode_until_ready(params, reference):
    engine = Engine(TARGET, params, slots=2, context_len=200, prefill_chunk=8, sampling=False, compact=True)
    engine.warm_up(compact_in_background=True)
    first = run_staggered(engine, [Request(p, 60) for p in PROMPTS[:3]], [0, 0, 5])  # while compiling
    want = len(cp.shapes(2, engine.setup.max_len))
    deadline = time.monotonic() + 120
    while len(engine._extras_ready) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine._extras_ready) == want
    calls = engine.stats.compact_calls
    again = run_staggered(engine, [Request(p, 60) for p in PROMPTS[:3]], [0, 0, 5])
    for i, h in enumerate(first + again):
        assert h.tokens == reference[i % 3][:60], i
    assert engine.stats.compact_calls > calls  # once ready, the steps take them
