"""Paged K/V (`batching.kv: paged`): the pool's write and gather against a preallocated cache, the page
allocator (growth within a reservation, release, exhaustion, no page shared by two live rows, every page back
after completion and cancellation), the engine's outputs equal AR's per request with a pool too small for
every slot's whole context, and the refusals."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot import state as st
from specpilot.decoding import ar
from specpilot.models import drafter as dr
from specpilot.models import hybrid
from specpilot.plan import Batching, Plan, PlanError, TreeShape
from specpilot.serving import Engine, Request, RequestError
from specpilot.serving import pages as pg
from engine_helpers import BUDGETS, CAP, CFG, PROMPTS, TARGET, count_compiles, cut_at_stop, run_staggered
from helpers import random_params
from test_engine import dense_shapes
from test_engine_sampling import ARRIVALS as SAMPLED_ARRIVALS
from test_engine_sampling import alone
from test_engine_sampling import requests as sampled_requests
from test_hybrid_spec import CFG as HYBRID_CFG

ARRIVALS = [0, 0, 0, 1, 2, 2, 6, 7]
CANCELS = {2: 3, 6: 8}  # one request cancelled while it decodes, one soon after it is admitted
PAGED = Batching(kv="paged", page_size=4, pages=18)  # 4 slots x 15 pages would hold every whole context


@pytest.fixture(scope="module")
def params():
    return random_params(dense_shapes(), 0.5, 0)


@pytest.fixture(scope="module")
def reference(params):
    return [row.tolist() for row in ar.generate(TARGET, params, PROMPTS, CAP + 8).tokens]


# --------------------------------------------------------------------------------------------------
# The paged layer


def test_paged_write_and_gather_equal_a_contiguous_cache():
    """Rows write through their page tables into one pool; the gathered view equals a preallocated cache
    written alike, over every page a row holds; slots past them read zeros, and writes there are dropped."""
    b, kvh, d, ps, per_row, t = 3, 2, 4, 4, 5, 6
    table = np.array([[7, 2, 11, 11, 11], [0, 5, 3, 1, 11], [4, 6, 8, 11, 11]], np.int32)  # 11 = no page
    held = np.array([2, 4, 3])
    start = jnp.array([5, 9, 5], jnp.int32)  # row 0 writes past its 2 pages (slots 8..10): dropped
    k = jax.random.normal(jax.random.key(0), (b, t, kvh, d))
    v = jax.random.normal(jax.random.key(1), (b, t, kvh, d))
    paged = st.with_pages(st.TargetState((st.init_paged_attention_state(11, ps, per_row, kvh, d, jnp.float32),),
                                         jnp.zeros(b, jnp.int32)), jnp.asarray(table)).layers[0]
    paged = paged.write(k, v, start)
    full = st.init_attention_state(b, per_row * ps, kvh, d, jnp.float32).write(k, v, start)
    view = paged.gather()
    for row in range(b):
        n = held[row] * ps
        np.testing.assert_array_equal(view.k[row, :, :n], full.k[row, :, :n])
        np.testing.assert_array_equal(view.v[row, :, :n], full.v[row, :, :n])
        assert not np.asarray(view.k[row, :, n:]).any()
    untouched = sorted(set(range(11)) - {int(p) for row in range(b) for p in table[row, :held[row]]})
    assert untouched == [9, 10] and not np.asarray(paged.k[9:]).any()  # no write landed outside the rows' own pages


def test_a_window_of_the_table_reads_and_writes_as_the_whole_table_within_it():
    """The first W columns of the page table (what a step gets where every row holds <= W pages): the view
    is W pages long and equals the whole table's over them; a write past the window is dropped, never
    sent to another row's page."""
    b, kvh, d, ps, per_row, t, w = 2, 1, 2, 2, 6, 3, 3
    table = np.array([[4, 1, 0, 9, 9, 9], [2, 3, 5, 9, 9, 9]], np.int32)  # 9 = no page; 6-8 free
    pool = st.TargetState((st.init_paged_attention_state(9, ps, per_row, kvh, d, jnp.float32),), jnp.zeros(b, jnp.int32))
    k = jax.random.normal(jax.random.key(2), (b, t, kvh, d))
    start = jnp.array([1, 5], jnp.int32)  # row 1 writes slots 5..7: slot 5 in its page 5, slots 6-7 past the window
    whole = st.with_pages(pool, jnp.asarray(table)).layers[0].write(k, k, start)
    window = st.with_pages(pool, jnp.asarray(table[:, :w])).layers[0]
    assert window.columns == w and window.max_len == w * ps and window.pages_per_row == per_row
    window = window.write(k, k, start)
    np.testing.assert_array_equal(window.k, whole.k)  # the whole table drops slots 6-7 too: no page there
    assert not np.asarray(window.k[6:]).any()
    np.testing.assert_array_equal(window.gather().k, whole.gather().k[:, :, : w * ps])
    stored = st.without_pages(st.TargetState((window,), jnp.zeros(b, jnp.int32)))
    assert stored.layers[0].pages_per_row == per_row  # the stored state keeps its shape for every executable


def test_the_window_is_the_narrowest_size_holding_every_row():
    assert pg.window_sizes(14) == (2, 4, 7, 14) and pg.window_sizes(258) == (33, 65, 129, 258)
    assert pg.window_sizes(3) == (1, 2, 3) and pg.window_sizes(1) == (1,)
    kv = pg.PagedKV(pg.PageLayout(num_pages=64, page_size=4, pages_per_row=40), slots=2, block_size=4,
                    max_len=160, margin=8)
    assert kv.window() == 5  # nothing held yet: windows of 5, 10, 20 and 40 pages
    kv.alloc.reserve(0, 20), kv.alloc.reserve(1, 30)
    kv.alloc.grow(0, 36)  # 9 pages
    assert kv.window() == 10 and kv.table_window(10).shape == (2, 10)
    kv.alloc.grow(1, 4 * 30)
    assert kv.window() == 40


def test_without_pages_keeps_the_pool_and_drops_the_table():
    layer = st.init_paged_attention_state(4, 2, 3, 1, 2, jnp.float32)
    ts = st.with_pages(st.TargetState((layer,), jnp.zeros(2, jnp.int32)), jnp.zeros((2, 3), jnp.int32))
    assert ts.layers[0].pages.shape == (2, 3) and ts.max_len == 6
    stored = st.without_pages(ts)
    assert stored.layers[0].pages is None and stored.layers[0].k is ts.layers[0].k and stored.max_len == 6


# --------------------------------------------------------------------------------------------------
# The allocator


def check_invariants(alloc: pg.PageAllocator) -> None:
    """Every page is free or held by exactly one slot, held pages sit at the front of their slot's table row,
    and no slot holds more than its reservation."""
    n = alloc.layout.num_pages
    held = [int(p) for slot in range(len(alloc.held)) for p in alloc.table[slot, :alloc.held[slot]]]
    assert sorted(held + alloc.free) == list(range(n))  # no page twice, none lost
    assert (alloc.table[np.arange(alloc.table.shape[1])[None, :] >= alloc.held[:, None]] == n).all()
    assert (alloc.held <= alloc.reserved).all()


def test_allocator_grows_within_reservations_and_frees():
    alloc = pg.PageAllocator(pg.PageLayout(num_pages=10, page_size=4, pages_per_row=6), slots=3)
    assert alloc.reserve(0, 4) and alloc.reserve(1, 5)
    assert not alloc.reserve(2, 2) and alloc.reserved[2] == 0  # 10 - 9 promised: one left
    assert alloc.reserve(2, 1)
    alloc.grow(0, 5)  # slots 0..4: two pages
    alloc.grow(1, 1)
    assert list(alloc.held) == [2, 1, 0] and alloc.in_use() == 3 and alloc.unpromised == 0
    alloc.grow(0, 100)  # capped by the reservation
    assert alloc.held[0] == 4
    check_invariants(alloc)
    with pytest.raises(RuntimeError, match="release it first"):
        alloc.reserve(0, 1)
    alloc.release(0)
    assert alloc.held[0] == 0 and (alloc.table[0] == 10).all() and alloc.unpromised == 4
    check_invariants(alloc)
    alloc.release(1), alloc.release(2)
    assert alloc.in_use() == 0 and len(alloc.free) == 10 and alloc.unpromised == 10


def test_allocator_random_schedule_keeps_its_invariants():
    rng = np.random.default_rng(0)
    layout = pg.PageLayout(num_pages=24, page_size=8, pages_per_row=8)
    alloc = pg.PageAllocator(layout, slots=5)
    lengths = np.zeros(5, int)
    for _ in range(400):
        slot = int(rng.integers(5))
        if alloc.reserved[slot] == 0:
            if alloc.reserve(slot, int(rng.integers(1, 9))):
                lengths[slot] = 0
        elif rng.random() < 0.15:
            alloc.release(slot)
        else:
            lengths[slot] += int(rng.integers(0, 12))
            alloc.grow(slot, lengths[slot])
            assert alloc.held[slot] == min(layout.pages_for(lengths[slot]), alloc.reserved[slot])
        check_invariants(alloc)
    for slot in range(5):
        alloc.release(slot)
    assert alloc.in_use() == 0 and sorted(alloc.free) == list(range(24))


# --------------------------------------------------------------------------------------------------
# The engine


def run_checked(engine, requests, arrivals, cancels):
    """run_staggered, checking the allocator after every step: invariants hold, only live slots hold pages."""
    step = engine.step

    engine.windows = set()

    def checked_step():
        got = step()
        engine.windows.add(engine.last_window)
        alloc = engine.paged.alloc
        check_invariants(alloc)
        live = {h.slot for h in engine.table if h is not None}
        assert {s for s in range(engine.slots) if alloc.held[s] or alloc.reserved[s]} <= live
        return got

    engine.step = checked_step
    return run_staggered(engine, requests, arrivals, cancels)


@pytest.fixture(scope="module")
def block_drafter():
    dcfg = dr.DrafterConfig.for_target(CFG, num_layers=1, block_size=4)
    return dr.BlockDrafter(dcfg, CFG), random_params(dr.param_shapes(dcfg), 0.5, 1)


@pytest.mark.parametrize("plan", ["ar", "chain"])
def test_paged_engine_equals_ar_under_arrivals_departures_and_cancellations(params, reference, block_drafter, plan):
    drafter, dparams = block_drafter if plan == "chain" else (None, None)
    engine = Engine(TARGET, params, drafter, dparams, slots=4, context_len=48, prefill_chunk=8, sampling=False,
                    batching=PAGED)
    requests = [Request(p, b, stop_token=reference[i][3] if i == 1 else None)
                for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))]
    handles = run_checked(engine, requests, ARRIVALS, CANCELS)
    for i, (h, r) in enumerate(zip(handles, requests)):
        want = cut_at_stop(reference[i][: r.max_new_tokens], r.stop_token)
        if i in CANCELS:
            assert h.finish_reason == "cancelled" and h.tokens == want[: len(h.tokens)], i
        else:
            assert h.tokens == want, i
    assert engine.paged.deferred > 0  # some request waited for pages while a slot was free
    assert {"4", "7"} <= engine.windows  # steps read 4- and 7-page windows of the 14-page table
    assert engine.paged.alloc.in_use() == 0 and sorted(engine.paged.alloc.free) == list(range(18))
    assert 0 < engine.stats.peak_pages <= 18 and engine.stats.pages_per_row > 1


def test_page_windows_compiled_in_the_background_are_taken_once_ready(params, reference):
    """warm_up(compact_in_background=True): steps read the whole table until a window's executable is
    built, then the window; outputs are AR's either way and no step compiles."""
    engine = Engine(TARGET, params, slots=2, context_len=48, prefill_chunk=8, sampling=False,
                    batching=Batching(kv="paged", page_size=4))
    engine.warm_up(compact_in_background=True)
    want = 2 * (len(pg.window_sizes(engine.paged.layout.pages_per_row)) - 1)  # prefill and decode per window
    deadline = time.monotonic() + 120
    while len(engine._extras_ready) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(engine._extras_ready) == want
    windows = set()
    with count_compiles() as compiles:
        handles = [engine.submit(Request(p, 12)) for p in PROMPTS[:2]]
        while engine.busy:
            engine.step()
            windows.add(engine.last_window)
    assert compiles == [] and windows - {""}  # some steps read a narrower window
    assert [h.tokens for h in handles] == [reference[i][:12] for i in range(2)]


def test_paged_sampled_requests_equal_single_runs(params):
    engine = Engine(TARGET, params, slots=3, context_len=48, prefill_chunk=8,
                    batching=Batching(kv="paged", page_size=8, pages=10))
    reqs = sampled_requests()
    handles = run_staggered(engine, reqs, SAMPLED_ARRIVALS)
    assert [h.tokens for h in handles] == [alone(lambda *a, **k: ar.generate(TARGET, params, *a, **k), r)
                                           for r in reqs]


def test_request_larger_than_the_pool_is_refused_alone(params, reference):
    engine = Engine(TARGET, params, slots=2, context_len=48, prefill_chunk=8, sampling=False,
                    batching=Batching(kv="paged", page_size=4, pages=6))
    with pytest.raises(RequestError, match=r"request\.max_new_tokens: .*7 K/V pages .*pool holds 6.*batching\.pages"):
        engine.submit(Request(PROMPTS[5], 7))  # 20 + 7 + 1 slots: 7 pages
    h = engine.submit(Request(PROMPTS[0], 8))
    engine.run()
    assert h.tokens == reference[0][:8]


def test_paged_refusals(params, block_drafter):
    drafter, dparams = block_drafter
    paged = {"kv": "paged"}
    for batching, field in ((Batching(**paged, verify="packed", draft_budget="confidence", token_budget=8), "verify"),
                            (Batching(**paged, overlap="halves"), "overlap")):
        with pytest.raises(NotImplementedError, match=rf"batching\.kv: .*batching\.{field}"):
            Engine(TARGET, params, drafter, dparams, slots=2, context_len=32, batching=batching)
    with pytest.raises(NotImplementedError, match=r"batching\.kv: .*tree plans"):
        Engine(TARGET, params, drafter, dparams, slots=2, context_len=32, batching=Batching(**paged),
               tree=TreeShape(nodes=4, depth=3, branching=1))
    with pytest.raises(NotImplementedError, match=r"batching\.kv: .*attention-only"):
        pg.check_pageable(Batching(**paged), hybrid.target(HYBRID_CFG, jnp.float32), None)
    with pytest.raises(NotImplementedError, match=r"batching\.kv: .*one device"):
        pg.check_pageable(Batching(**paged), TARGET.with_mesh(object()), None)


# --------------------------------------------------------------------------------------------------
# The plan fields


def test_plan_fields_default_to_contiguous_and_are_checked():
    assert (Batching().kv, Batching().page_size, Batching().pages) == ("contiguous", 16, None)
    plan = Plan(name="stock", verify="chain", block_size=4, batching=Batching(kv="paged", page_size=32, pages=512))
    assert plan.batching.kv == "paged" and pg.PageLayout.of(plan.batching, 64, 4100).pages_per_row == 129
    assert pg.PageLayout.of(Batching(kv="paged", page_size=16), 4, 100) == pg.PageLayout(28, 16, 7)
    bad = [({"kv": "pages"}, "chain", r"batching\.kv: 'pages' is not one of"),
           ({"page_size": 0}, "chain", r"batching\.page_size: must be a positive integer"),
           ({"pages": 2.5}, "chain", r"batching\.pages: must be a positive integer or null"),
           ({"kv": "paged", "verify": "packed", "draft_budget": "confidence"}, "chain",
            r"batching\.kv: paged K/V is not implemented with batching\.verify='packed'"),
           ({"kv": "paged", "overlap": "halves"}, "chain", r"batching\.kv: .*batching\.overlap='halves'")]
    for fields, verify, match in bad:
        with pytest.raises(PlanError, match=r"decoding\.plans\.stock\." + match):
            Plan(name="stock", verify=verify, block_size=4, batching=Batching(**fields))
    with pytest.raises(PlanError, match=r"decoding\.plans\.wide\.batching\.kv: paged K/V runs ar and chain"):
        Plan(name="wide", verify="tree", block_size=4, tree=TreeShape(nodes=4, depth=3, branching=1),
             batching=Batching(kv="paged"))
