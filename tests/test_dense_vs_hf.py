"""The dense decoder against transformers, in float32, on tiny random Qwen3 and Llama checkpoints.

Design choices:
- The reference is transformers itself (torch CPU, eager attention, float32), read through our own
  `load_hf`, so a wrong key map, transpose, rope, mask or cache write all show up as logit errors.
- Each prompt is run through transformers on its own, unpadded; ours runs the whole right-padded
  batch with `prompt_lengths`, so padding leaks would show up too. Pad slots hold random tokens.
- Greedy decoding is implemented here with `prefill` + `decode_step` so this file depends only on the
  model. On a mismatch the message reports transformers' top-1/top-2 margin at that step, so a
  near-tie is told apart from a real error.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # test-only reference dependencies (pip install -e ".[test]")
pytest.importorskip("transformers")
import hf_tiny  # noqa: E402  (needs torch and transformers)
from specpilot.models import checkpoint, dense  # noqa: E402

# float32 end to end: ours and transformers differ only in summation order, so logits agree to a
# small multiple of float32's unit roundoff times the logit scale. Measured on these cases: at most
# ~30 eps x max|logit|. 100 eps leaves headroom for other BLAS builds while any real error (a
# transposed weight, a wrong rope frequency, a leaked pad token) is >= 1e-2 relative.
F32_EPS = float(np.finfo(np.float32).eps)
LOGIT_TOL = 100 * F32_EPS  # relative to max |reference logit|
# bf16 weights and activations against the float32 reference: 8-bit mantissas, error grows with
# depth. Measured at most ~6 bf16 eps x max|logit|; a wrong model is off by ~1 (relative).
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)
BF16_LOGIT_TOL = 16 * BF16_EPS

BATCH_LENGTHS = (16, 9, 1)  # ragged prompts, right-padded to PAD_TO
PAD_TO = 16
SEQ_LEN = 40  # teacher-forced sequence length for the cached-decode test
MAX_LEN = 64  # cache positions: room for PAD_TO + NEW_TOKENS
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=list(hf_tiny.CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, params f32, cfg) for each tiny case, saved and reloaded once."""
    model = hf_tiny.build(request.param)
    path = hf_tiny.save(model, tmp_path_factory.mktemp(request.param))
    params, cfg = checkpoint.load_hf(path, dtype=jnp.float32, tap_layers=(0,))
    return request.param, model, params, cfg


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(sum(map(ord, name)))


def _hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens)[None], dtype=torch.long)).logits[0].numpy()


def _assert_close(ours, ref, tol, what):
    ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
    scale = max(1.0, float(np.abs(ref).max()))
    err = float(np.abs(ours - ref).max())
    assert err <= tol * scale, f"{what}: max|diff| {err:.3g} > {tol:.3g} x logit scale {scale:.3g}"


def _padded_batch(rng, lengths, width):
    tokens = rng.integers(0, hf_tiny.VOCAB, (len(lengths), width))  # random pad slots, on purpose
    return tokens, np.asarray(lengths, np.int32)


def test_config_read_from_checkpoint(case):
    name, model, _, cfg = case
    hf = model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.qk_norm == name.startswith("qwen3")
    assert (cfg.rope_scaling is not None) == ("rope" in name)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]


def test_prefill_logits_all_positions(case):
    """The prompt pass (`step` over a right-padded batch) at every valid position, and tap 0."""
    name, model, params, cfg = case
    tokens, lengths = _padded_batch(_rng(name), BATCH_LENGTHS, PAD_TO)
    cache = dense.init_state(cfg, len(lengths), MAX_LEN, jnp.float32)
    logits, taps, _ = dense.step(params, cfg, jnp.asarray(tokens, jnp.int32), cache)
    for b, n in enumerate(lengths):
        prompt = torch.tensor(tokens[b, :n][None])
        with torch.no_grad():
            out = model(prompt, output_hidden_states=True)
        ref = out.logits[0].numpy()
        _assert_close(np.asarray(logits)[b, :n], ref, LOGIT_TOL, f"{name} prompt {b} logits")
        # Tap of layer 0 = HF hidden_states[1]. (HF's last entry, hidden_states[L], is final-normed,
        # so only layers below L-1 compare this way.)
        _assert_close(np.asarray(taps)[b, :n], out.hidden_states[1][0].numpy(), LOGIT_TOL,
                      f"{name} prompt {b} tap 0")


def greedy(params, cfg, tokens, lengths, new_tokens: int) -> np.ndarray:
    """Greedy continuation [B, new_tokens] with prefill + decode_step (float32 cache)."""
    cache = dense.init_state(cfg, len(lengths), MAX_LEN, jnp.float32)
    logits, _, cache = dense.prefill(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths),
                                     cache)
    out = [jnp.argmax(logits, axis=-1).astype(jnp.int32)]
    for _ in range(new_tokens - 1):
        logits, _, cache = dense.decode_step(params, cfg, out[-1], cache)
        out.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return np.stack([np.asarray(t) for t in out], axis=1)


def hf_generate(model, tokens, lengths, new_tokens: int) -> np.ndarray:
    """transformers' greedy continuation [B, new_tokens] of a batch, left-padded as HF expects."""
    width = int(max(lengths))
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, width - n:] = torch.tensor(tokens[b, :n])
        mask[b, width - n:] = 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens)
    return out[:, width:].numpy()


def _check_cached_decode(name, model, params, cfg):
    """Prefill ragged prefixes, then feed the true next tokens one at a time with `decode_step`."""
    rng = _rng(name + "decode")
    seqs = rng.integers(0, hf_tiny.VOCAB, (len(BATCH_LENGTHS), SEQ_LEN))
    refs = [_hf_logits(model, s) for s in seqs]  # [SEQ_LEN, V] each
    tokens = seqs[:, :PAD_TO].copy()
    for b, n in enumerate(BATCH_LENGTHS):
        tokens[b, n:] = rng.integers(0, hf_tiny.VOCAB, PAD_TO - n)  # garbage past each prompt
    lengths = np.asarray(BATCH_LENGTHS, np.int32)
    cache = dense.init_state(cfg, len(lengths), MAX_LEN, jnp.float32)
    logits, _, cache = dense.prefill(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths),
                                     cache)
    n_steps = SEQ_LEN - max(BATCH_LENGTHS)
    for j in range(n_steps + 1):
        pos = lengths + j - 1  # position whose logits we hold (j = 0: prefill's last position)
        for b in range(len(lengths)):
            _assert_close(np.asarray(logits)[b], refs[b][pos[b]], LOGIT_TOL,
                          f"{name} row {b} position {pos[b]}")
        if j < n_steps:
            step_tokens = seqs[np.arange(len(lengths)), lengths + j]
            logits, _, cache = dense.decode_step(params, cfg, jnp.asarray(step_tokens, jnp.int32),
                                                 cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + n_steps)


def _check_greedy(name, model, params, cfg):
    """>= 32 greedy tokens from prefill + decode_step equal `generate(do_sample=False)`."""
    tokens, lengths = _padded_batch(_rng(name + "greedy"), BATCH_LENGTHS, PAD_TO)
    ours = greedy(params, cfg, tokens, lengths, NEW_TOKENS)
    refs = hf_generate(model, tokens, lengths, NEW_TOKENS)
    for b, n in enumerate(lengths):
        if not np.array_equal(ours[b], refs[b]):
            j = int(np.argmax(ours[b] != refs[b]))
            top2 = np.sort(_hf_logits(model, np.concatenate([tokens[b, :n], refs[b, :j]]))[-1])[-2:]
            pytest.fail(f"{name} prompt {b}: first greedy mismatch at new token {j} "
                        f"(ours {ours[b][j]}, transformers {refs[b][j]}); transformers' top-1/top-2 "
                        f"margin there is {top2[1] - top2[0]:.3g} (a near-tie if below "
                        f"{LOGIT_TOL * np.abs(top2).max():.3g})")


def test_decode_matches_transformers(case):
    # One test for both checks: they share the compiled prefill/decode_step, which costs seconds
    # per case on CPU and would otherwise be compiled again on each pytest-xdist worker.
    _check_cached_decode(*case)
    _check_greedy(*case)


def test_save_hf_output_loads_in_transformers(case, tmp_path):
    """Our writer's config.json and tensors mean the same model to transformers."""
    name, model, params, cfg = case
    checkpoint.save_hf(params, cfg, tmp_path)
    cls = type(model)
    reloaded = cls.from_pretrained(str(tmp_path), attn_implementation="eager", dtype=torch.float32)
    tokens = _rng(name + "save").integers(0, hf_tiny.VOCAB, 24)
    np.testing.assert_array_equal(_hf_logits(reloaded.eval(), tokens), _hf_logits(model, tokens))


def test_bf16_checkpoint_loads_bit_exact(tmp_path):
    """A bf16 HF checkpoint loads with the default dtype as the very same bf16 bits."""
    model = hf_tiny.build("llama3_rope_bias", dtype=torch.bfloat16)
    params, cfg = checkpoint.load_hf(hf_tiny.save(model, tmp_path))
    for key, (where, _, transpose) in checkpoint.hf_key_map(cfg).items():
        leaf = params
        for step in where:
            leaf = leaf[step]
        assert leaf.dtype == jnp.bfloat16, key
        ref = model.state_dict()[key].view(torch.int16).numpy()
        np.testing.assert_array_equal(np.asarray(leaf).view(np.int16), ref.T if transpose else ref,
                                      err_msg=key)


def test_default_dtype_is_bf16_and_close_to_f32(tmp_path):
    """f32 checkpoint + default dtype: bf16 params (rounded like torch) and logits near the f32 ones."""
    name = "qwen3_kv1_tied"
    model = hf_tiny.build(name)
    params, cfg = checkpoint.load_hf(hf_tiny.save(model, tmp_path))
    leaves = [params["embed"], params["final_norm"], *params["layers"][0].values()]
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    ref_embed = model.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16)
    np.testing.assert_array_equal(np.asarray(params["embed"]).view(np.int16),
                                  ref_embed.view(torch.int16).numpy())
    tokens = _rng(name + "bf16").integers(0, hf_tiny.VOCAB, (1, PAD_TO))
    logits, _, _ = dense.step(params, cfg, jnp.asarray(tokens, jnp.int32),
                              dense.init_state(cfg, 1, MAX_LEN, jnp.bfloat16))
    _assert_close(np.asarray(logits)[0], _hf_logits(model, tokens[0]), BF16_LOGIT_TOL, f"{name} bf16")
