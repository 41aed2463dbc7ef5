"""The checks before a deployment is built: the gpu config names the device jax sees, the deployment fits
its memory, the drafter fits its target; each from shapes alone, failing in one line."""

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from hydra import compose, initialize_config_dir

from specpilot.harness import config_schema, deploy, devices, fit, shapes
from specpilot.harness.config_errors import ConfigValueError
from pallas_kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]
config_schema.register()
TINY = ["target=tiny_random", "drafter=none", "decoding=ar", "bench=default"]
GB = 10**9


def _compose(overrides=(), config="config"):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return config_schema.typed(compose(config_name=config, overrides=list(overrides)))


def _with_memory(monkeypatch, free_bytes):
    monkeypatch.setattr(fit, "available", lambda device: (free_bytes, "available RAM on this machine"))


@pytest.mark.parametrize("name,platform,kind,ok", [
    ("cpu", "cpu", "cpu", True), ("h200", "cpu", "cpu", False), ("cpu", "gpu", "NVIDIA H200", False),
    ("h200", "gpu", "NVIDIA H200", True), ("h200", "gpu", "NVIDIA H200 NVL", True),
    ("h200", "gpu", "NVIDIA GH200 480GB", False), ("h100", "gpu", "NVIDIA H100 80GB HBM3", True),
    ("a100", "gpu", "NVIDIA A100-SXM4-80GB", True), ("h100", "gpu", "NVIDIA H200", False)])
def test_a_gpu_config_matches_the_device_it_names(name, platform, kind, ok):
    assert devices.gpu_matches(name, platform, kind) is ok


def test_the_fix_names_the_devices_own_config():
    assert devices.gpu_name_for("gpu", "NVIDIA H200") == "h200"
    assert devices.gpu_name_for("gpu", "NVIDIA A100-SXM4-80GB") == "a100"
    assert devices.gpu_name_for("cpu", "cpu") == "cpu"


def test_a_mismatched_gpu_is_refused_unless_allowed():
    assert jax.devices()[0].platform == "cpu"  # these tests run on the CPU
    with pytest.raises(devices.DeviceMismatchError, match=r"^gpu=h100 but jax sees a CPU .*use gpu=cpu, or "
                                                          r"gpu.allow_mismatch=true"):
        devices.check_gpu(_compose([*TINY, "gpu=h100"]))
    note = devices.check_gpu(_compose([*TINY, "gpu=h100", "gpu.allow_mismatch=true"]))
    assert "gpu=h100" in note and "gpu.allow_mismatch" in note
    assert devices.check_gpu(_compose(TINY)) is None
    # composing and validating another device's config stays possible (predict.py, the README's commands)
    config_schema.validate(_compose([*TINY, "gpu=h200"]))


def test_the_8b_shape_does_not_fit_8_gb_and_a_tiny_target_does(monkeypatch):
    _with_memory(monkeypatch, 8 * GB)
    cfg = _compose(["experiment=ar_qwen3_8b_h200", "gpu=cpu"])
    plans = config_schema.build_plans(cfg)
    need = fit.needs(cfg, plans, batch=1, slots=896, on_cpu=True)
    assert 16.3 * GB < need.weights < 16.5 * GB  # 8.19 B parameters at 2 bytes
    assert need.total > need.weights + need.cache
    with pytest.raises(fit.DoesNotFitError, match=r"^the deployment needs at least 25\.\d GB but there is 8\.0 GB "
                                                  r"of available RAM.*smaller target.*bench.batch_size"):
        fit.check(cfg, plans)
    tiny = _compose(TINY)
    assert fit.check(tiny, config_schema.build_plans(tiny)).total < 0.1 * GB


def test_the_cache_grows_with_slots_and_the_weight_formats_add_copies():
    cfg = _compose(["experiment=stock_qwen3_8b_h200", "gpu=cpu", "decoding=w12"])
    plans = config_schema.build_plans(cfg)
    small = fit.needs(cfg, plans, batch=1, slots=1024, on_cpu=True)
    large = fit.needs(cfg, plans, batch=8, slots=4096, on_cpu=True)
    # K/V: 36 layers x 8 heads x 128 x (k, v) x 2 bytes per slot, the drafter's 5 layers alike
    per_slot = (36 + 5) * 8 * 128 * 2 * 2
    assert large.cache - small.cache == pytest.approx((8 * 4096 - 1024) * per_slot, rel=1e-3)
    # ar_w12 and stock_w12 each hold their own 12-bit copy of the target's matrices
    assert 2 * 1.5 * 7.5 * GB < small.formats < 2 * 1.5 * 7.7 * GB
    # a plan encoding only the MLP's products holds a 12-bit copy of those: 36 x 3 x 4096 x 12288 weights
    mlp = [p for p in config_schema.build_plans(_compose(["experiment=stock_qwen3_8b_h200", "gpu=cpu",
           "decoding=w12", "+decoding.plans.ar_w12.w12_matrices=[gate_up,down]",
           "+decoding.plans.stock_w12.w12_matrices=[gate_up,down]"]))]
    part = fit.needs(cfg, mlp, batch=1, slots=1024, on_cpu=True)
    assert part.formats == 2 * 1.5 * 36 * 3 * 4096 * 12288  # ar_w12's and stock_w12's target copies
    # stock_w12's drafter: its own weights (as the bf16 plans alone hold them), then a 12-bit copy of its 5
    # layers' MLP (the target's widths)
    bf16_only = fit.needs(cfg, [p for p in mlp if p.weights == "bf16"], batch=1, slots=1024, on_cpu=True)
    assert part.drafter - bf16_only.drafter == 1.5 * 5 * 3 * 4096 * 12288


def test_a_process_that_holds_the_deployment_counts_only_what_a_plan_adds(monkeypatch):
    # a warm worker with the 8B deployment in its memory: a W12 plan adds its 12-bit copies and a cache,
    # not a second copy of the weights (which made the device's 25 GB left look too little on an H100)
    cfg = _compose(["experiment=stock_qwen3_8b_h200", "gpu=cpu", "decoding=w12", "bench.batch_size=16"])
    by_name = {p.name: p for p in config_schema.build_plans(cfg)}
    stock, ar_w12, stock_w12 = by_name["stock"], by_name["ar_w12"], by_name["stock_w12"]
    slots = 1280
    w12 = fit.needs(cfg, [stock, stock_w12], 16, slots, on_cpu=True)
    bf16 = fit.needs(cfg, [stock], 16, slots, on_cpu=True)
    adds = w12.formats + w12.drafter_formats + w12.cache
    assert adds == w12.total - w12.weights - bf16.drafter < 20 * GB  # the copies and the cache only
    _with_memory(monkeypatch, int(adds) + GB)
    with pytest.raises(fit.DoesNotFitError, match=r"^the deployment needs at least"):
        fit.check(cfg, [stock, stock_w12], 16, slots)  # a fresh process builds it all
    assert fit.check(cfg, [stock, stock_w12], 16, slots, held=[stock]).total == w12.total
    _with_memory(monkeypatch, int(w12.cache) + GB)  # its 12-bit copies made already: only a cache
    fit.check(cfg, [stock, stock_w12], 16, slots, held=[stock_w12])
    with pytest.raises(fit.DoesNotFitError):  # AR's copies are laid out for 16 rows, not 16 x 16: others
        fit.check(cfg, [stock, stock_w12], 16, slots, held=[ar_w12])
    with pytest.raises(fit.DoesNotFitError, match=r"^the plan needs 1\d\.\d GB more than this process holds "
                                                  r"but there is \d\.\d GB.*weight formats and layouts 1\d\.\d GB"):
        fit.check(cfg, [stock, stock_w12], 16, slots, held=[stock])


def _with_ragged_attention(plan):
    return dataclasses.replace(plan, name=plan.name + "_ragged", kernels=dataclasses.replace(
        plan.kernels, attention=dispatch.OpChoice(("triton", "xla"))))


def test_plans_that_differ_only_in_their_attention_kernel_share_one_weight_copy():
    # a W12 plan with the ragged attention kernel and one without it hold one 12-bit copy (two held 25 GB
    # of an H100 in the loop's warm worker), in the deployment and in what fit counts
    cfg = _compose(["experiment=stock_qwen3_8b_h200", "gpu=cpu", "decoding=w12"])
    w12 = [p for p in config_schema.build_plans(cfg) if p.name == "stock_w12"]
    one, two = (fit.needs(cfg, ps, 1, 1024, on_cpu=True) for ps in (w12, [*w12, _with_ragged_attention(w12[0])]))
    assert one.formats > 0 and one.formats == two.formats and one.drafter == two.drafter
    tiny = _compose([*TINY, "decoding=w12", "~decoding.plans.stock", "~decoding.plans.stock_w12", "target.dtype=bfloat16"])
    ar_w12 = next(p for p in config_schema.build_plans(tiny) if p.name == "ar_w12")
    ragged = _with_ragged_attention(ar_w12)
    dep = deploy.build(tiny, [ar_w12, ragged])
    assert dep.prepared_keys(ragged) == dep.prepared_keys(ar_w12)
    assert dep.params_for(ragged) is dep.params_for(ar_w12)


def test_the_bench_of_a_real_run_sets_the_slots(monkeypatch):
    seen = {}
    monkeypatch.setattr(fit, "needs", lambda cfg, plans, batch, slots, on_cpu: seen.update(b=batch, s=slots))
    cfg = _compose([*TINY, "bench.batch_size=2", "bench.prompt_len=100", "bench.new_tokens=50"])
    fit.check(cfg, config_schema.build_plans(cfg))
    assert seen == {"b": 2, "s": 256}  # 100 + 50 + 1 rounded up to 128s


def test_a_build_checks_before_it_builds(monkeypatch):
    _with_memory(monkeypatch, 1000)
    monkeypatch.setattr(deploy, "build_target", lambda *a, **k: pytest.fail("built before the checks"))
    cfg = _compose(TINY)
    with pytest.raises(fit.DoesNotFitError):
        deploy.build(cfg, config_schema.build_plans(cfg))


def test_the_real_8b_experiment_fails_within_seconds_on_this_machine(tmp_path):
    cfg = _compose(["experiment=ar_qwen3_8b_h200", "gpu=cpu"])
    need = fit.needs(cfg, config_schema.build_plans(cfg), 1, 896, on_cpu=True).total
    have = fit.available(jax.devices()[0])
    if have is None or have[0] >= need:
        pytest.skip(f"this machine has room for the 8B shape ({have})")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "experiment=ar_qwen3_8b_h200",
                           "gpu=cpu", f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert time.perf_counter() - t0 < 30
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("config error: the deployment needs at least 25.") and "target=qwen3_8b" in line


@pytest.mark.parametrize("overrides,match", [
    (["target=qwen3_8b", "drafter=smollm2"], r"^drafter: drafter=smollm2-dflash does not fit target=qwen3_8b: "
                                             r"drafter \(hidden 576, vocab 49152\) does not fit the target"),
    (["target=tiny_random", "drafter=smollm2"], r"drafter=smollm2-dflash does not fit target=tiny_random"),
    (["target=tiny_random", "drafter=random", "target.tap_layers=[1,9]"],
     r"^target.tap_layers: tap layer 9 outside \[0, 4\) \(the target has 4 layers\)"),
])
def test_a_drafter_that_does_not_fit_its_target_fails_from_shapes(overrides, match, monkeypatch):
    monkeypatch.setattr(deploy, "build_target", lambda *a, **k: pytest.fail("built to find a mismatch"))
    cfg = _compose([*TINY, "decoding=stock", *overrides])
    with pytest.raises(ConfigValueError, match=match):
        config_schema.validate(cfg)


def test_a_drafter_made_at_the_targets_shape_fits():
    cfg = _compose(["experiment=stock_qwen3_8b_h200"])
    target, dcfg = shapes.check_drafter_fits(cfg)
    assert (dcfg.hidden_size, dcfg.vocab_size, dcfg.num_layers) == (4096, 151936, 5)
    assert target.tap_layers == dcfg.target_tap_layers == (1, 9, 17, 25, 33)
