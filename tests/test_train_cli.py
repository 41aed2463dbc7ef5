"""The training entry point: every stage on a toy corpus folder, and a drafter for a HF checkpoint."""

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
