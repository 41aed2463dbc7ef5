"""Data and tensor parallelism through the engine: slots spread over the mesh's data axis, heads over its
tensor axis; each request's output equals one-device `ar.generate`'s, and the slot state is sharded as
the plan's mesh says (inspected, not only the outputs)."""

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from specpilot import sharding
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.serving import Engine, Request
from engine_helpers import CFG, run_staggered
from test_engine import params, reference  # noqa: F401 (the same module fixtures)
from test_engine import ARRIVALS, CANCELS, check_outputs, requests_with_stops


def _mesh(data, tensor):
    return sharding.make_mesh(sharding.MeshShape(data=data, tensor=tensor))


@pytest.mark.parametrize("data,tensor,chain", [(2, 2, False), (2, 1, True), (4, 1, False)])
def test_sharded_engine_equals_one_device_ar(params, reference, data, tensor, chain):
    mesh = _mesh(data, tensor)
    target = dense.target(CFG, jnp.float32, mesh)
    drafter = dr.ReplayDrafter(CFG.vocab_size, 4, shift=1, wrong_every=3).with_mesh(mesh) if chain else None
    engine = Engine(target, sharding.shard_params(params, mesh), drafter, None, slots=4, context_len=48,
                    prefill_chunk=8, sampling=False)
    requests = requests_with_stops(reference)
    if chain:
        requests = [Request(r.prompt_ids, r.max_new_tokens, stop_token=r.stop_token,
                            draft_reference=list(r.prompt_ids) + reference[i]) for i, r in enumerate(requests)]
    handles = run_staggered(engine, requests, ARRIVALS, CANCELS)
    check_outputs(handles, requests, reference)
    state = engine.state.target_state
    assert state.lengths.sharding.spec == P("data")
    k = state.layers[0].k
    assert k.sharding.mesh.shape == {"data": data, "tensor": tensor}
    assert k.sharding.spec[0] == "data"  # slots over the data axis
    shard_rows = {s.data.shape[0] for s in k.addressable_shards}
    assert shard_rows == {4 // data}
    if chain:
        assert engine.stats.tokens_per_row_step > 1.5


def test_slots_must_divide_over_the_data_axis(params):
    mesh = _mesh(2, 1)
    target = dense.target(CFG, jnp.float32, mesh)
    with pytest.raises(sharding.MeshError, match="slots"):
        Engine(target, sharding.shard_params(params, mesh), slots=3, context_len=48, prefill_chunk=8)
