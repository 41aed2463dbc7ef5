"""The hybrid target at Qwen3.5-27B's real shape, traced only (no weights, no compute): parameter
count, state sizes, the verification and prefill forwards, and their lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np

from specpilot import state as st
from specpilot.models import hybrid
from specpilot.models.hybrid_config import HybridConfig

# Qwen3.5-27B's public config.json (multimodal layout; vision fields dropped).
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "text_config": {
        "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "max_position_embeddings": 262144, "eos_token_id": 248044, "tie_word_embeddings": False,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25}},
    "vision_config": {"hidden_size": 1152},
}


def _is_shape(x):
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def _abstract_params(cfg, dtype=jnp.bfloat16):
    return jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, dtype), hybrid.param_shapes(cfg),
                                  is_leaf=_is_shape)


def test_real_shape_config_parameters_and_state():
    cfg = HybridConfig.from_hf_dict(QWEN3_5_27B)
    assert cfg.layer_types.count("full_attention") == 16 and cfg.is_linear(0) and not cfg.is_linear(3)
    assert cfg.rotary_dim == 64 and cfg.conv_dim == 10240
    assert 26.5e9 < hybrid.num_params(cfg) < 27.5e9  # the text model of a 27B model
    target = hybrid.target(cfg, jnp.bfloat16)
    state = jax.eval_shape(lambda: target.init_state(1, 4096))
    rec = state.layers[0]
    assert rec.matrix.shape == (1, 48, 128, 128) and rec.matrix.dtype == jnp.float32
    assert rec.matrix.size * 4 == 3 * 2**20  # 3 MiB of float32 state per linear layer and sequence
    assert rec.conv.shape == (1, 3, 10240) and rec.conv.dtype == jnp.bfloat16
    assert rec.matrix_snapshots.shape == (1, 16, 48, 128, 128)
    logits, taps, out = jax.eval_shape(lambda p, s, x: st.chain_forward(target, p, x, s),
                                       _abstract_params(cfg), state,
                                       jax.ShapeDtypeStruct((1, 16), jnp.int32))
    assert logits.shape == (1, 16, 248320) and jax.tree_util.tree_structure(out) == \
        jax.tree_util.tree_structure(state)


def test_verification_and_prefill_lower_for_cuda():
    """Real widths, 4 layers: the recurrent form (T = 16) and the chunked form with its triangular
    solve (T = 128) lower for the GPU from this CPU machine."""
    hf = dict(QWEN3_5_27B, text_config=dict(QWEN3_5_27B["text_config"], num_hidden_layers=4,
                                            vocab_size=1024))
    cfg = HybridConfig.from_hf_dict(hf)
    target = hybrid.target(cfg, jnp.bfloat16)
    state = jax.eval_shape(lambda: target.init_state(1, 256))
    fn = jax.jit(lambda p, s, x: st.chain_forward(target, p, x, s))
    for t in (16, 128):
        lowered = fn.trace(_abstract_params(cfg), state, jax.ShapeDtypeStruct((1, t), jnp.int32))
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
        assert ("triangular_solve" in text) == (t > target.max_block_size)
        assert np.prod(lowered.out_info[0].shape) == t * 1024
