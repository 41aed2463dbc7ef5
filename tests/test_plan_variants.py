"""A found plan that names a kernel variant carries its source inline, and `experiments/run.py` loads it,
checks it against the op's reference at the deployment's shapes, runs it and forces it like any plan; a
wrong variant stops the run naming it, before anything is timed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specpilot.agent import report
from specpilot.harness import kernel_variants as va
from specpilot.harness import plan_variants
from specpilot.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
GOOD = """import jax.numpy as jnp
from specpilot.formats.w12 import W12, decode_jnp


def matmul(x, w):
    if isinstance(w, W12):
        w = decode_jnp(w)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
"""
LATE_ELEMENT = """import jax.numpy as jnp


def matmul(x, w):
    y = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    return y.at[..., -1, -1].multiply(1 + 2.0 ** -10)
"""


def _plan_file(tmp_path, source, key):
    v = va.Variant("matmul", source)
    fields = {"verify": "ar", "kernels": {"matmul": {"implementation": [v.name, "xla"]}}}
    return v, report.write_plan(tmp_path / key, "found", fields, key, [v])


def _run(tmp_path, plan_file, out):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "target=tiny_random", "drafter=none",
                           "bench=default", "bench.num_prompts=2", "bench.new_tokens=6", f"decoding={plan_file.stem}",
                           f"hydra.searchpath=[file://{plan_file.parent.parent}]", f"output_dir={out}",
                           f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'h' / out.name}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_a_found_plan_runs_its_inline_variant_checked_and_forced(tmp_path):
    v, plan_file = _plan_file(tmp_path, GOOD, "good")
    body = yaml.safe_load(plan_file.read_text())
    assert body["variants"] == [{"op": "matmul", "source": GOOD}]  # the source, byte for byte
    assert "source: |" in plan_file.read_text()  # a literal block: readable in the file
    proc = _run(tmp_path, plan_file, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"kernel variant {v.name} (matmul) matched its reference" in proc.stdout + proc.stderr
    records = {r["method"]: r for r in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    found = records["found"]
    assert v.name in found["matmul"] and found["mismatches"] == 0 and found["forcing"]["positions"] == 12


def test_a_wrong_variant_stops_the_run_naming_it(tmp_path):
    v, plan_file = _plan_file(tmp_path, LATE_ELEMENT, "late")
    proc = _run(tmp_path, plan_file, tmp_path / "out")
    assert proc.returncode != 0
    assert f"kernel variant {v.name} (matmul) in plan 'found'" in proc.stderr and "wrong at" in proc.stderr, \
        proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # nothing half-done left behind


# numpy re-exports os: the static check lets this through, the sandbox keeps the write from the host
WRITES_AT_IMPORT = """import numpy.testing._private.utils as u
import jax.numpy as jnp

u.os.makedirs(MARKER, exist_ok=True)


def matmul(x, w):
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32) + 1.0
"""


def test_a_plan_files_variant_runs_first_in_the_sandbox_never_in_the_run(tmp_path):
    """The run's own process refuses a wrong variant before importing it: the module-level code ran only
    in the sandboxed check, whose writes never reach the host."""
    marker = tmp_path / "written-by-the-variant"
    va.static_check("matmul", WRITES_AT_IMPORT.replace("MARKER", repr(str(marker))))
    v, plan_file = _plan_file(tmp_path, WRITES_AT_IMPORT.replace("MARKER", repr(str(marker))), "writes")
    proc = _run(tmp_path, plan_file, tmp_path / "out")
    assert proc.returncode != 0 and f"kernel variant {v.name} (matmul) in plan 'found'" in proc.stderr, \
        proc.stderr[-2000:]
    assert not marker.exists()  # refused (its write denied, or its answers wrong) and never run here


def test_a_carried_variant_no_plan_names_is_refused(tmp_path):
    from omegaconf import OmegaConf


    v = va.Variant("matmul", GOOD)
    cfg = OmegaConf.create({"cache_dir": str(tmp_path), "decoding": {"variants": [{"op": "matmul", "source": GOOD}]}})
    loaded = plan_variants.load(cfg)
    assert list(loaded) == [v.name]
    with pytest.raises(plan_variants.VariantError, match=f"{v.name} \\(matmul\\) is named by no plan"):
        plan_variants.check(loaded, [Plan(name="ar", verify="ar")], None, 1)
    # before the run: refused with no code of the variant run, by the same static check and plan names
    with pytest.raises(plan_variants.VariantError, match=f"{v.name} \\(matmul\\) is named by no plan"):
        plan_variants.sandbox_checks(cfg, [Plan(name="ar", verify="ar")])
    bad = OmegaConf.create({"cache_dir": str(tmp_path), "decoding": {"variants": [{"op": "matmul",
                                                                                   "source": "import os\n"}]}})
    with pytest.raises(plan_variants.VariantError, match="decoding.variants.0"):
        plan_variants.load(bad)
    with pytest.raises(plan_variants.VariantError, match="decoding.variants.0: line 1: imports 'os'"):
        plan_variants.sandbox_checks(bad, [])
