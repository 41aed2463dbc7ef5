"""The ahead-of-time cache: executables and output shapes kept by signature (function, statics, shapes)."""

import jax
import jax.numpy as jnp

from specpilot.decoding import aot
from specpilot.decoding.aot import CompileCache


def test_output_shapes_are_traced_once_per_signature():
    traces = []

    def fn(scale, x, y):
        traces.append(x.shape)  # runs only while tracing
        return {"sum": (x * scale) @ y, "n": jnp.sum(x, dtype=jnp.int32)}

    cache = CompileCache(max_size=2)
    a, b = jnp.ones((2, 3)), jnp.ones((3, 4))
    got = cache.out_shapes(fn, 2.0, (a, b))
    assert got == jax.eval_shape(lambda x, y: fn(2.0, x, y), a, b)
    assert got["sum"].shape == (2, 4) and got["n"].dtype == jnp.int32
    assert cache.out_shapes(fn, 2.0, (a + 1, b)) is got  # values never matter
    assert cache.out_shapes(fn, 2.0, (jax.ShapeDtypeStruct((2, 3), a.dtype), b)) is got
    assert len(traces) == 2  # the eval_shape of the check above, and the cache's one trace
    assert cache.out_shapes(fn, 2.0, (jnp.ones((5, 3)), b))["sum"].shape == (5, 4)  # a new shape: traced
    assert cache.out_shapes(fn, 3.0, (a, b)) is not got  # another static argument: its own entry
    assert len(traces) == 4 and len(cache._shapes) == 2  # bounded like the executables


def test_recordings_nest_and_keep_only_drops_the_rest():
    cache = CompileCache()

    def fn(scale, x):
        return x * scale

    def run(scale, x):
        return cache.get(fn, scale, (x,), lambda *a: jax.jit(lambda v: fn(scale, v)).lower(*a))(x)

    x = jnp.ones((3,))
    with aot.recording() as outer:
        with aot.recording() as inner:  # equal sets while open: each closes as itself
            run(2.0, x)
        run(3.0, x)
    assert inner < outer and len(outer) == 2
    with aot.recording() as other:
        run(4.0, x)
    assert len(cache) == 3
    assert aot.keep_only(inner | other, [cache]) == 1 and len(cache) == 2  # 3.0's program dropped, the others kept
    compiles = cache.compiles
    run(2.0, x), run(4.0, x)
    assert cache.compiles == compiles
    run(3.0, x)
    assert cache.compiles == compiles + 1
