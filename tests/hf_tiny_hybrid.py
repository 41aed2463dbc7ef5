"""Tiny random Qwen3.5 (hybrid) models built with transformers: the reference for the hybrid target.

Design choices:
- Hidden 64, 3-4 layers: building and running one on the CPU takes about a second. Without
  flash-linear-attention installed, transformers runs its own torch fallbacks
  (`torch_chunk_gated_delta_rule` for prompts, `torch_recurrent_gated_delta_rule` for cached decode
  steps), an implementation we did not write.
- Each case exercises a shape our code must get right: value heads != key heads (grouped value
  heads), equal heads, key dim != value dim, several linear/full patterns (first layer full, two
  linear in a row, linear last), partial rotary 0.25 / 0.5 / 1.0, tied embeddings, attention bias.
- Every parameter is redrawn from a seeded generator: matrices ~ N(0, INIT_STD); the (1 + w) norms
  at w ~ N(0, 0.1) and the gated norm at 1 + N(0, 0.1), so a dropped or misplaced norm shows;
  A_log ~ N(-2, 0.5) and dt_bias ~ N(0, 0.5), a decay of ~0.85 per token, so state is carried over
  tens of tokens and across chunk boundaries (transformers' init, A up to 16, forgets in one token).
- The eager attention path is forced, as for the dense reference.
"""

from __future__ import annotations

import torch
import transformers

INIT_STD = 0.2
VOCAB = 256
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=INIT_STD,
             bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
L, F = "linear_attention", "full_attention"


def _rope(partial: float, theta: float = 10000.0) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial}


CASES = {
    # the Qwen3.5 pattern (3 linear, then full); grouped value heads; partial rotary 0.25
    "grouped_v_heads": dict(layer_types=[L, L, L, F], rope_parameters=_rope(0.25)),
    # equal key/value heads, key dim == value dim, full first, two linear layers in a row, tied head
    "equal_heads_tied": dict(layer_types=[F, L, L], linear_num_value_heads=2, linear_value_head_dim=8,
                             tie_word_embeddings=True, rope_parameters=_rope(0.5, 1e6)),
    # linear last, alternating, full rotary, 1 KV head, attention biases, conv kernel 3
    "alternating_bias": dict(layer_types=[L, F, L], num_key_value_heads=1, attention_bias=True,
                             linear_conv_kernel_dim=3, linear_num_value_heads=6,
                             rope_parameters=_rope(1.0)),
}


def make_config(case: str) -> transformers.Qwen3_5TextConfig:
    overrides = CASES[case]
    cfg = transformers.Qwen3_5TextConfig(**{**_BASE, "num_hidden_layers": len(overrides["layer_types"]),
                                            **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is listed once, stays tied
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "norm" in name:
                p.copy_(0.1 * noise)  # (1 + w) norms
            elif name.endswith("A_log"):
                p.copy_(-2.0 + 0.5 * noise)
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(INIT_STD * noise)


def build(case: str, seed: int = 0) -> torch.nn.Module:
    """A random Qwen3_5ForCausalLM for `case`, float32, eval mode."""
    cfg = make_config(case)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(cfg).to(torch.float32)
    _redraw(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def build_multimodal(case: str, seed: int = 0) -> torch.nn.Module:
    """The same text model inside a Qwen3_5ForConditionalGeneration with a tiny vision tower."""
    text = make_config(case)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  out_hidden_size=64, num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                                     tie_word_embeddings=text.tie_word_embeddings)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).to(torch.float32)
    _redraw(model, seed)
    return model.eval()


def save(model: torch.nn.Module, path) -> str:
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)
