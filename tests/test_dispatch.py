"""`pallas_kernels.dispatch`: choices built from plain values with clear errors, implementations tried in order
with fall-through, "xla" exact for every weight layout, `prepare_params` putting a model's weights into the
chosen layouts, the qkv barrier by role, the behaviour without a choice (as before choices existed, the
compatibility names model code still reads), and no import cycle between formats and kernels."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import w12_matmul as km
from pallas_kernels import w12_mosaic as mk
from specpilot import formats
from specpilot.formats import w12
from w12_helpers import adversarial_weights, assert_same_bits
from specpilot.models import dense
from specpilot.models.config import ModelConfig
from specpilot.models.layers import rope_tables
from specpilot.state import AttentionState


def _bf16_dot(x, w):
    return jnp.einsum("...k,kn->...n", x, w, preferred_element_type=jnp.float32)


def test_choice_builds_configs_from_plain_values():
    c = dispatch.choice("matmul", ["mosaic", "xla"], {"mp_choices": [16, 64], "small_m_stages": 3})
    assert c == dispatch.OpChoice(("mosaic", "xla"), mk.W12MosaicConfig(mp_choices=(16, 64), small_m_stages=3))
    hash(c)  # a static argument: hashable
    assert dispatch.choice("matmul", "xla") == dispatch.OpChoice(("xla",), None)
    t = dispatch.choice("matmul", "triton", {"blocks": {"block_n": 64, "split_k": 2}, "decode": "jnp"})
    assert t.config == km.W12TritonConfig(blocks=km.W12Blocks(block_n=64, split_k=2), decode="jnp")
    assert set(dispatch.IMPLEMENTATIONS["matmul"]) == {"mosaic", "triton", "cpu_rows", "xla"}
    with pytest.raises(ValueError, match="unknown matmul implementation.*'cuda'.*known: mosaic, triton, cpu_rows, xla"):
        dispatch.choice("matmul", ("mosaic", "cuda"))
    with pytest.raises(ValueError, match="unknown key.*'block_k'.*matmul 'mosaic' config; known: mp_choices"):
        dispatch.choice("matmul", "mosaic", {"block_k": 64})
    with pytest.raises(ValueError, match="unknown key.*'bn'.*triton.blocks"):
        dispatch.choice("matmul", "triton", {"blocks": {"bn": 64}})
    with pytest.raises(ValueError, match="unknown op 'conv'"):
        dispatch.choice("conv", "xla")
    with pytest.raises(ValueError, match="at least one implementation"):
        dispatch.choice("matmul", ())
    x, w = jnp.ones((1, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="takes a W12MosaicConfig config, got XlaConfig"):
        dispatch.matmul(x, w, choice=dispatch.OpChoice(("mosaic",), dispatch.XlaConfig()))
    with pytest.raises(TypeError, match="must be an OpChoice"):
        dispatch.matmul(x, w, choice=("xla",))


def test_xla_is_exact_for_every_layout():
    """"xla" decodes each layout to its bf16 matrix exactly, so its product is the bf16 weight's own dot,
    bit for bit; a product no listed implementation takes names each refusal."""
    k, n = 256, 128
    w = jnp.asarray(adversarial_weights(k, n, seed=1))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, k)), jnp.bfloat16)
    want = _bf16_dot(x, w)
    enc = jax.device_put(w12.encode(w))
    xla = dispatch.choice("matmul", "xla")
    for layout in (w, enc, mk.to_nk(enc, 64), mk.prepare_twin(w)):
        assert_same_bits(dispatch.matmul(x, layout, choice=xla, out_dtype=jnp.float32), want)
    with pytest.raises(NotImplementedError, match=r"no matmul implementation of \('mosaic',\).*mosaic: "):
        dispatch.matmul(x, w, choice=dispatch.choice("matmul", "mosaic"))
    # falling through: the Mosaic kernel refuses a plain bf16 array, XLA takes it
    got = dispatch.matmul(x, w, choice=dispatch.choice("matmul", ("mosaic", "xla")), out_dtype=jnp.float32)
    assert_same_bits(got, want)


def test_without_a_choice_each_weight_goes_where_it_did():
    """choice=None: a bf16 array and a W12 through XLA's dot (bias in float32, the activation dtype out),
    the Mosaic layouts through that kernel; the Triton kernel when a choice names it."""
    k, n = 128, 64
    w = jnp.asarray(adversarial_weights(k, n, seed=2))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, k)), jnp.bfloat16)
    b = jnp.asarray(np.random.default_rng(1).standard_normal(n), jnp.bfloat16)
    want = (_bf16_dot(x, w) + b.astype(jnp.float32)).astype(jnp.bfloat16)
    assert_same_bits(dispatch.matmul(x, w, b), want)
    enc = jax.device_put(w12.encode(w))
    as_xla = dispatch.prepare_weight(enc, dispatch.choice("matmul", "xla"))
    assert dispatch.default_choice(as_xla).implementation == ("xla",)
    assert_same_bits(dispatch.matmul(x, as_xla, b), want)
    triton = dispatch.choice("matmul", ("triton", "xla"), {"interpret": True})
    as_triton = dispatch.prepare_weight(enc, triton)
    assert_same_bits(dispatch.matmul(x, as_triton, choice=triton, out_dtype=jnp.float32),
                     km.w12_matmul(x, enc, km.W12TritonConfig(interpret=True)))
    assert dispatch.default_choice(mk.to_nk(enc, 64)).implementation == ("mosaic",)


def _model_params(k=128, n=128):
    rng = np.random.default_rng(0)

    def mat(*shape):
        return jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.bfloat16)

    dense_bits = np.random.default_rng(1).integers(0, 1 << 16, (k, n), dtype=np.uint16)
    layer = {"qkv": mat(k, 3 * n), "o": mat(n, k), "gate_up": mat(k, 2 * n),
             "down": jnp.asarray(dense_bits.view(jnp.bfloat16)),  # mostly exceptions: stays bf16 in W12
             "attn_norm": jnp.ones((k,), jnp.bfloat16)}
    return {"embed": mat(256, k), "layers": (layer,), "lm_head": mat(k, 256), "fc": mat(2 * k, k)}


def test_prepare_params_puts_each_weight_in_its_layout():
    """For "mosaic": W12 matrices -> W12NK, bf16 ones -> TwinNK (the runs' steps for the rows), norms and
    embeddings untouched, `extra` matrices included; for "xla" and "triton" W12 stays W12 (tagged) and bf16
    stays bf16. A matrix the first implementation refuses takes the next one's layout, and with no next one
    the refusal is raised."""
    params = _model_params()
    enc = formats.encode_params(params, "w12", extra=("fc",))
    assert not isinstance(enc["layers"][0]["down"], w12.W12)  # kept bf16 by the encoder
    mosaic = dispatch.choice("matmul", ("mosaic", "xla"))
    prep = dispatch.prepare_params(enc, mosaic, rows=1, extra=("fc",))
    layer = prep["layers"][0]
    assert all(isinstance(layer[n], mk.W12NK) for n in ("qkv", "o", "gate_up"))
    assert isinstance(layer["down"], mk.TwinNK) and isinstance(prep["lm_head"], mk.W12NK)
    assert isinstance(prep["fc"], mk.W12NK) and prep["embed"] is params["embed"]
    assert layer["attn_norm"] is params["layers"][0]["attn_norm"]
    twin = dispatch.prepare_params(params, mosaic)
    assert all(isinstance(twin["layers"][0][n], mk.TwinNK) for n in ("qkv", "o", "gate_up", "down"))
    assert "fc" in twin and twin["fc"] is params["fc"]  # not named in extra
    kept = dispatch.prepare_params(enc, mosaic, layout_bf16=False)  # the encoder's bf16 matrices to XLA
    assert isinstance(kept["layers"][0]["qkv"], mk.W12NK) and kept["layers"][0]["down"] is enc["layers"][0]["down"]
    xla = dispatch.prepare_params(enc, dispatch.choice("matmul", "xla"))
    assert xla["layers"][0]["qkv"] is enc["layers"][0]["qkv"] and xla["layers"][0]["down"] is enc["layers"][0]["down"]
    # a W12 matrix whose step overflows the slot table: no W12NK; the next implementation's layout
    overflow = w12.encode_device(params["layers"][0]["down"])
    assert isinstance(dispatch.prepare_weight(overflow, mosaic), w12.W12)  # XLA's layout: W12 as it is
    with pytest.raises(NotImplementedError, match="more than 255 exceptions"):
        dispatch.prepare_weight(overflow, dispatch.choice("matmul", "mosaic"))
    with pytest.raises(NotImplementedError, match="N % 64 == 0"):
        dispatch.prepare_weight(params["layers"][0]["qkv"][:, :96], dispatch.choice("matmul", "mosaic"))


def _barriers(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("optimization_barrier")


def test_qkv_product_of_the_mosaic_kernel_is_materialized_by_role():
    """role="qkv" through the Mosaic kernel puts one optimization barrier after the product when the
    config's `qkv_barrier` is on (the runs' default), none with it off, for other roles, or through XLA."""
    k, n = 128, 64
    w = jnp.asarray(adversarial_weights(k, n, seed=3))
    x = jnp.ones((1, k), jnp.bfloat16)
    nk = mk.to_nk(w12.encode_device(w), 64)
    on = dispatch.choice("matmul", "mosaic", {"interpret": True})
    off = dispatch.choice("matmul", "mosaic", {"interpret": True, "qkv_barrier": False})
    assert _barriers(lambda x: dispatch.matmul(x, nk, choice=on, role="qkv"), x) == 1
    assert _barriers(lambda x: dispatch.matmul(x, nk, choice=off, role="qkv"), x) == 0
    assert _barriers(lambda x: dispatch.matmul(x, nk, choice=on, role="o"), x) == 0
    assert _barriers(lambda x: dispatch.matmul(x, nk, choice=dispatch.choice("matmul", "xla"), role="qkv"), x) == 0


def test_dense_layer_passes_its_plan_choice_and_roles():
    """dense's layer multiplies through `cfg.matmul` and names each product: the Mosaic kernel's qkv product
    is materialized once (its config's qkv_barrier), a bf16 layer through XLA has no barrier."""
    import dataclasses as dc

    cfg = ModelConfig(vocab_size=64, hidden_size=256, intermediate_size=256, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=128, qk_norm=True)
    bf16 = dense.fuse_projections(dense.init(jax.random.PRNGKey(0), cfg))
    mosaic = dispatch.choice("matmul", ("mosaic", "xla"), {"interpret": True})
    menc = dispatch.prepare_params(formats.encode_params(bf16, "w12", max_exception_rate=1.0), mosaic,
                                   layout_bf16=False)
    assert isinstance(menc["layers"][0]["qkv"], mk.W12NK)
    h = jnp.zeros((1, 1, cfg.hidden_size), jnp.bfloat16)
    cos, sin = rope_tables(jnp.zeros((1, 1), jnp.int32), cfg.inv_freq())
    kv = jnp.zeros((1, cfg.num_kv_heads, 8, cfg.head_dim), jnp.bfloat16)
    mask = jnp.ones((1, 1, 8), bool)

    def layer(p, c):
        return dense.decoder_layer(p, c, h, cos, sin, AttentionState(kv, kv), jnp.zeros((1,), jnp.int32), mask)

    assert _barriers(lambda p: layer(p, dc.replace(cfg, matmul=mosaic)), menc["layers"][0]) == 1
    assert _barriers(lambda p: layer(p, cfg), bf16["layers"][0]) == 0


MODULES = ["specpilot.formats", "specpilot.formats.w12", "pallas_kernels.common", "pallas_kernels.w12_matmul",
           "pallas_kernels.w12_mosaic.layout", "pallas_kernels.w12_mosaic.ptx", "pallas_kernels.w12_mosaic.kernel",
           "pallas_kernels.w12_mosaic.api", "pallas_kernels.w12_mosaic", "pallas_kernels.gated_delta_rule",
           "pallas_kernels.dispatch",
           "specpilot.models.layers"]


def test_no_import_cycle_and_formats_a_leaf():
    """Each module imports on its own in a fresh process (a cycle fails there, whatever was imported
    first), and importing the formats loads no kernel module."""
    code = ("import importlib, sys\n"
            f"for name in {MODULES!r}:\n"
            "    for m in [m for m in sys.modules if m.startswith(('pallas_kernels', 'specpilot'))]:\n"
            "        del sys.modules[m]\n"
            "    importlib.import_module(name)\n"
            "    if name.startswith('specpilot.formats'):\n"
            "        loaded = [m for m in sys.modules if m.startswith('pallas_kernels')]\n"
            "        assert not loaded, (name, loaded)\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
