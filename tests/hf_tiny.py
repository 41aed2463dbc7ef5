"""Tiny random Hugging Face models (Qwen3, Llama) as an independent reference for the dense decoder.

Design choices:
- Every case is 2 layers, hidden 64, so building, saving and running one takes well under a second.
- Each case exercises one shape or feature our code must get right: head_dim != hidden/heads, a single
  KV head, tied embeddings, Llama-3 rope scaling with a small original context (so the scaled
  frequencies differ from the plain ones at the positions tested), attention and MLP biases.
- HF's init leaves norms at one and biases at zero, which would hide a swapped or dropped norm or bias.
  `build` redraws every parameter: matrices ~ N(0, INIT_STD), norm weights ~ 1 + N(0, 0.1), biases
  ~ N(0, INIT_STD). INIT_STD = 0.2 makes logits O(1) rather than O(0.01), so greedy decoding is not
  decided by near-ties.
- The eager attention path is forced: it is the plain reference, independent of SDPA kernel choices.
"""

from __future__ import annotations

import torch
import transformers

INIT_STD = 0.2
VOCAB = 256
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, initializer_range=INIT_STD, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# name -> (architecture, overrides of _BASE)
CASES = {
    "qwen3_head_dim32": ("Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3_kv1_tied": ("Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=16,
                                                tie_word_embeddings=True)),
    "llama3_rope_bias": ("LlamaForCausalLM", dict(head_dim=16, attention_bias=True, mlp_bias=True,
                                                  tie_word_embeddings=False,
                                                  rope_parameters=dict(_LLAMA3_ROPE))),
    "llama_kv1_tied": ("LlamaForCausalLM", dict(num_key_value_heads=1, head_dim=24,
                                                tie_word_embeddings=True,
                                                rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 500000.0})),
}


def make_config(case: str) -> transformers.PretrainedConfig:
    arch, overrides = CASES[case]
    cls = {"Qwen3ForCausalLM": transformers.Qwen3Config, "LlamaForCausalLM": transformers.LlamaConfig}[arch]
    cfg = cls(**{**_BASE, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def build(case: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random model for `case` in eval mode, every parameter drawn from a seeded generator."""
    cfg = make_config(case)
    torch.manual_seed(seed)
    model_cls = {"Qwen3ForCausalLM": transformers.Qwen3ForCausalLM,
                 "LlamaForCausalLM": transformers.LlamaForCausalLM}[CASES[case][0]]
    model = model_cls(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters lists a tied tensor once, so a tied lm_head stays equal to the embedding.
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(INIT_STD * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


def save(model: torch.nn.Module, path) -> str:
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)
