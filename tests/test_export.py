"""Exporting a target (orbax or Hugging Face) to a Hugging Face directory, and generating from either.

A pair folder is laid out as the embedded cache and `experiments/train.py` lay it out (tokenizer.json,
target/model written by `save_model`, drafter/model in the DFlash format); the weights are random, so
the test needs no training. A Hugging Face source keeps its chat template, special tokens and token ids,
checked by transformers reading the export.
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specpilot.data.tokenizer import load_tokenizer, train_tokenizer
from specpilot.decoding.ar import generate
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import load_hf
from specpilot.models.config import ModelConfig
from specpilot.training.checkpointing import TOKENIZER_FILES, export_hf, save_model

ROOT = Path(__file__).resolve().parents[1]
EXPORT, GENERATE = ROOT / "experiments" / "export.py", ROOT / "experiments" / "generate.py"
TEXT = "def add(x, y):\n    return x + y\n"


def _run(script, *args):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(cache dir holding one embedded-* pair, the pair folder, target params, target cfg)."""
    cache = tmp_path_factory.mktemp("cache")
    folder = cache / "embedded-0123456789ab"
    tok = train_tokenizer([TEXT * 50], vocab_size=300)
    tok.save(folder / "tokenizer.json")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, eos_token_id=tok.eos_id)
    params = dense.init(jax.random.key(0), cfg, dtype=jnp.float32, std=0.5)
    save_model(folder / "target" / "model", params, cfg)
    tok.save(folder / "target" / "model" / "tokenizer.json")
    dcfg = dr.DrafterConfig.for_target(cfg, num_layers=1, block_size=4)
    dr.save_drafter(folder / "drafter" / "model", dr.init(jax.random.key(1), dcfg, jnp.float32), dcfg)
    return cache, folder, params, cfg


def test_export_round_trips_the_target(pair, tmp_path):
    _, folder, params, cfg = pair
    proc = _run(EXPORT, folder, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    written = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= written
    loaded, loaded_cfg = load_hf(tmp_path / "hf", dtype=None)
    assert loaded_cfg == cfg
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)
    want, _, _ = dense.chain_forward(params, cfg, tokens, dense.init_state(cfg, 1, 8, jnp.float32))
    got, _, _ = dense.chain_forward(loaded, loaded_cfg, tokens, dense.init_state(cfg, 1, 8, jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    tok = load_tokenizer(tmp_path / "hf")
    assert tok.encode(TEXT) == load_tokenizer(folder).encode(TEXT)


def test_export_in_bfloat16(pair, tmp_path):
    _, folder, params, _ = pair
    proc = _run(EXPORT, folder / "target" / "model", tmp_path / "hf", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded, _ = load_hf(tmp_path / "hf", dtype=None)
    assert loaded["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(loaded["embed"]),
                                  np.asarray(params["embed"].astype(jnp.bfloat16)))


def test_an_export_replaces_an_earlier_one_whole_and_refuses_a_folder_of_other_files(pair, tmp_path):
    _, folder, params, _ = pair
    out = tmp_path / "hf"
    export_hf(folder / "target" / "model", out, max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    export_hf(folder / "target" / "model", out)  # one file now: no shard of the sharded export stays behind
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    np.testing.assert_array_equal(np.asarray(load_hf(out, dtype=None)[0]["embed"]), np.asarray(params["embed"]))
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary folder left beside it
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files an export does not write .*notes.txt"):
        export_hf(folder / "target" / "model", out)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("where", ["cache", "pair", "exported"])
def test_generate_reads_the_cached_pair_or_its_export(pair, tmp_path, where):
    cache, folder, params, cfg = pair
    if where == "exported":
        assert _run(EXPORT, cache, tmp_path / "hf").returncode == 0
    checkpoint = {"cache": cache, "pair": folder, "exported": tmp_path / "hf"}[where]
    proc = _run(GENERATE, "--checkpoint", checkpoint, "--prompt", TEXT, "--max-new-tokens", 6,
                "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tok = load_tokenizer(folder)
    want = generate(dense.target(cfg, params["embed"].dtype), params, [tok.encode(TEXT)], 6).as_lists(
        cfg.eos_token_id)[0]
    assert proc.stdout.rstrip("\n") == tok.decode(want)


def test_ambiguous_or_empty_sources_fail_clearly(pair, tmp_path):
    cache, folder, _, _ = pair
    proc = _run(EXPORT, tmp_path, tmp_path / "out")
    assert proc.returncode != 0 and "no target" in proc.stderr
    two = tmp_path / "two"
    for name in ("embedded-aaaaaaaaaaaa", "embedded-bbbbbbbbbbbb"):
        (two / name / "target" / "model").mkdir(parents=True)
        for f in (folder / "target" / "model").iterdir():
            (two / name / "target" / "model" / f.name).symlink_to(f)
    proc = _run(GENERATE, "--checkpoint", two, "--prompt-ids", "1,2")
    assert proc.returncode != 0 and "embedded-aaaaaaaaaaaa" in proc.stderr
    assert "embedded-bbbbbbbbbbbb" in proc.stderr


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "t1 t2"}, {"role": "user", "content": "t3 t4 t5"}]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """A tiny transformers checkpoint with a word-level tokenizer, a chat template, special tokens and
    bos/eos/pad ids in config.json (eos as a list) and generation_config.json."""
    transformers = pytest.importorskip("transformers")
    import hf_tiny  # the tests folder is on the path (as test_dense_vs_hf imports it)
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("chat") / "qwen3"
    model = hf_tiny.build("qwen3_kv1_tied")
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 250, [251, 252], 253
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = [251, 252], 253
    hf_tiny.save(model, path)
    vocab = {f"t{i}": i for i in range(250)} | {"<|im_start|>": 250, "<|im_end|>": 251, "<|endoftext|>": 252,
                                               "<pad>": 253}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                                eos_token="<|im_end|>", pad_token="<pad>",
                                                unk_token="t0", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(path))
    return path


def test_export_of_a_hugging_face_folder_keeps_its_chat_template_and_token_ids(chat_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = export_hf(chat_checkpoint, tmp_path / "hf", dtype=jnp.bfloat16)
    src_tok = transformers.AutoTokenizer.from_pretrained(str(chat_checkpoint))
    out_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    for gen in (False, True):
        want = src_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert out_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen) == want
    assert want.endswith("<|im_start|>assistant\n")
    assert out_tok.apply_chat_template(MESSAGES) == src_tok.apply_chat_template(MESSAGES)
    assert (out_tok.bos_token, out_tok.eos_token, out_tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<pad>")
    assert (out_tok.eos_token_id, out_tok.pad_token_id) == (251, 253)
    config = transformers.AutoConfig.from_pretrained(str(out))
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (250, [251, 252], 253)
    assert config.torch_dtype == "bfloat16" or str(config.torch_dtype) == "torch.bfloat16"
    generation = transformers.GenerationConfig.from_pretrained(str(out))
    assert (generation.eos_token_id, generation.pad_token_id) == ([251, 252], 253)
    # The export loads back here too, in the dtype asked for.
    params, cfg = load_hf(out, dtype=None)
    assert params["embed"].dtype == jnp.bfloat16 and cfg.eos_token_id == 251
    # Every tokenizer file transformers wrote (the template in tokenizer_config.json or chat_template.jinja,
    # by its version) is copied as it was.
    written = [f for f in TOKENIZER_FILES if (chat_checkpoint / f).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(written)
    for name in written:
        assert (out / name).read_bytes() == (chat_checkpoint / name).read_bytes(), name


def test_generate_names_a_drafter_that_does_not_fit_its_target(pair, tmp_path):
    _, folder, _, cfg = pair
    other = tmp_path / "drafter"
    dcfg = dr.DrafterConfig.for_target(dataclasses.replace(cfg, hidden_size=64, head_dim=32), num_layers=1,
                                       block_size=4)
    dr.save_drafter(other, dr.init(jax.random.key(1), dcfg, jnp.float32), dcfg)
    proc = _run(GENERATE, "--checkpoint", folder, "--prompt-ids", "1,2", "--drafter", other)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].endswith("does not fit the target (hidden 32, vocab "
                                                         f"{cfg.vocab_size}) (--drafter none decodes without it)")
