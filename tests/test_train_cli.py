"""The training entry point: every stage on a toy corpus folder, and a drafter for a HF checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from specpilot.data.corpus import load_corpus
from specpilot.data.tokenizer import train_tokenizer
from specpilot.models import dense
from specpilot.models import drafter as dr
from specpilot.models.checkpoint import save_hf
from specpilot.models.config import ModelConfig
from specpilot.training import replies as rp

ROOT = Path(__file__).resolve().parents[1]
TOY_SIZES = [
    "target.steps=3", "target.batch_size=2", "target.seq_len=32", "target.eval_every=3",
    "target.checkpoint_every=3", "target.eval_sequences=2",
    "drafter.steps=2", "drafter.block_size=4", "drafter.num_sequences=4", "drafter.prompt_len=8",
    "drafter.gen_len=8", "drafter.gen_batch=4", "drafter.heldout_sequences=2", "drafter.batch_size=2",
    "drafter.anchors_per_seq=2", "drafter.eval_every=2", "drafter.checkpoint_every=2",
]


def _corpus(root: Path) -> Path:
    root.mkdir()
    for i in range(40):  # enough files for both splits of a path-hash split
        (root / f"mod{i}.py").write_text(
            f'def f{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n' * 20)
    return root


def _train(*overrides, cwd):
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "train.py"), *overrides,
                           "progress=false", f"hydra.run.dir={cwd / 'hydra'}"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # over ~15 s on 2 cores; the default suite keeps its faster siblings
def test_all_stages_on_a_corpus_folder(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    proc = _train("stage=all", f"out_dir={tmp_path / 'out'}", f"corpus.root={corpus}",
                  "tokenizer.vocab_size=300", *TOY_SIZES, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    params, dcfg = dr.load_drafter(tmp_path / "out" / "drafter" / "model")
    assert dcfg.block_size == 4 and (tmp_path / "out" / "target" / "model" / "config.json").exists()


@pytest.mark.slow
def test_drafter_for_a_hugging_face_checkpoint(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    tok = train_tokenizer(load_corpus(corpus).texts("train"), vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, tie_word_embeddings=True)
    save_hf(dense.init(jax.random.key(0), cfg, dtype=jnp.float32), cfg, tmp_path / "hf")
    tok.save(tmp_path / "hf")
    proc = _train("stage=drafter", f"target_path={tmp_path / 'hf'}", f"out_dir={tmp_path / 'out'}",
                  f"corpus.root={corpus}", *TOY_SIZES, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, dcfg = dr.load_drafter(tmp_path / "out" / "drafter" / "model")
    assert dcfg.num_target_layers == 3 and dcfg.vocab_size == tok.vocab_size


def test_missing_target_is_a_clear_error(tmp_path):
    proc = _train("stage=drafter", f"out_dir={tmp_path / 'out'}", cwd=tmp_path)
    assert proc.returncode != 0 and "no target at" in proc.stderr


def _entry_point():
    """experiments/train.py as a module, and a composition of its configs."""
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    from hydra import compose, initialize_config_dir

    def composed(name, *overrides):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            return compose(config_name=name, overrides=["out_dir=/tmp/unused", *overrides])
    return train, composed


def test_the_v2_config_composes_and_bad_replies_settings_are_refused():
    train, composed = _entry_point()
    cfg = composed("train_smollm2_v2")
    assert (cfg.stage, cfg.data, cfg.drafter.block_size, cfg.target_path) == ("drafter", "replies", 16, "smollm2")
    conf = train.replies_config(cfg)
    assert conf.num_replies >= 100_000 and conf.temperatures[0] == 0.0 and cfg.drafter.gen_len == conf.max_new_tokens
    with pytest.raises(SystemExit, match=r"replies.policy must be one of \('static', 'continuous'\), got 'eager'"):
        train.replies_config(composed("train", "replies.policy=eager"))


def test_replies_from_held_out_files_or_another_target_are_refused(tmp_path):
    train, composed = _entry_point()
    corpus = load_corpus(_corpus(tmp_path / "corpus"), heldout_fraction=0.2)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    params = dense.init(jax.random.key(0), cfg, jnp.float32)
    files = corpus.train_files[:8]
    rp.generate_replies(rp.RepliesConfig(num_replies=8, shard_size=8, max_new_tokens=2, slots=8, prefill_chunk=4),
                        params, cfg, [[1, 2, 3 + i] for i in range(8)], tmp_path / "replies", stop_token=None,
                        sources=[{"kind": "explain", "where": f"{f}:1"} for f in files], progress=False)
    conf = composed("train", f"replies_dir={tmp_path / 'replies'}", "replies.num_replies=8")
    got = train.replies_data(conf, corpus, tmp_path, params)
    assert len(got["train_sequences"]) == 8 and got["data_id"].endswith(":1")
    with pytest.raises(SystemExit, match="generated by another target"):
        train.replies_data(conf, corpus, tmp_path, jax.tree.map(lambda x: x + 1, params))
    other = load_corpus(corpus.root, heldout_fraction=0.2, salt="another")
    assert set(files) & set(other.heldout_files)  # the same files, split another way
    with pytest.raises(SystemExit, match="held out in this corpus split"):
        train.replies_data(conf, other, tmp_path, params)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow  # four runs of the entry point
def test_replies_in_runs_then_a_drafter_from_them(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    tok = train_tokenizer(load_corpus(corpus).texts("train"), vocab_size=300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=3,
                      num_heads=2, num_kv_heads=1, head_dim=16, qk_norm=True, tie_word_embeddings=True)
    save_hf(dense.init(jax.random.key(0), cfg, dtype=jnp.float32), cfg, tmp_path / "hf")
    tok.save(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    common = [f"target_path={tmp_path / 'hf'}", f"out_dir={tmp_path / 'out'}", f"corpus.root={corpus}",
              "chat.max_prompt_tokens=200", "chat.num_heldout=2", "replies.num_replies=8", "replies.shard_size=4",
              "replies.max_new_tokens=6", "replies.slots=4", "replies.prefill_chunk=64",
              "replies.temperatures=[0.0,0.8]", *TOY_SIZES]
    first = _train("stage=replies", "replies.max_minutes=1e-9", *common, cwd=tmp_path)
    assert first.returncode == 0 and "1 of 2 shards" in first.stdout and "run the same command again" in first.stdout
    rest = _train("stage=replies", *common, cwd=tmp_path)
    assert rest.returncode == 0 and "2 of 2 shards" in rest.stdout and "complete" in rest.stdout, rest.stderr[-3000:]
    seqs, info = rp.load_replies(tmp_path / "out" / "replies")
    assert len(seqs) == 8 and {s["where"].split(":")[0] for s in info["sources"]} <= set(load_corpus(corpus).train_files)
    proc = _train("stage=drafter", "data=replies", *common, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 sequences from 2 shards" in proc.stdout and dr.load_drafter(tmp_path / "out" / "drafter" / "model")
    # Another split of the corpus would hold some replies' files out: refused before training.
    proc = _train("stage=drafter", "data=replies", *common, "corpus.heldout_fraction=0.5", cwd=tmp_path)
    assert proc.returncode != 0 and "held out in this corpus split" in proc.stderr
