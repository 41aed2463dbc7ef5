"""Tiny GGUF files written as llama.cpp's `convert_hf_to_gguf.py` writes them, for the GGUF import tests.

Names come from the gguf package's own `TensorNameMap` (not from the importer); Llama's q/k rows are
permuted with llama.cpp's permutation; matrices are quantized with `gguf.quants.quantize` (Q8_0 embedding
and output, Q4_1 matrices, one F16 matrix, F32 norms); the vocabulary is a byte-level BPE trained with
`tokenizers` (digits apart, as SmolLM2's and Qwen's), with control and user-defined tokens and a chat
template. transformers' GGUF loader reads no Llama biases (the biased case is compared against the
transformers model with each weight passed through quantize/dequantize instead), keeps Qwen3's head_dim
at 128 (so the tiny Qwen3 has it), and splits the `smollm` pre-tokenizer as GPT-2 does (the texts where
that differs are compared with llama.cpp's split).
"""

from __future__ import annotations

import functools
import inspect
import json
import textwrap
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

Q = gguf.GGMLQuantizationType
F32_EPS = float(np.finfo(np.float32).eps)
LOGIT_TOL = 100 * F32_EPS  # relative to max |reference logit|; see test_dense_vs_hf.py
INIT_STD = 0.2  # as tests/hf_tiny.py: O(1) logits, so greedy choices are not near-ties
NEW_TOKENS = 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
CHAT_TEMPLATE = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
                 "You are helpful.<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Write a haiku about 2 owls."},
            {"role": "assistant", "content": "Night wings, soft — <think> two eyes </think> glow."},
            {"role": "user", "content": "Now in 日本語 🙂"}]
TEXTS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. It's 2024; they'll say we've won 3-1!",
    "naïve café, Ångström, Δx ≈ 0.5, 你好，世界！ こんにちは 🙂👍🏽 \u200b\ufffd",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>ok</think><|endoftext|>",
    "\t\ttabs\r\nand\n\n\nnewlines   trailing   ",
    "x=[1,22,333,4444] # 3.14159e-10",
]
# A whitespace run before a digit: where llama.cpp's smollm split and GPT-2's differ.
SPACE_DIGIT_TEXTS = ["x =  1", "total:    42\n", "  7 items"]

# name -> how the tiny model and its file are built
CASES = {
    "llama_tied": dict(arch="llama", pre="smollm", heads=4, kv_heads=2, head_dim=16, tied=True,
                       add_bos=True, theta=100000.0),
    "qwen3": dict(arch="qwen3", pre="qwen2", heads=4, kv_heads=2, head_dim=128, tied=False,
                  add_bos=False, theta=1000000.0),
    # one KV head, head_dim != hidden / heads, every bias (q/k biases are permuted too)
    "llama_kv1_bias": dict(arch="llama", pre="llama-bpe", heads=4, kv_heads=1, head_dim=24, tied=False,
                           add_bos=False, theta=500000.0, bias=True),
}


# --------------------------------------------------------------------------------------------------
# Tiny llama.cpp-style files


@functools.lru_cache(maxsize=1)
def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a small byte-level BPE trained on stdlib source and prose."""
    corpus = [inspect.getsource(textwrap), inspect.getsource(json.encoder), *TEXTS, *MESSAGES[0].values(),
              "The quick brown fox. " * 30, "Δ ≈ 你好 日本語 こんにちは naïve café 🙂 " * 5]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS + [USER_DEFINED],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    return tokens, merges, types


def hf_model(case: str, vocab_size: int, seed: int = 0):
    c = CASES[case]
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=c["tied"],
                  rope_theta=c["theta"], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if c["arch"] == "llama":
        bias = c.get("bias", False)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attention_bias=bias,
                                                                       mlp_bias=bias))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    gen = torch.Generator().manual_seed(sum(map(ord, case)) + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # redrawn: HF's ones/zeros would hide a swapped norm
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else INIT_STD * noise)
    return model.eval()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation, written from its definition."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_type(name: str, ndim: int) -> Q:
    if ndim == 1:  # norms and biases stay F32, as llama.cpp keeps them
        return Q.F32
    if name in ("token_embd.weight", "output.weight"):
        return Q.Q8_0
    return Q.F16 if name == "blk.1.ffn_down.weight" else Q.Q4_1


def write_gguf(path: Path, case: str, model=None, *, arch: str | None = None, pre: str | None = None,
               drop_key: str | None = None, drop_tensor: str | None = None, tensor_override=None) -> Path:
    """A GGUF file of `model` (metadata only when None), as llama.cpp's converter writes it."""
    c = CASES[case]
    arch = arch or c["arch"]
    tokens, merges, types = tiny_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    kv = {f"{arch}.block_count": 2, f"{arch}.context_length": 512, f"{arch}.embedding_length": 64,
          f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": c["heads"],
          f"{arch}.attention.head_count_kv": c["kv_heads"], f"{arch}.rope.freq_base": c["theta"],
          f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.attention.key_length": c["head_dim"],
          f"{arch}.attention.value_length": c["head_dim"], f"{arch}.vocab_size": len(tokens)}
    if arch == "llama":
        kv[f"{arch}.rope.dimension_count"] = c["head_dim"]
    for key, value in kv.items():
        if key != drop_key:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or c["pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(c["add_bos"])
    w.add_chat_template(CHAT_TEMPLATE)
    if model is not None:
        names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], 2)
        for hf, tensor in model.state_dict().items():
            if hf == "lm_head.weight" and c["tied"]:
                continue
            base, suffix = hf.rsplit(".", 1)
            name = f"{names.get_name(base)}.{suffix}"
            if name == drop_tensor:
                continue
            arr = tensor.numpy().astype(np.float32)
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
                arr = llama_cpp_permute(arr, c["heads"])
            if arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
                arr = llama_cpp_permute(arr, c["kv_heads"])
            if tensor_override and name in tensor_override:
                w.add_tensor(name, tensor_override[name])
                continue
            qtype = tensor_type(name, arr.ndim)
            if qtype in (Q.F32, Q.F16):
                w.add_tensor(name, gguf.quants.quantize(arr, qtype))
            else:
                w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantized_copy(model, case: str):
    """The transformers model with each weight replaced by what its GGUF tensor dequantizes to (gguf's
    quantize then dequantize, no GGUF file or reader involved). The reference where transformers'
    GGUF loader cannot read the file: it builds Llama without biases, whatever the tensors hold."""
    arch = CASES[case]["arch"]
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], 2)
    with torch.no_grad():
        for hf, p in model.named_parameters():
            base, suffix = hf.rsplit(".", 1)
            qtype = tensor_type(f"{names.get_name(base)}.{suffix}", p.ndim)
            # rows are quantized independently, so this commutes with llama.cpp's row permutation
            p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), qtype), qtype)
                                     .reshape(p.shape)))
    return model
