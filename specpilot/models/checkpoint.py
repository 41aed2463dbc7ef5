"""Hugging Face checkpoint I/O for the dense decoder: safetensors directories <-> params pytrees.
(Hybrid Qwen3.5 loading lives in `hybrid_checkpoint.py`; `load_hf` dispatches to it.)

Design choices:
- No torch: tensors are read with `safetensors` (numpy framework; bf16 arrives as an `ml_dtypes`
  array, which works from safetensors 0.4 on once ml_dtypes is imported) and become jax arrays one
  at a time, so peak host memory is about one tensor.
- Two phases. `_plan` opens every file and checks everything that can be checked from headers —
  config, index, shard presence, key sets, shapes, dtypes — before a single tensor is read, so bad
  input fails fast with one `CheckpointError` naming the problem, and never yields a half-built model.
  Only then does `load_hf` materialize arrays.
- Expected keys and shapes come from `dense.param_shapes(cfg)` (the abstract model), never from the
  file: a checkpoint can only fill the model the config describes, not redefine it.
- HF linear weights are `[out, in]`; ours are `[in, out]`. Every 2-D tensor except the embedding is
  transposed, in both directions. Conversion to the requested dtype happens after transposition, on
  the jax side, so bf16 -> bf16 and f32 -> f32 are bit-exact and f32 -> bf16 rounds like XLA.
- Tied embeddings: `lm_head.weight` is absent from our params. Some tied checkpoints still store it;
  it is accepted only when bit-identical to the embedding, since anything else would silently change
  the model.
- Every tensor must be finite once in the requested dtype: a NaN or Inf weight (stored, or a float32
  value that overflows bfloat16) would load silently and make every logit NaN. The check runs on the
  device array (one reduction per tensor) and the error names the tensor and the count.
- `rotary_emb.inv_freq` buffers (older Llama exports) are derived from the config and are skipped.
- One entry point for every supported architecture: `load_hf` hands Qwen3.5 directories
  (`HYBRID_ARCHITECTURES`) to `hybrid_checkpoint.load_hf`, which keeps these guarantees, and
  `load_target` returns the matching target with the params. Any other architecture gets the
  dense config's "unsupported architecture" error.
- `save_hf` writes the stored dtype of the params and sharded files with an index when
  `max_shard_bytes` is set, using HF's file names, so transformers can read the result too. Stale
  checkpoint files of the other layout are removed first: a leftover index would otherwise win.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers 'bfloat16' with numpy; safetensors' numpy reader needs it
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from specpilot.models import dense
from specpilot.models.config import ConfigError, ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# Our per-layer name -> HF name under `model.layers.{i}.`.
_LAYER_KEYS = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias", "down_bias": "mlp.down_proj.bias",
}
_TOP_KEYS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
             "lm_head": "lm_head.weight"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded into (or written from) the configured model."""


def hf_key_map(cfg: ModelConfig) -> dict[str, tuple[tuple, tuple[int, ...], bool]]:
    """HF key -> (path into our params, our shape, transpose?) for every param of `cfg`."""
    shapes = dense.param_shapes(cfg)
    out: dict[str, tuple[tuple, tuple[int, ...], bool]] = {}
    for name, hf in _TOP_KEYS.items():
        if name in shapes:
            out[hf] = ((name,), tuple(shapes[name]), name != "embed")
    for i, layer in enumerate(shapes["layers"]):
        for name, shape in layer.items():
            if name not in _LAYER_KEYS:
                raise NotImplementedError(f"no Hugging Face name for layer param {name!r}")
            out[f"model.layers.{i}.{_LAYER_KEYS[name]}"] = (("layers", i, name), tuple(shape),
                                                           len(shape) == 2)
    return out


def _hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return tuple(reversed(shape)) if transpose else shape


def _listing(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


# --------------------------------------------------------------------------------------------------
# Loading


def _read_config(root: Path, tap_layers) -> ModelConfig:
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"checkpoint {root} has no {CONFIG_FILE}")
    try:
        hf = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg_path} must hold a JSON object, got {type(hf).__name__}")
    try:
        return ModelConfig.from_hf_dict(hf, tap_layers=tap_layers)
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def _shard_files(root: Path) -> dict[str, list[str] | None]:
    """Shard file name -> keys the index assigns to it (None: single file, keys from its header)."""
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise TypeError("weight_map must be a non-empty object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"malformed index {index_path}: {e!r}") from e
        shards: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            shards.setdefault(str(shard), []).append(key)
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise CheckpointError(f"index {index_path} names missing shard file(s): {_listing(missing)}")
        return shards
    if (root / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    others = sorted(p.name for p in root.glob("*.safetensors"))
    if others:
        raise CheckpointError(f"checkpoint {root} has safetensors files ({_listing(others)}) but "
                              f"neither {SINGLE_FILE} nor {INDEX_FILE}")
    raise CheckpointError(f"checkpoint {root} has no {SINGLE_FILE} (and no {INDEX_FILE})")


def _read_headers(root: Path, shards: dict[str, list[str] | None]):
    """key -> (file, shape, dtype) from the safetensors headers alone; checks index consistency."""
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for shard, indexed in shards.items():
        path = root / shard
        try:
            with safe_open(str(path), framework="numpy") as f:
                keys = list(f.keys())
                for key in keys:
                    piece = f.get_slice(key)
                    if key in found:
                        raise CheckpointError(f"key {key} appears in both {found[key][0].name} and {shard}")
                    found[key] = (path, tuple(piece.get_shape()), piece.get_dtype())
        except SafetensorError as e:
            raise CheckpointError(f"malformed or truncated safetensors file {path}: {e}") from e
        if indexed is not None and set(indexed) != set(keys):
            absent, unlisted = set(indexed) - set(keys), set(keys) - set(indexed)
            raise CheckpointError(
                f"index disagrees with shard {shard}: "
                + (f"listed but absent: {_listing(absent)}; " if absent else "")
                + (f"present but not listed: {_listing(unlisted)}" if unlisted else ""))
    return found


def _plan(root: Path, cfg: ModelConfig):
    """Everything checkable without reading tensor data.

    Returns (hf_key_map(cfg), key -> (file, shape, dtype), whether a tied lm_head.weight is stored).
    """
    found = _read_headers(root, _shard_files(root))
    expected = hf_key_map(cfg)
    extra_tied = cfg.tie_word_embeddings and _TOP_KEYS["lm_head"] in found
    present = {k for k in found if not k.endswith(IGNORED_SUFFIXES)}
    if extra_tied:
        present.discard(_TOP_KEYS["lm_head"])
    problems = key_problems(found, expected, present)
    if extra_tied:
        got = found[_TOP_KEYS["lm_head"]][1]
        if got != (cfg.vocab_size, cfg.hidden_size):
            problems.append(f"shape mismatch for lm_head.weight (tied): expected "
                            f"{(cfg.vocab_size, cfg.hidden_size)}, got {got}")
    if problems:
        raise CheckpointError(f"checkpoint {root} does not match its config ({cfg.architecture}, "
                              f"{cfg.num_layers} layers): " + "; ".join(problems))
    return expected, found, extra_tied


def _read_tensors(found, keys):
    """Yield (key, numpy array) for `keys`, opening each file once."""
    for key, reader in _slice_readers(found, keys):
        try:
            host = reader[:]
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensors from {found[key][0]}: {e}") from e
        yield key, host


def non_finite(arr, stored=None) -> str:
    """"" when `arr` is finite, else what is wrong ("2 NaN, 1 Inf of 4096 values"), saying when the
    stored values (`stored`, the array before a dtype conversion) were finite and the conversion
    overflowed."""
    arr = jnp.asarray(arr)
    if not jnp.issubdtype(arr.dtype, jnp.inexact) or bool(jnp.isfinite(arr).all()):
        return ""
    nan, inf = int(jnp.isnan(arr).sum()), int(jnp.isinf(arr).sum())
    what = ", ".join(f"{n} {name}" for n, name in ((nan, "NaN"), (inf, "Inf")) if n)
    msg = f"non-finite values ({what} of {arr.size})"
    if stored is not None and not non_finite(stored):
        msg += f": finite as stored ({jnp.asarray(stored).dtype}), they overflow {arr.dtype}"
    return msg


HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")


def key_problems(found: dict, expected: dict, present: set, hf_shape=None) -> list[str]:
    """What is wrong with a checkpoint's tensors against `expected` (HF key -> (our name, shape, layout)):
    missing and unexpected keys, shapes, dtypes. `found`: key -> (file, shape, dtype) from the headers;
    `hf_shape(shape, layout)`: the stored shape of one of ours (default: the dense layouts')."""
    hf_shape = hf_shape or _hf_shape
    missing, unexpected = set(expected) - present, present - set(expected)
    problems = []
    if missing:
        problems.append(f"missing key(s): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected key(s): {_listing(unexpected)}")
    for key in sorted(set(expected) & present):
        _, shape, layout = expected[key]
        want, got = hf_shape(shape, layout), found[key][1]
        if want != got:
            problems.append(f"shape mismatch for {key}: expected {want}, got {got}")
        if found[key][2] not in FLOAT_DTYPES:
            problems.append(f"{key} has dtype {found[key][2]}; expected one of {', '.join(FLOAT_DTYPES)}")
    return problems


def _declared_architecture(root: Path) -> str | None:
    """config.json's first architecture, or None where it cannot be read (`_read_config` then says why)."""
    try:
        archs = json.loads((root / CONFIG_FILE).read_text()).get("architectures") or [None]
        return archs[0]
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def load_hf(path: str | Path, dtype=jnp.bfloat16, tap_layers=(), mesh=None):
    """Load a HF directory into (params, cfg). dtype=None keeps the stored dtype. With a `mesh`, every
    tensor loads straight into its tensor-parallel sharding (`assemble_params`).

    Qwen3/Llama give a `ModelConfig`; Qwen3.5 (`HYBRID_ARCHITECTURES`) is loaded by
    `hybrid_checkpoint.load_hf` and gives a `HybridConfig`. `load_target` picks the target too."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"checkpoint path {root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is not a directory")
    if _declared_architecture(root) in HYBRID_ARCHITECTURES:
        from specpilot.models import hybrid_checkpoint  # it imports this module's helpers

        return hybrid_checkpoint.load_hf(root, dtype, tap_layers, mesh)
    cfg = _read_config(root, tap_layers)
    expected, found, extra_tied = _plan(root, cfg)
    if extra_tied:
        pair = dict(_read_tensors(found, [_TOP_KEYS["lm_head"], _TOP_KEYS["embed"]]))
        lm, emb = pair[_TOP_KEYS["lm_head"]], pair[_TOP_KEYS["embed"]]
        if lm.dtype != emb.dtype or not np.array_equal(lm.view(np.uint8), emb.view(np.uint8)):
            raise CheckpointError("config ties word embeddings but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
    return assemble_params(found, expected, cfg.num_layers, dtype,
                           lambda host, transpose: host.T if transpose else host, mesh), cfg


def _finite(found, key, raw, arr) -> None:
    problem = non_finite(arr, raw if arr.dtype != raw.dtype else None)
    if problem:
        raise CheckpointError(f"{found[key][0].name}: tensor {key} holds {problem}; a model with "
                              f"it would give NaN logits")


def _stored_index(index: tuple, layout, ndim: int):
    """The stored tensor's index for our slice `index` when our layout is the stored one (False, None,
    "plain") or its transpose (True, "transpose"); None for other layouts (read whole, then sliced)."""
    index = tuple(index) + (slice(None),) * (ndim - len(index))
    if layout in (False, None, "plain"):
        return index
    if layout in (True, "transpose") and ndim == 2:
        return index[::-1]
    return None


def _read_sharded(found, key, reader, shape, layout, to_ours, dtype, sharding):
    """One tensor placed on `sharding`: each device's slice read from the file (safetensors' slices), so
    no device and no host holds more than its part of a split tensor."""
    pieces = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        stored = _stored_index(index, layout, len(shape))
        if stored is None:
            part = np.ascontiguousarray(to_ours(reader[:], layout))[tuple(index)]
        else:
            part = np.ascontiguousarray(to_ours(reader[stored], layout))
        raw = jnp.asarray(part)
        arr = raw if dtype is None else raw.astype(dtype)
        _finite(found, key, raw, arr)
        pieces.append(jax.device_put(arr, device))
    return jax.make_array_from_single_device_arrays(shape, sharding, pieces)


def _slice_readers(found, keys):
    """Yield (key, safetensors slice reader) for `keys`, opening each file once."""
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(found[key][0], []).append(key)
    for path, file_keys in by_file.items():
        try:
            with safe_open(str(path), framework="numpy") as f:
                for key in file_keys:
                    yield key, f.get_slice(key)
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensors from {path}: {e}") from e


def assemble_params(found, expected, num_layers: int, dtype, to_ours, mesh=None) -> dict[str, Any]:
    """Read every expected tensor into our params tree: `expected[key] = (where, shape, layout)`, where
    `where` is ("layers", i, name) or (name,); `to_ours(host, layout)` turns a stored array into our
    layout. A tensor with a NaN or Inf (before or after the cast to dtype) raises, naming it. With a
    `mesh` (a jax.sharding.Mesh), each tensor goes straight into its `sharding.param_spec` sharding,
    each device reading only its slice from the file."""
    params: dict[str, Any] = {"layers": tuple({} for _ in range(num_layers))}
    if mesh is not None:
        from jax.sharding import NamedSharding

        from specpilot import sharding as mesh_sharding

        tensors = ((key, _read_sharded(found, key, reader, tuple(expected[key][1]), expected[key][2], to_ours,
                                       dtype, NamedSharding(mesh, mesh_sharding.param_spec(
                                           expected[key][0][-1], len(expected[key][1])))))
                   for key, reader in _slice_readers(found, expected))
    else:
        tensors = _host_tensors(found, expected, dtype, to_ours)
    for key, arr in tensors:
        where = expected[key][0]
        if where[0] == "layers":
            params["layers"][where[1]][where[2]] = arr
        else:
            params[where[0]] = arr
    return params


def _host_tensors(found, expected, dtype, to_ours):
    for key, host in _read_tensors(found, expected):
        layout = expected[key][2]
        raw = jnp.asarray(np.ascontiguousarray(to_ours(host, layout)))
        arr = raw if dtype is None else raw.astype(dtype)
        _finite(found, key, raw, arr)
        yield key, arr


def load_target(path: str | Path, dtype=jnp.bfloat16, tap_layers=(), mesh=None):
    """(target, params) for any supported HF directory: `dense.target` or `hybrid.target` by the
    architecture config.json names, at the params' dtype; with a `mesh`, params and state sharded over it."""
    params, cfg = load_hf(path, dtype, tap_layers, mesh)
    if isinstance(cfg, ModelConfig):
        return dense.target(cfg, params["embed"].dtype, mesh), params
    from specpilot.models import hybrid

    return hybrid.target(cfg, params["embed"].dtype, mesh=mesh), params


# --------------------------------------------------------------------------------------------------
# Saving


def _to_hf_tensors(params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Check params against `cfg` (same rules as loading) and lay them out as HF tensors."""
    tensors, problems = {}, []
    expected = hf_key_map(cfg)
    for key, (where, shape, transpose) in expected.items():
        try:
            node = params
            for step in where:
                node = node[step]
        except (KeyError, IndexError):
            problems.append(f"params lack {'/'.join(map(str, where))}")
            continue
        arr = np.asarray(node)
        if tuple(arr.shape) != shape:
            problems.append(f"{'/'.join(map(str, where))}: expected shape {shape}, got {arr.shape}")
            continue
        tensors[key] = np.ascontiguousarray(arr.T if transpose else arr)
    n_layers = len(params.get("layers", ()))
    if n_layers != cfg.num_layers:
        problems.append(f"params have {n_layers} layers, config says {cfg.num_layers}")
    if problems:
        raise CheckpointError("params do not match the config: " + "; ".join(problems))
    return tensors


def save_hf(params: dense.Params, cfg: ModelConfig, path: str | Path,
            max_shard_bytes: int | None = None) -> Path:
    """Write config.json + safetensors (sharded with an index when max_shard_bytes is set)."""
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    tensors = _to_hf_tensors(params, cfg)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [root / INDEX_FILE, root / SINGLE_FILE, *root.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = str(params["embed"].dtype)
    (root / CONFIG_FILE).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    meta = {"format": "pt"}  # transformers refuses safetensors files without a format tag
    if max_shard_bytes is None:
        save_file(tensors, str(root / SINGLE_FILE), metadata=meta)
        return root
    # Greedy fill in key order; a tensor larger than the limit gets a shard of its own.
    groups: list[list[str]] = [[]]
    size = 0
    for key, arr in tensors.items():
        if groups[-1] and size + arr.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += arr.nbytes
    weight_map = {}
    for n, keys in enumerate(groups, start=1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, str(root / name), metadata=meta)
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return root
