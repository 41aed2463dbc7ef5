"""A hybrid target (Gated DeltaNet + attention layers) through the engine: per-slot reset of the
recurrent state, chunked prefill and chain commits of per-token states; outputs equal `ar.generate`'s."""

import jax.numpy as jnp
import pytest

from specpilot.decoding import ar
from specpilot.models import drafter as dr
from specpilot.models import hybrid
from specpilot.serving import Engine, Request
from engine_helpers import PROMPTS, run_staggered
from test_hybrid_spec import CFG, hybrid_params

TARGET = hybrid.target(CFG, jnp.float32, max_block_size=8)
BUDGETS = [9, 6, 12, 8, 10, 7]
ARRIVALS = [0, 0, 1, 4, 6, 7]  # 6 requests over 2 slots: every slot is reset and reused


@pytest.fixture(scope="module")
def params():
    return hybrid_params(CFG, 0)


@pytest.fixture(scope="module")
def reference(params):
    res = ar.generate(TARGET, params, PROMPTS[:6], 20)
    return [row.tolist() for row in res.tokens]


@pytest.mark.slow  # ~30 s per plan on 2 CPU cores (hybrid compiles)
@pytest.mark.parametrize("plan", ["ar", "chain"])
def test_hybrid_engine_equals_ar(params, reference, plan):
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4, shift=1, wrong_every=3) if plan == "chain" else None
    # chunks of 5 (under max_block_size: per-token states) and 12 (over it: the chunked form)
    for chunk in (5, 12):
        engine = Engine(TARGET, params, drafter, None, slots=2, context_len=40, prefill_chunk=chunk,
                        sampling=False)
        requests = [Request(p, b, draft_reference=(list(p) + reference[i]) if drafter else None)
                    for i, (p, b) in enumerate(zip(PROMPTS[:6], BUDGETS))]
        handles = run_staggered(engine, requests, ARRIVALS)
        assert [h.tokens for h in handles] == [reference[i][:b] for i, b in enumerate(BUDGETS)], chunk
        if drafter is not None:
            assert engine.stats.tokens_per_row_step > 1.5
