"""The run entry point end to end on a tiny configuration (subprocess, as a user runs it)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from specpilot.harness.methods import MethodRun, median_run

ROOT = Path(__file__).resolve().parents[1]


TINY = ("target=tiny_random", "drafter=none", "decoding=ar", "bench=default")


def _run(*overrides, cwd, base=TINY):
    flags = [o for o in overrides if o.startswith("-")]  # Hydra's flags (-m) precede its overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *flags, *base, *rest],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def test_run_writes_records_and_table(tmp_path):
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "bench.num_prompts=2", "bench.new_tokens=8",
                f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ms/token" in proc.stdout
    assert "ar: run 1/1 in" in proc.stdout + proc.stderr  # progress, as each repetition ends
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["ar"]
    rec = records[0]
    assert rec["speedup_vs_ar"] == 1.0 and rec["decode_ms_per_token"] > 0
    assert "random weights" in rec["notes"]
    assert rec["config"]["bench"]["new_tokens"] == 8
    assert (out / "results.csv").read_text().startswith("target,drafter,gpu")


def test_stock_run_is_checked_by_token_forcing(tmp_path):
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=stock", "drafter=oracle", "drafter.num_layers=1",
                "drafter.block_size=4", "drafter.tau=2.5", "bench.num_prompts=2", "bench.new_tokens=12",
                f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    stock = records["stock"]
    assert stock["forcing"]["positions"] == 24 and stock["mismatches"] == 0
    assert stock["forcing"]["outputs_differ"] == 0
    assert 1.0 <= stock["tau"] <= 4.0 and "oracle acceptance" in stock["notes"]
    split = stock["stats"]["time_split"]
    assert set(split) == {"draft", "verify", "bookkeeping"} and abs(sum(split.values()) - 1) < 1e-9
    assert len(stock["stats"]["acceptance_per_position"]) == 3
    assert "token forcing: 24 positions, 0 mismatches" in proc.stdout
    # the recorded per-position acceptance replays as an oracle trace
    out2 = tmp_path / "out2"
    again = _run(f"output_dir={out2}", "decoding=stock", "drafter=oracle", "drafter.num_layers=1",
                 "drafter.block_size=4", f"drafter.acceptance_trace={out}", "bench.num_prompts=2",
                 "bench.new_tokens=12", f"hydra.run.dir={tmp_path / 'hydra2'}", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    replay = {r["method"]: r for r in map(json.loads, (out2 / "results.jsonl").read_text().splitlines())}
    expected = 1 + sum(stock["stats"]["acceptance_per_position"])
    assert f"trace {out} with expected tau {expected:.2f}" in replay["stock"]["notes"]
    assert replay["stock"]["profile_tau"] == pytest.approx(expected)


def test_an_oracle_plan_at_a_smaller_block_replays_the_profiles_first_drafts(tmp_path):
    """Block sizes are searchable under an oracle: a plan's smaller block verifies the profile's first
    block - 1 drafts, and its record's profile tau is that prefix's."""
    from specpilot.models.oracle import conditional_profile, expected_tau

    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=stock", "drafter=oracle", "drafter.num_layers=1",
                "drafter.block_size=6", "drafter.tau=3.5", "decoding.plans.stock.block_size=3",
                "bench.num_prompts=2", "bench.new_tokens=12", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}["stock"]
    assert stock["block_size"] == 3 and stock["mismatches"] == 0 and 1.0 <= stock["tau"] <= 3.0
    want = expected_tau(conditional_profile(6, tau=3.5)[:2])
    assert stock["profile_tau"] == pytest.approx(want) and want < 3.5


def test_bad_override_fails_with_clear_message(tmp_path):
    proc = _run("drafter.block_size=0", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert "drafter.block_size" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["config error: drafter.block_size: must be >= 1, got 0"]
    assert not (tmp_path / "hydra").exists()  # a failed run leaves no output folder behind
    # HYDRA_FULL_ERROR=1 keeps the traceback
    import os

    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    full = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *TINY, "drafter.block_size=0",
                           f"hydra.run.dir={tmp_path / 'hydra2'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=env)
    assert full.returncode != 0 and "Traceback" in full.stderr and "drafter.block_size" in full.stderr


def test_misspelled_appended_key_fails(tmp_path):
    """A key added with `+` bypasses the group schema; the typed config still refuses it, in one line."""
    proc = _run("+drafter.blok_size=8", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "config error: drafter has no key 'blok_size'; did you mean 'block_size'?"]


def test_a_new_plan_from_the_command_line_runs(tmp_path):
    """`+decoding.plans.NAME={...}` adds a plan (Hydra alone cannot add an entry to the typed mapping),
    and a later override sets a field of it."""
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=stock", "drafter=oracle", "drafter.num_layers=1",
                "drafter.block_size=4", "drafter.tau=2.5", "bench.num_prompts=1", "bench.new_tokens=8",
                "+decoding.plans.short={verify: ar, block_size: 4}", "decoding.plans.short.verify=chain",
                f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    short = records["short"]
    assert short["verify"] == "chain" and short["block_size"] == 4 and short["mismatches"] == 0
    assert "stock" in records


def test_a_misspelled_field_of_a_new_plan_fails_in_one_line(tmp_path):
    proc = _run("+decoding.plans.mine={verify: chain, blok_size: 4}", f"hydra.run.dir={tmp_path / 'hydra'}",
                cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "config error: decoding.plans.mine has no key 'blok_size'; did you mean 'block_size'?"]
    assert not (tmp_path / "hydra").exists()


def test_a_gpu_config_for_another_device_fails_in_one_line(tmp_path):
    """gpu=h100 on this CPU is refused before anything is built, naming what jax sees and both fixes."""
    proc = _run("gpu=h100", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line == ("config error: gpu=h100 but jax sees a CPU (cpu, 1 device); use gpu=cpu, or "
                    "gpu.allow_mismatch=true to run the h100 config on this device anyway")
    assert not (tmp_path / "hydra").exists()


def test_report_turns_a_multirun_into_table_and_plots(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _run("-m", "bench.batch_size=1,2", "bench.num_prompts=2", "bench.new_tokens=6",
                f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = subprocess.run([sys.executable, str(ROOT / "experiments" / "report.py"), str(sweep)],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr[-3000:]
    rows = [line for line in rep.stdout.splitlines() if line.startswith("| tiny_random")]
    assert len(rows) == 2 and {r.split("|")[4].strip() for r in rows} == {"1", "2"}
    assert (sweep / "report.md").exists()
    assert (sweep / "tpot_per_method.png").stat().st_size > 1000


def test_report_on_missing_folder_fails_clearly(tmp_path):
    rep = subprocess.run([sys.executable, str(ROOT / "experiments" / "report.py"), str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode != 0 and "no such results folder" in rep.stderr


def test_multirun_with_joblib_launcher(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _run("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=1,2",
                "bench.num_prompts=1", "bench.new_tokens=4", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seeds = sorted(json.loads(p.read_text().splitlines()[0])["config"]["seed"]
                   for p in sweep.rglob("results.jsonl"))
    assert seeds == [1, 2]


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_embedded_toy_pipeline_trains_caches_and_compares(tmp_path):
    cache, out1, out2 = tmp_path / "cache", tmp_path / "o1", tmp_path / "o2"
    first = _run("experiment=embedded_toy", f"cache_dir={cache}", f"output_dir={out1}",
                 f"hydra.run.dir={tmp_path / 'h1'}", cwd=tmp_path, base=())
    assert first.returncode == 0, first.stderr[-3000:]
    (pair,) = cache.glob("embedded-*")
    for stage in ("tokenizer.json", "target/model/specpilot.json", "drafter/model/model.safetensors"):
        assert (pair / stage).exists(), stage
    assert not [p.name for p in pair.iterdir() if "tmp" in p.name]  # no temporary file or folder left behind
    stamp = (pair / "target" / "model" / "specpilot.json").stat().st_mtime
    second = _run("experiment=embedded_toy", f"cache_dir={cache}", f"output_dir={out2}",
                  f"hydra.run.dir={tmp_path / 'h2'}", cwd=tmp_path, base=())
    assert second.returncode == 0, second.stderr[-3000:]
    assert "training the target" not in second.stdout  # the cached pair is reused, not retrained
    assert (pair / "target" / "model" / "specpilot.json").stat().st_mtime == stamp
    records = {r["method"]: r for r in map(json.loads, (out2 / "results.jsonl").read_text().splitlines())}
    assert records["stock"]["mismatches"] == 0 and records["stock"]["forcing"]["positions"] == 24
    assert records["stock"]["prompts"] == "heldout" and "embedded pair" in records["stock"]["notes"]


# The GPU experiments at a tiny shape of their own architecture: same groups, methods and notes.
SHRINK = ("target.model.vocab_size=512", "target.model.hidden_size=64", "target.model.intermediate_size=128",
          "target.model.num_hidden_layers=4", "target.model.num_attention_heads=4",
          "target.model.num_key_value_heads=2", "target.model.head_dim=16", "drafter.num_layers=1",
          "drafter.num_taps=2", "drafter.block_size=4", "drafter.tau=2.5", "bench.prompt_len=8", "bench.new_tokens=12",
          "bench.num_prompts=2", "bench.repeats=1",  # 2 prompts: the h200 runs' Mosaic AR twin is interpreted here
          "gpu.allow_mismatch=true")  # the h200 config's plans on this CPU
GPU_EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml") if p.stem != "embedded_toy")


# the default run keeps the 8B stock experiment (the path most GPU runs take); the others run under -m slow
@pytest.mark.parametrize("experiment", [
    e if e == "stock_qwen3_8b_h200" else pytest.param(e, marks=pytest.mark.slow) for e in GPU_EXPERIMENTS])
def test_every_experiment_smoke_runs_at_a_tiny_shape(experiment, tmp_path):
    out = tmp_path / "out"
    # tree experiments draft depth-7 trees: a drafter block of 8
    shrink = [("drafter.block_size=8" if o.startswith("drafter.block_size=") and "tree" in experiment else o)
              for o in SHRINK]
    proc = _run(f"experiment={experiment}", *shrink, f"output_dir={out}",
                f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path, base=())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert "ar" in records and records["ar"]["ceiling_ms_per_token"] > 0
    assert "random weights" in records["ar"]["notes"] and "wide_margin" in records["ar"]["notes"]
    if "stock" in records:
        stock = records["stock"]
        assert "oracle acceptance" in stock["notes"]
        # wide-margin weights: the oracle's replayed reference stays valid, and forcing is clean
        assert stock["mismatches"] == 0 and stock["forcing"]["outputs_differ"] == 0
        assert stock["tau"] > 1.0 and stock["ceiling_ms_per_token"] > 0


@pytest.mark.slow
def test_w12_through_the_mosaic_kernel_is_checked_by_forcing(tmp_path):
    """gpu.matmul.w12=[mosaic]: the 12-bit plans run their linear layers through the Mosaic GPU kernel
    (here its interpreter) and match AR position by position."""
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=w12", "target.dtype=bfloat16", "drafter=oracle",
                "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=2.5", "bench.num_prompts=1",
                "bench.new_tokens=6", "gpu.matmul.w12=[mosaic]", f"hydra.run.dir={tmp_path / 'hydra'}",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(records) == {"ar", "stock", "ar_w12", "stock_w12"}
    for name in ("stock", "ar_w12", "stock_w12"):
        assert records[name]["mismatches"] == 0 and records[name]["forcing"]["outputs_differ"] == 0, name


@pytest.mark.slow
def test_ar_twin_is_checked_by_forcing(tmp_path):
    """decoding=ar_w12_twin: AR through the Mosaic kernel's bf16 twin (here its interpreter), the best bf16
    baseline beside W12's, matches AR position by position, as ar_w12 does."""
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=ar_w12_twin", "target.dtype=bfloat16", "bench.num_prompts=1",
                "bench.new_tokens=4", "gpu.matmul.w12=[mosaic]", f"hydra.run.dir={tmp_path / 'hydra'}",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(records) == {"ar", "ar_twin", "ar_w12"}
    for name in ("ar_twin", "ar_w12"):
        assert records[name]["mismatches"] == 0 and records[name]["forcing"]["outputs_differ"] == 0, name
    assert records["ar_twin"]["ceiling_ms_per_token"] == records["ar"]["ceiling_ms_per_token"]  # 16 bits


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_w12_methods_are_checked_by_forcing(tmp_path):
    """decoding=w12 through the harness: the 12-bit methods' outputs equal AR's, position by position."""
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=w12", "target.dtype=bfloat16", "drafter=oracle",
                "drafter.num_layers=1", "drafter.block_size=4", "drafter.tau=2.5", "bench.num_prompts=1",
                "bench.new_tokens=12", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(records) == {"ar", "stock", "ar_w12", "stock_w12"}
    for name in ("stock", "ar_w12", "stock_w12"):
        assert records[name]["mismatches"] == 0 and records[name]["forcing"]["outputs_differ"] == 0, name
    assert records["ar_w12"]["ceiling_ms_per_token"] < records["ar"]["ceiling_ms_per_token"]  # 12 bits


def test_median_run_keeps_the_middle_run_and_the_faster_of_two():
    """median_run keeps the run with the median decode time; of an even count, the faster middle one."""

    for times, kept in (([3.0, 1.0, 2.0], 2.0), ([5.0, 4.0], 4.0), ([4.0, 1.0, 3.0, 2.0], 2.0), ([7.0], 7.0)):
        it = iter(times)
        assert median_run(lambda: MethodRun([], 0.0, next(it), 1, {}), len(times)).decode_s == kept, times


def test_hybrid_target_runs_ar_and_stock_with_forcing_clean(tmp_path):
    """target=tiny_hybrid (Gated DeltaNet + full attention): AR and stock through the harness, the chain
    committing per-position recurrent states, every stock token checked by forcing."""
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "drafter=oracle", "drafter.num_layers=1", "drafter.num_taps=2",
                "drafter.block_size=4", "drafter.tau=2.5", "decoding=stock", "bench.num_prompts=2",
                "bench.new_tokens=12", f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path,
                base=("target=tiny_hybrid", "bench=default"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(records) == {"ar", "stock"} and "tiny_hybrid shape" in records["ar"]["notes"]
    stock = records["stock"]
    assert stock["mismatches"] == 0 and stock["forcing"]["positions"] == 24
    assert stock["forcing"]["outputs_differ"] == 0 and stock["tau"] > 1.0


@pytest.mark.slow
def test_sharded_plans_run_on_simulated_devices_and_pass_forcing(tmp_path):
    """README's sharded deployment on a CPU: every sharded plan is checked against the one-device AR."""
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=sharded", "drafter=oracle", "drafter.num_layers=1",
                "drafter.block_size=4", "drafter.tau=2.5", "simulated_cpu_devices=2", "bench.num_prompts=2",
                "bench.new_tokens=12", "decoding.profile_split=false", f"hydra.run.dir={tmp_path / 'hydra'}",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert list(records) == ["ar", "ar_tp2", "stock", "stock_tp2"]
    assert records["ar"]["mesh"] == "1x1" and records["stock_tp2"]["mesh"] == "1x2"
    for name in ("ar_tp2", "stock", "stock_tp2"):
        assert records[name]["mismatches"] == 0 and records[name]["forcing"]["outputs_differ"] == 0
    assert "stock_tp2: sharded over a 1x2 mesh" in proc.stdout


def test_a_mesh_larger_than_the_devices_fails_naming_the_plan(tmp_path):
    proc = _run("decoding=sharded", "drafter=oracle", "drafter.num_layers=1", "drafter.block_size=4",
                "drafter.tau=2.5", "decoding.plans.stock_tp2.mesh.tensor=4", "simulated_cpu_devices=2",
                f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 1
    assert "decoding.plans.stock_tp2.mesh: mesh 1x4 (data x tensor) needs 4 devices; jax sees 2" in proc.stderr


def test_timing_only_run_says_its_plans_were_not_checked(tmp_path):
    out = tmp_path / "out"
    proc = _run(f"output_dir={out}", "decoding=stock", "drafter=oracle", "drafter.num_layers=1",
                "drafter.block_size=4", "drafter.tau=2.5", "bench.num_prompts=1", "bench.new_tokens=8",
                "decoding.forcing=false", "decoding.profile_split=false",
                f"hydra.run.dir={tmp_path / 'hydra'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stock = {r["method"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}["stock"]
    assert stock["mismatches"] is None and "not a lossless result" in stock["forcing"]["summary"]
    assert "token forcing in" not in proc.stdout + proc.stderr
