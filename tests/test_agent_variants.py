"""Kernel variants: the dispatch runs a registered variant, and the reference check (fresh inputs, written
tolerances, exact one-hot rows) accepts correct variants and rejects adversarial ones, each with its reason.

Decided: a variant that calls the op's reference is allowed (it is correct, and it is timed honestly in its
plan, where it is no faster than the reference it calls)."""

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from specpilot.agent import evaluator as ev
from specpilot.harness import kernel_variants as va

SHAPES = {"weights": "bf16", "matmul": [[4, 32, 48], [3, 48, 32]], "gated_delta_rule": [[2, 3, 2, 16, 32]]}

GOOD = """
import jax.numpy as jnp
from specpilot.formats.w12 import W12, decode_jnp

def matmul(x, w):
    if isinstance(w, W12):
        w = decode_jnp(w)
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
"""
CALLS_REFERENCE = """
import jax.numpy as jnp
from pallas_kernels import dispatch

def matmul(x, w):  # the reference implementation through the dispatch itself
    return dispatch.matmul(x, w, choice=dispatch.OpChoice(("xla",)), out_dtype=jnp.float32)
"""
LATE_ELEMENT = """
import jax.numpy as jnp

def matmul(x, w):
    y = jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)
    return y.at[..., -1, -1].multiply(1 + 2.0 ** -10)  # the last element of the last row only
"""
CACHES = """
import numpy as np
import jax.numpy as jnp

_seen = {}

def matmul(x, w):
    key = (x.shape, w.shape)
    if key not in _seen:
        _seen[key] = np.asarray(jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32))
    return jnp.asarray(_seen[key])
"""
SLEEPS = """
import time

def matmul(x, w):
    time.sleep(3600)
"""
RAISES = "def matmul(x, w):\n    raise RuntimeError('broken kernel')\n"
DECLINES = "def matmul(x, w):\n    raise NotImplementedError('only K = 4096')\n"


def _loaded(tmp_path, source, op="matmul"):
    v = va.Variant(op, textwrap.dedent(source))
    e = v.spec_entry(tmp_path / "sandbox")
    return v, va.load(op, e["name"], e["path"])


def test_names_are_digests_and_the_dispatch_runs_a_registered_variant(tmp_path):
    v, fn = _loaded(tmp_path, GOOD)
    assert v.name == va.Variant("matmul", textwrap.dedent(GOOD)).name != va.Variant("matmul", RAISES).name
    assert dispatch.is_variant(v.name) and (tmp_path / "sandbox" / f"{v.digest}.py").read_text() == v.source
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8)), jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(8, 4)), jnp.bfloat16)
    c = dispatch.choice("matmul", [v.name, "xla"])
    want = jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dispatch.matmul(x, w, choice=c), np.float32), np.asarray(want, np.float32))
    assert dispatch.prepare_weight(w, c) is w
    # a plan may name a variant this process never loaded: built fine, refused when run (no silent fall-through)
    other = dispatch.choice("matmul", ["variant:0123456789abcdef", "xla"])
    with pytest.raises(LookupError, match="has not loaded"):
        dispatch.matmul(x, w, choice=other)
    with pytest.raises(ValueError, match="variant:<hash>"):
        dispatch.choice("matmul", ["variant:xyz"])


@pytest.mark.parametrize("source", [GOOD, CALLS_REFERENCE], ids=["einsum", "calls_reference"])
def test_correct_variants_pass(tmp_path, source):
    _, fn = _loaded(tmp_path, source)
    for weights in ("bf16", "w12"):
        out = va.check("matmul", fn, {**SHAPES, "weights": weights}, seed=7)
        assert out["calls"] == 2 * 3  # two shapes, two draws, the last one eager and jitted


@pytest.mark.parametrize("source,why", [
    (LATE_ELEMENT, r"y at shape \[4, 32, 48\] \(eager\) wrong at \[3, 47\] \(1 of 192"),
    (CACHES, r"draw 1: y at shape \[4, 32, 48\] \(eager\) wrong"),
    (RAISES, "raised at shape .*RuntimeError: broken kernel"),
    (DECLINES, "declines the deployment's shape"),
], ids=["late_element", "caches", "raises", "declines"])
def test_wrong_variants_are_rejected_with_why(tmp_path, source, why):
    _, fn = _loaded(tmp_path, source)
    with pytest.raises(va.VariantRejected, match=why):
        va.check("matmul", fn, SHAPES, seed=3)


def test_a_w12_decode_must_be_exact(tmp_path):
    """A product from weights rounded to 7 mantissa bits passes a loose float tolerance at random rows
    but not the exact one-hot rows."""
    _, fn = _loaded(tmp_path, """
        import jax, jax.numpy as jnp
        from specpilot.formats.w12 import decode_jnp

        def matmul(x, w):
            d = decode_jnp(w).astype(jnp.float32)
            d = jax.lax.reduce_precision(d, exponent_bits=8, mantissa_bits=6)  # one bit lost
            return jnp.einsum("...k,kn->...n", x.astype(jnp.float32), d)
        """)
    with pytest.raises(va.VariantRejected, match=r"\(tolerance 0\)$"):
        va.check("matmul", fn, {**SHAPES, "weights": "w12"}, seed=5)


@pytest.mark.parametrize("source,why", [
    ("import os\ndef matmul(x, w):\n    return os.environ", "imports 'os'"),
    ("from specpilot.agent import gate\ndef matmul(x, w):\n    pass", "imports 'specpilot.agent'"),
    ("def matmul(x, w):\n    return open('/etc/passwd')", "uses 'open'"),
    ("def matmul(x, w):\n    return x.__class__", "touches the attribute '__class__'"),
    ("def mm(x, w):\n    return x", r"defines no top-level function matmul\(x, w\)"),
    ("def matmul(x):\n    return x", "must take"),
    ("def matmul(x, w):\n    return x +", "does not parse"),
    ("", "empty source"),
])
def test_static_check(source, why):
    with pytest.raises(va.VariantRejected, match=why):
        va.static_check("matmul", source)


def test_import_errors_and_a_foreign_source_are_rejected(tmp_path):
    v = va.Variant("matmul", "import numpy\nraise ValueError('at import')\ndef matmul(x, w):\n    pass\n")
    e = v.spec_entry(tmp_path)
    with pytest.raises(va.VariantRejected, match="raised on import: ValueError: at import"):
        va.load("matmul", e["name"], e["path"])
    with pytest.raises(va.VariantRejected, match="is not variant"):
        va.load("matmul", "variant:0123456789abcdef", e["path"])


GDR_REFERENCE = """
from pallas_kernels.gated_delta_rule import gated_delta_rule_reference

def gated_delta_rule(q, k, v, g, beta, s0):
    return gated_delta_rule_reference(q, k, v, g, beta, s0)
"""


def test_gated_delta_rule_variants(tmp_path):
    _, fn = _loaded(tmp_path, GDR_REFERENCE, op="gated_delta_rule")
    assert va.check("gated_delta_rule", fn, SHAPES, seed=1)["calls"] == 3
    _, lost_decay = _loaded(tmp_path, GDR_REFERENCE.replace("(q, k, v, g, beta, s0)\n", "(q, k, v, g * 0, beta, s0)\n"),
                            op="gated_delta_rule")
    with pytest.raises(va.VariantRejected, match="o at shape"):
        va.check("gated_delta_rule", lost_decay, SHAPES, seed=1)
    with pytest.raises(va.VariantRejected, match="no gated_delta_rule"):
        va.check("gated_delta_rule", fn, {"matmul": SHAPES["matmul"]}, seed=1)


def _candidate_spec(tmp_path, name, source, stage="full"):
    from agent_helpers import spec, toy_cfg

    cfg = toy_cfg(cache_dir=tmp_path / "cache")
    fields = {"verify": "chain"}
    out = spec(cfg, name, fields, [[5, 6, 7, 8], [9, 10, 11, 12]], repeats=1, new_tokens=4)
    if source is not None:
        v = va.Variant("matmul", textwrap.dedent(source))
        out["fields"] = {**fields, "kernels": {"matmul": {"implementation": [v.name, "xla"]}}}
        out["variants"] = [v.spec_entry(tmp_path / "sandbox" / name)]
        out["variant_check"] = {"shapes": va.check_shapes(cfg.target.model, 1, 8)}
    return {**out, "stage": stage}


def test_a_sleeping_or_wrong_variant_loses_only_itself(tmp_path):
    """In the candidate process (check stage): a sleeping variant loses itself to the deadline, a wrong one
    is rejected with why, before any deployment is built."""
    work = str(tmp_path / "work")
    slept = ev.evaluate_candidate(_candidate_spec(tmp_path, "sleeps", SLEEPS, "check"), timeout_s=6,
                                  memory_mb=None, workdir=work)
    assert slept["status"] == ev.TIMEOUT and "within 6 s" in slept["reason"]
    wrong = ev.evaluate_candidate(_candidate_spec(tmp_path, "late", LATE_ELEMENT, "check"), timeout_s=60,
                                  memory_mb=None, workdir=work)
    assert wrong["status"] == ev.VARIANT_REJECTED and "wrong at" in wrong["reason"], wrong


@pytest.mark.slow
def test_the_candidate_process_times_a_checked_variant_in_its_plan(tmp_path):
    """A correct variant runs in the plan (first in its implementation list) and gives the xla plan's tokens."""
    with ev.Evaluator(2, timeout_s=120, memory_mb=None, workdir=str(tmp_path / "work")) as e:
        stock, good = e.evaluate([_candidate_spec(tmp_path, "xla", None), _candidate_spec(tmp_path, "good", GOOD)])
    assert stock["status"] == good["status"] == ev.OK, (stock["reason"], good["reason"])
    assert good["plan"]["kernels"]["matmul"]["implementation"][0].startswith("variant:")
    assert good["checked"][0]["calls"] == 6 and good["tokens"] == stock["tokens"]
