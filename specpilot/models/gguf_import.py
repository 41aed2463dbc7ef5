"""Import a llama or qwen3 GGUF file (llama.cpp's format) as the Hugging Face directory `load_hf` reads:
every header check before anything is dequantized or written, llama.cpp's q/k row permutation undone,
the tokenizer rebuilt from metadata, and the result cached by the file's content and written atomically.
Design notes: docs/design/models.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from specpilot import atomic_io
from specpilot.models.checkpoint import TOP_KEYS, hf_key_map
from specpilot.models.config import ConfigError, ModelConfig
from specpilot.models.hf_files import ATTENTION_MLP_KEYS, CONFIG_FILE, SINGLE_FILE, hf_shape, listing
from specpilot.models.gguf_tokenizer import (TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, TokenizerMetadataError,
                                             build_tokenizer, tokenizer_config)

IMPORTER_VERSION = 1
SOURCE_FILE = "gguf_source.json"
GGUF_MAGIC = b"GGUF"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types dequantized (by gguf.quants.dequantize); anything else is refused by name.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name -> our param name (per layer: the stem of the name under blk.{i}., for .weight and,
# on the projections, .bias); the Hugging Face name is then ours (`checkpoint.TOP_KEYS`, `ATTENTION_MLP_KEYS`).
_TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER_STEMS = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q_norm": "q_norm",
                "attn_k_norm": "k_norm", "attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_KNOWN_UNSUPPORTED = {
    "rope_freqs.weight": "per-frequency RoPE scaling factors (llama.cpp's form of Llama 3.1 rope "
                        "scaling) are not supported",
}


class GGUFImportError(ValueError):
    """A GGUF file that cannot be imported, or an output folder that cannot take the import."""


@dataclasses.dataclass
class _Plan:
    """What the header says: config, metadata, and HF name -> GGUF tensor (checked)."""

    cfg: ModelConfig
    meta: dict[str, Any]
    tensors: dict[str, Any]  # HF name -> gguf ReaderTensor
    permuted: bool  # llama: q/k rows permuted by llama.cpp's converter
    tokenizer: Any  # tokenizers.Tokenizer
    tokenizer_config: dict[str, Any]


def _gguf():
    try:
        import gguf
    except ImportError as e:  # a declared dependency; say so instead of a bare ImportError
        raise ImportError("GGUF import needs the `gguf` package (pip install gguf==0.19.0)") from e
    return gguf


# --------------------------------------------------------------------------------------------------
# Reading the header


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist" if not path.exists()
                              else f"GGUF path {path} is not a file")


def _open(path: Path):
    _require_file(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # numpy's memmap/reshape errors on a short file say nothing useful alone
        raise GGUFImportError(f"{path} is truncated or corrupt: the GGUF reader failed with "
                              f"{type(e).__name__}: {e}") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFImportError(f"{path} is truncated: tensor {t.name} ends at byte "
                                  f"{t.data_offset + t.n_bytes}, the file has {size}")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise GGUFImportError(f"{path} is a big-endian GGUF file; only little-endian files are supported")
    return reader


def _metadata(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            out[key] = field.contents()
    return out


def _get(meta: dict[str, Any], key: str, path: Path, default: Any = ..., kind=int):
    if key not in meta:
        if default is ...:
            raise GGUFImportError(f"{path}: missing metadata key {key!r}")
        return default
    value = meta[key]
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFImportError(f"{path}: metadata {key} differs across layers ({value[:8]}...); "
                                  f"per-layer values are not supported")
        value = value[0]
    try:
        return kind(value)
    except (TypeError, ValueError) as e:
        raise GGUFImportError(f"{path}: metadata {key}={value!r} is not a {kind.__name__}") from e


def read_config(meta: dict[str, Any], tensor_names, path: Path) -> ModelConfig:
    """The ModelConfig the metadata describes (llama.cpp's meaning of each key)."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFImportError(f"{path}: missing metadata key 'general.architecture'")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"{path}: unsupported architecture {arch!r}; supported: "
                              f"{', '.join(ARCHITECTURES)}")
    key = lambda name, **kw: _get(meta, f"{arch}.{name}", path, **kw)  # noqa: E731
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", default=hidden // heads if heads else 0)
    if key("attention.value_length", default=head_dim) != head_dim:
        raise GGUFImportError(f"{path}: attention.value_length differs from key_length ({head_dim}); "
                              f"unsupported")
    rotary = key("rope.dimension_count", default=head_dim)
    if rotary != head_dim:
        raise GGUFImportError(f"{path}: partial rotary embedding (rope.dimension_count {rotary} < "
                              f"head_dim {head_dim}) is not supported")
    scaling = key("rope.scaling.type", default="none", kind=str)
    if scaling != "none":
        raise GGUFImportError(f"{path}: RoPE scaling {scaling!r} ({arch}.rope.scaling.type) is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFImportError(f"{path}: missing metadata key 'tokenizer.ggml.tokens'")
    names = set(tensor_names)
    has = lambda suffix: any(n.startswith("blk.") and n.endswith(suffix) for n in names)  # noqa: E731
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            vocab_size=key("vocab_size", default=len(tokens)),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_layers=key("block_count"),
            num_heads=heads,
            num_kv_heads=key("attention.head_count_kv", default=heads),
            head_dim=head_dim,
            rope_theta=key("rope.freq_base", default=10000.0, kind=float),
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", kind=float),
            tie_word_embeddings="output.weight" not in names,
            qk_norm=arch == "qwen3",
            attention_bias=has(".attn_q.bias"),
            mlp_bias=has(".ffn_up.bias"),
            max_position_embeddings=key("context_length"),
            architecture=ARCHITECTURES[arch],
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
        )
    except ConfigError as e:
        raise GGUFImportError(f"{path}: the metadata describes no valid model: {e}") from e


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for an unknown one."""
    if gguf_name in _TOP_NAMES:
        return TOP_KEYS[_TOP_NAMES[gguf_name]]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in _LAYER_STEMS:
        return None
    ours = _LAYER_STEMS[parts[2]] + {"weight": "", "bias": "_bias"}.get(parts[3], ".")
    hf = ATTENTION_MLP_KEYS.get(ours)
    return None if hf is None else f"model.layers.{int(parts[1])}.{hf}"


def known_names(layer: int) -> list[str]:
    """Every GGUF tensor name the import reads: the top-level ones and those of block `layer`."""
    layer_names = [f"blk.{layer}.{stem}.{kind}" for stem in _LAYER_STEMS for kind in ("weight", "bias")]
    return [*_TOP_NAMES, *(name for name in layer_names if hf_name(name) is not None)]


def _plan(path: Path) -> _Plan:
    reader = _open(path)
    meta = _metadata(reader)
    cfg = read_config(meta, [t.name for t in reader.tensors], path)
    expected = hf_key_map(cfg)
    problems, tensors = [], {}
    for t in reader.tensors:
        if t.name in _KNOWN_UNSUPPORTED:
            raise GGUFImportError(f"{path}: tensor {t.name}: {_KNOWN_UNSUPPORTED[t.name]}")
        name = hf_name(t.name)
        if name is None or name not in expected:
            problems.append(f"unexpected tensor {t.name}")
            continue
        if t.tensor_type.name not in TENSOR_TYPES:
            raise GGUFImportError(f"{path}: tensor {t.name} has unsupported tensor type "
                                  f"{t.tensor_type.name}; supported: {', '.join(TENSOR_TYPES)}")
        _, shape, transpose = expected[name]
        want = hf_shape(tuple(shape), transpose)
        got = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        if got != want:
            problems.append(f"tensor {t.name} has shape {got}, the metadata implies {want}")
        tensors[name] = t
    missing = set(expected) - set(tensors)
    if missing:
        problems.append(f"missing tensor(s) for {listing(missing)}")
    if problems:
        raise GGUFImportError(f"{path} does not match its metadata ({cfg.architecture}, {cfg.num_layers} "
                              f"layers): " + "; ".join(problems))
    tok_meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    try:
        tokenizer, tok_config = build_tokenizer(tok_meta), tokenizer_config(tok_meta)
    except TokenizerMetadataError as e:
        raise GGUFImportError(f"{path}: {e}") from e
    return _Plan(cfg, meta, tensors, cfg.architecture == "LlamaForCausalLM", tokenizer, tok_config)


# --------------------------------------------------------------------------------------------------
# Tensors


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each of `num_heads` heads, llama.cpp stores row
    pairs (j, j + d/2) interleaved as rows (2j, 2j + 1); this puts them back into two halves."""
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise GGUFImportError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(plan: _Plan, name: str, path: Path) -> np.ndarray:
    gguf = _gguf()
    t = plan.tensors[name]
    arr = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    arr = arr.reshape(tuple(int(n) for n in reversed(t.shape)))
    if plan.permuted and (".q_proj." in name or ".k_proj." in name):
        heads = plan.cfg.num_heads if ".q_proj." in name else plan.cfg.num_kv_heads
        arr = unpermute_rope_rows(arr, heads)
    bad = int(np.size(arr) - np.isfinite(arr).sum())
    if bad:
        raise GGUFImportError(f"{path}: tensor {t.name} dequantizes to {bad} non-finite values")
    return np.ascontiguousarray(arr)


# --------------------------------------------------------------------------------------------------
# Cached, atomic import


def file_key(path: str | Path) -> dict[str, Any]:
    """What identifies a source file: size and SHA-256 of its bytes, and this importer's version."""
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest(), "importer_version": IMPORTER_VERSION}


def _recorded_key(out: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((out / SOURCE_FILE).read_text())
        return {k: record[k] for k in ("size", "sha256", "importer_version")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def is_converted(out: str | Path, key: dict[str, Any]) -> bool:
    """Whether `out` holds a finished import of the file with this `file_key`."""
    out = Path(out)
    needed = (CONFIG_FILE, SINGLE_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
    return _recorded_key(out) == key and all((out / name).is_file() for name in needed)


def _write(plan: _Plan, path: Path, key: dict[str, Any], tmp: Path) -> None:
    tensors = {name: _dequantized(plan, name, path) for name in plan.tensors}
    save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
    hf = plan.cfg.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = "float32"
    pad = plan.meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        hf["pad_token_id"] = int(pad)
    (tmp / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    plan.tokenizer.save(str(tmp / TOKENIZER_FILE))
    (tmp / TOKENIZER_CONFIG_FILE).write_text(json.dumps(plan.tokenizer_config, indent=2,
                                                        ensure_ascii=False) + "\n")
    types: dict[str, int] = {}
    for t in plan.tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    record = {**key, "source": path.name, "architecture": plan.meta["general.architecture"],
              "tensor_types": dict(sorted(types.items())), "rope_rows_unpermuted": plan.permuted}
    (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    atomic_io.readable_by_all(tmp)


def import_gguf(gguf_path: str | Path, out_dir: str | Path, key: dict[str, Any] | None = None) -> Path:
    """Convert a llama / qwen3 GGUF file into the Hugging Face directory `out_dir` and return it.

    A finished import of the same file (same size and SHA-256) there is returned without redoing
    it; an import of another file there is replaced. Raises GGUFImportError on a bad file, leaving
    `out_dir` as it was. `key`: the file's `file_key` if the caller has it (hashing a file is not free).
    """
    path, out = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise GGUFImportError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and _recorded_key(out) is None:
        raise GGUFImportError(f"output folder {out} is not empty and holds no GGUF import "
                              f"({SOURCE_FILE} missing); refusing to replace it")
    if key is None:
        key = file_key(path) if path.is_file() else None
    if key is not None and is_converted(out, key):
        atomic_io.readable_by_all(out)  # an import made before its files were given read access to all
        return out
    plan = _plan(path)  # every header check, before anything is dequantized or written
    assert key is not None  # _plan refuses a path that is not a file
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the import is an ordinary folder
        _write(plan, path, key, tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}-{tmp.name[-8:]}"
            out.rename(old)
        try:
            tmp.rename(out)
        except OSError as e:
            # Another import renamed its folder in first: keep it if it is this file's.
            if old is not None and not out.exists():
                old.rename(out)
            if is_converted(out, key):
                return out
            raise GGUFImportError(f"could not move the import into {out}: {e}") from e
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def import_cached(gguf_path: str | Path, cache_dir: str | Path) -> Path:
    """`import_gguf` into `cache_dir/gguf/<file stem>-<first 12 hex of its SHA-256>`: one folder per
    distinct file, so two files of one name never share an import."""
    path = Path(gguf_path).expanduser()
    _require_file(path)
    key = file_key(path)
    return import_gguf(path, Path(cache_dir).expanduser() / "gguf" / f"{path.stem}-{key['sha256'][:12]}", key)
