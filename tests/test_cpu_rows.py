"""The CPU rows kernel (`pallas_kernels.cpu_rows`): its products against float64 numpy within the float32
summation bound, rows that do not depend on the rows beside them (bit for bit), the panel layout, the
dispatch's fall-through, and a plan that uses it emitting AR's tokens under forcing."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from pallas_kernels import cpu_rows, dispatch
from specpilot.harness import config_schema, runner

needs_kernel = pytest.mark.skipif(not cpu_rows.available(), reason=f"{cpu_rows.unavailable_reason()}")
CHOICE = dispatch.OpChoice(("cpu_rows", "xla"))


def _case(m: int, k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(np.float32), (0.05 * rng.standard_normal((k, n))).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("m,k,n", [(1, 576, 960), (5, 576, 3072), (8, 1536, 576), (17, 128, 64)])
def test_products_within_the_float32_summation_bound(m, k, n):
    x, w = _case(m, k, n)
    y = np.asarray(jax.jit(cpu_rows.rows_matmul)(jnp.asarray(x), cpu_rows.to_panels(jnp.asarray(w))))
    exact = x.astype(np.float64) @ w.astype(np.float64)
    # a sum of K float32 products in any order is within K * 2^-24 * sum |x_k w_k| of the exact sum
    bound = k * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64))
    assert y.dtype == np.float32 and y.shape == (m, n)
    assert np.all(np.abs(y - exact) <= bound)
    assert np.abs(y - exact).max() > 0  # float32 results, not a float64 shortcut
    # the pure-jnp reference (XLA's float32 dot) sits within the same bound, so the two within twice it
    ref = np.asarray(cpu_rows.rows_matmul_reference(jnp.asarray(x), cpu_rows.to_panels(jnp.asarray(w))))
    assert np.all(np.abs(y - ref) <= 2 * bound)


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    x, w = _case(17, 576, 960, seed=1)
    panels = cpu_rows.to_panels(jnp.asarray(w))
    f = jax.jit(cpu_rows.rows_matmul)
    alone = np.stack([np.asarray(f(jnp.asarray(x[i:i + 1]), panels))[0] for i in range(17)])
    for m in (2, 4, 8, 9, 16, 17):  # row tiles of 8: within one, across two, a partial last one
        together = np.asarray(f(jnp.asarray(x[:m]), panels))
        assert np.array_equal(together, alone[:m]), m
    # leading dims are rows too: [B, T, K] is B * T rows
    batched = np.asarray(f(jnp.asarray(x[:16].reshape(2, 8, 576)), panels))
    assert np.array_equal(batched.reshape(16, 960), alone[:16])


def test_panels_hold_the_matrix_exactly_and_refuse_what_they_cannot_lay_out():
    _, w = _case(1, 96, 192)
    panels = cpu_rows.to_panels(jnp.asarray(w))
    assert panels.panels.shape == (3, 96, 64) and panels.shape == (96, 192)
    assert np.array_equal(np.asarray(cpu_rows.from_panels(panels)), w)
    assert np.array_equal(np.asarray(panels.panels[1, 5]), w[5, 64:128])
    with pytest.raises(NotImplementedError, match="N % 64 == 0"):
        cpu_rows.to_panels(jnp.zeros((96, 100), jnp.float32))
    with pytest.raises(NotImplementedError, match="float32"):
        cpu_rows.to_panels(jnp.zeros((96, 128), jnp.bfloat16))


@needs_kernel
def test_the_dispatch_lays_out_what_the_kernel_takes_and_gives_the_rest_to_xla():
    x, w = _case(4, 128, 256)
    prepared = dispatch.prepare_weight(jnp.asarray(w), CHOICE)
    assert isinstance(prepared, cpu_rows.RowPanels)
    y = dispatch.matmul(jnp.asarray(x), prepared, choice=CHOICE)
    assert np.array_equal(np.asarray(y), np.asarray(cpu_rows.rows_matmul(jnp.asarray(x), prepared)))
    odd = jnp.asarray(_case(4, 128, 100)[1])
    assert dispatch.prepare_weight(odd, CHOICE) is odd  # N % 64 != 0: XLA multiplies it as it is
    bf16 = jnp.asarray(w, jnp.bfloat16)
    assert dispatch.prepare_weight(bf16, CHOICE) is bf16
    # a bfloat16 activation falls through to XLA's dot of the same matrix
    y16 = dispatch.matmul(jnp.asarray(x, jnp.bfloat16), prepared, choice=CHOICE)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), x @ w, rtol=0.05, atol=0.1)


@needs_kernel
def test_a_tied_head_gets_the_embeddings_transpose_in_panels_only_when_the_kernel_comes_first():
    rng = np.random.default_rng(3)
    params = {"embed": jnp.asarray(rng.standard_normal((512, 128)), jnp.float32),
              "layers": [{"o": jnp.asarray(rng.standard_normal((128, 128)), jnp.float32)}]}
    prepared = dispatch.prepare_params(params, CHOICE)
    assert isinstance(prepared["tied_head"], cpu_rows.RowPanels) and prepared["embed"] is params["embed"]
    assert np.array_equal(np.asarray(cpu_rows.from_panels(prepared["tied_head"])), np.asarray(params["embed"]).T)
    assert "tied_head" not in dispatch.prepare_params(params, dispatch.OpChoice(("xla", "cpu_rows")))
    assert "tied_head" not in dispatch.prepare_params(params, dispatch.OpChoice(("xla",)))
    untied = {**params, "lm_head": jnp.asarray(rng.standard_normal((128, 512)), jnp.float32)}
    assert "tied_head" not in dispatch.prepare_params(untied, CHOICE)  # its own head is laid out instead
    assert isinstance(dispatch.prepare_params(untied, CHOICE)["lm_head"], cpu_rows.RowPanels)


def test_without_the_kernel_the_weights_stay_as_they_are_for_xla(monkeypatch):
    monkeypatch.setattr(cpu_rows, "_state", {"error": "the CPU rows kernel needs a C++ compiler"})
    assert not cpu_rows.available() and "C++ compiler" in cpu_rows.unavailable_reason()
    x, w = _case(3, 128, 128)
    kept = dispatch.prepare_weight(jnp.asarray(w), CHOICE)
    assert isinstance(kept, jax.Array)
    np.testing.assert_allclose(np.asarray(dispatch.matmul(jnp.asarray(x), kept, choice=CHOICE)), x @ w,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="C.. compiler"):
        cpu_rows.rows_matmul(jnp.asarray(x), cpu_rows.to_panels(jnp.asarray(w)))


def test_an_unwritable_cache_or_a_failing_compiler_leaves_xla_in_charge(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_rows, "_state", {})
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("SPECPILOT_KERNEL_CACHE", str(blocked))  # the cache folder cannot be made
    assert not cpu_rows.available() and "could not be built or loaded" in cpu_rows.unavailable_reason()
    monkeypatch.setattr(cpu_rows, "_state", {})
    monkeypatch.setenv("SPECPILOT_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    assert not cpu_rows.available() and "did not compile" in cpu_rows.unavailable_reason()


@needs_kernel
def test_a_stock_plan_on_the_kernel_emits_ars_tokens_under_forcing():
    config_schema.register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    overrides = ["target=tiny_random", "drafter=oracle", "drafter.tau=3", "drafter.block_size=4",
                 "drafter.num_layers=1", "decoding=stock_cpu", "bench=default", "bench.num_prompts=2",
                 "bench.prompt_len=12", "bench.new_tokens=16", "bench.repeats=1"]
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = config_schema.typed(compose(config_name="config", overrides=overrides))
    records = {r["method"]: r for r in runner.measure(cfg)}
    assert records["stock_rows"]["matmul"] == "cpu_rows+xla"
    assert records["stock_rows"]["mismatches"] == 0 and records["stock"]["mismatches"] == 0
    assert records["stock_rows"]["tau"] == pytest.approx(records["stock"]["tau"])  # the same acceptance
