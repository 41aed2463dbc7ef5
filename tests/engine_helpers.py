"""Helpers for the engine tests: a tiny dense target, staggered workloads, compile counting."""

import contextlib

import jax
import jax.numpy as jnp
from jax import monitoring

from specpilot.models import dense
from specpilot.models.config import ModelConfig

CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, qk_norm=True, tap_layers=(0, 1))
TARGET = dense.target(CFG, jnp.float32)
CAP = 16  # the largest budget in these tests: one ar.generate compile for every reference

# prompts 1..20 tokens long: several are longer than the engines' prefill chunk (8)
PROMPTS = [[1, 2, 3], [5, 9, 11, 40, 7, 3, 2, 8, 8, 1, 60], [17, 4, 99, 23, 5, 6] * 3, [7],
           [33, 21, 8, 2, 90, 14, 14, 3, 77], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
           [120, 3], [45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]
BUDGETS = [10, 6, 12, 9, 16, 7, 13, 11]


def run_staggered(engine, requests, arrivals, cancels=None, max_steps=500):
    """Submit request i at step arrivals[i]; cancel request j right after step cancels[j] (between
    steps); step until every request is done -> handles in request order."""
    cancels = cancels or {}
    handles = [None] * len(requests)
    for step in range(max_steps):
        for i, at in enumerate(arrivals):
            if at == step:
                handles[i] = engine.submit(requests[i])
        engine.step()
        for j, at in cancels.items():
            if at == step:
                engine.cancel(handles[j])
        if step >= max(arrivals) and not engine.busy:
            return handles
    raise AssertionError(f"the engine did not finish within {max_steps} steps")


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compiles (every jit, eager op or AOT compile) inside the block."""
    events = []
    live = [True]

    def listener(event, duration, **kwargs):
        if live[0] and event == "/jax/core/compile/backend_compile_duration":
            events.append(kwargs.get("fun_name", "?"))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        live[0] = False
        unregister = getattr(monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:
            unregister(listener)


def cut_at_stop(tokens, stop):
    """AR's tokens up to and including the first stop token (the whole list without one)."""
    return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens


def jax_version() -> str:
    return jax.__version__
