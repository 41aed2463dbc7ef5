"""Rates: the stored record round-trips, matmul lookups interpolate in M, bad records are refused."""

import pytest
from omegaconf import OmegaConf

from specpilot.costmodel.rates import RATES_DIR, MatmulTable, Rates

TABLE = MatmulTable("xla/bf16", (1, 4, 16), ((64, 128), (128, 128)), ((1e-6, 2e-6, 8e-6), (2e-6, 3e-6, 9e-6)))


def test_lookup_interpolates_in_m_and_falls_back_to_the_tables_bandwidth():
    assert TABLE.time_s(4, 64, 128) == (2e-6, True)
    assert TABLE.time_s(2, 64, 128)[0] == pytest.approx(1e-6 + (2e-6 - 1e-6) / 3)
    assert TABLE.time_s(32, 128, 128)[0] == pytest.approx(9e-6 + (9e-6 - 3e-6) / 12 * 16)
    t, exact = TABLE.time_s(1, 256, 256)
    assert not exact
    bw = sorted([(64 * 128 * 2 + (64 + 128) * 2) / 1e-6, (128 * 128 * 2 + 256 * 2) / 2e-6])
    assert t == pytest.approx((256 * 256 * 2 + 512 * 2) / (sum(bw) / 2))


def test_rates_round_trip(tmp_path):
    r = Rates("cpu", 7.0, 0.4, 0.01, 6.0, 0.2, {"xla/bf16": TABLE}, "test")
    r.save(tmp_path / "x.yaml")
    back = Rates.load(tmp_path / "x.yaml")
    assert back.matmul["xla/bf16"].time_s(4, 128, 128) == (3e-6, True)
    assert back.copy_gbs == 7.0 and back.calibrated


def test_merging_tables_of_different_m_grids_keeps_every_shape_on_its_own_grid(tmp_path):
    """Calibrating a second deployment on another M grid adds its shapes; the first's stay, still looked
    up on the grid they were measured on, and both survive a save and load."""
    other = MatmulTable("xla/bf16", (1, 8), ((64, 128), (256, 64)), ((5e-6, 6e-6), (4e-6, 12e-6)))
    m = TABLE.merged(other)
    assert set(m.shapes) == {(64, 128), (128, 128), (256, 64)}
    assert m.time_s(4, 128, 128) == (3e-6, True)  # the first table's shape, its grid (1, 4, 16)
    assert m.time_s(4, 64, 128)[0] == pytest.approx(5e-6 + (6e-6 - 5e-6) * 3 / 7)  # other wins, grid (1, 8)
    assert m.time_s(8, 256, 64) == (12e-6, True)
    Rates("cpu", 7.0, 0.4, 0.01, 6.0, 0.2, {"xla/bf16": m}, "test").save(tmp_path / "m.yaml")
    back = Rates.load(tmp_path / "m.yaml").matmul["xla/bf16"]
    for mm, k, n in ((4, 128, 128), (2, 64, 128), (16, 128, 128), (5, 256, 64)):
        assert back.time_s(mm, k, n) == pytest.approx(m.time_s(mm, k, n))
    with pytest.raises(ValueError, match="one M grid per shape"):
        MatmulTable("xla/bf16", (1, 8), ((8, 8),), ((1.0, 1.0),), grids=((1, 8), (1, 8)))


def test_missing_file_and_fields_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibrate.py"):
        Rates.load(tmp_path / "none.yaml")
    with pytest.raises(ValueError, match="copy_gbs"):
        Rates.from_dict({"device": "x", "launch_us": 1, "host_step_us": 1, "dispatch_us": 1, "matmul_tflops": 1})
    with pytest.raises(ValueError, match="increasing"):
        MatmulTable("xla/bf16", (4, 1), ((8, 8),), ((1.0, 1.0),))


def test_gpu_without_a_rates_file_falls_back_to_its_datasheet(tmp_path):
    gpu = OmegaConf.create({"name": "b200", "memory_bandwidth_gbs": 8000.0, "matmul_tflops_bf16": 2250.0})
    r = Rates.for_gpu(gpu, tmp_path)
    assert not r.calibrated and r.copy_gbs == 8000.0 and r.launch_us == 0.0


def test_the_stored_cpu_rates_load():
    r = Rates.load(RATES_DIR / "cpu.yaml")
    assert r.copy_gbs > 0 and "xla/f32" in r.matmul


@pytest.mark.parametrize("name", sorted(p.stem for p in RATES_DIR.glob("*.yaml")))
def test_every_stored_rates_file_is_what_its_gpu_config_reads(name):
    """Each shipped calibration loads through its gpu config (the file a run of gpu=<name> prices with),
    says where it was measured, and holds a positive time for every product it measured."""
    gpu = OmegaConf.load(RATES_DIR.parent / f"{name}.yaml")
    r = Rates.for_gpu(gpu)
    assert r.calibrated and r.copy_gbs > 0 and r.matmul
    raw = OmegaConf.load(RATES_DIR / f"{name}.yaml")
    assert "calibrate.py" in raw.source
    for table in r.matmul.values():
        assert all(t > 0 for row in table.seconds for t in row), table.impl


@pytest.mark.slow
def test_calibrate_measures_the_grid_it_is_given_and_the_plans_m(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "rates.yaml"
    proc = subprocess.run([sys.executable, str(root / "experiments" / "bench" / "calibrate.py"), "target=tiny_random",
                           "drafter=none", "decoding=ar", "bench=default", "bench.batch_size=3",
                           "bench.num_prompts=3", "+calibrate.repeats=1", "+calibrate.min_bytes=200000",
                           "+calibrate.grid=[1,2]", f"+calibrate.out={out}", f"hydra.run.dir={tmp_path / 'h'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rates = Rates.load(out)
    assert rates.calibrated and rates.copy_gbs > 0
    ms = {impl: set(t.ms) for impl, t in rates.matmul.items()}
    # the grid given, and the batch the AR plan multiplies at (3 rows): nothing of the default grid
    assert ms and all({1, 2} <= m <= {1, 2, 3} for m in ms.values()) and any(3 in m for m in ms.values()), ms
    bad = subprocess.run([sys.executable, str(root / "experiments" / "bench" / "calibrate.py"), "target=tiny_random",
                          "drafter=none", "decoding=ar", "+calibrate.grid=[0]", f"+calibrate.out={out}",
                          f"hydra.run.dir={tmp_path / 'h2'}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "calibrate.grid" in bad.stderr + bad.stdout


def test_per_launch_time_cancels_a_call_s_fixed_cost(monkeypatch):
    """A call that costs a fixed 20 ms plus 0.5 ms per launch: the fixed cost (40x a launch, as a GPU's
    dispatch is against a small product) must not reach the per-launch figure. The call advances a fake
    clock by its cost, with a jitter of up to 0.1 ms (what sleeps overshoot by on a loaded machine), so
    the check does not depend on the machine's load. Tolerance 20%."""
    import importlib.util
    import types
    from pathlib import Path

    import numpy as np

    spec = importlib.util.spec_from_file_location(
        "calibrate", Path(__file__).resolve().parents[1] / "experiments" / "bench" / "calibrate.py")
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    clock, jitter = [0.0], np.random.default_rng(0)
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    copies, launch_s, fixed_s = 4, 5e-4, 2e-2
    calls = []

    def run(passes):
        calls.append(passes)
        clock[0] += fixed_s + passes * copies * launch_s + jitter.uniform(0, 1e-4)

    got = calibrate.per_launch_s(run, copies, loop_s=0.0, repeats=3, min_call_s=2e-2)
    assert abs(got - launch_s) / launch_s < 0.2, got
    naive = (fixed_s + copies * launch_s) / copies  # one call divided by its launches
    assert naive > 10 * launch_s  # what the difference removes
    assert len(set(calls)) == 2 and min(calls) == 1  # two pass counts, each warmed up and repeated
