"""Reading Hugging Face checkpoint folders, whatever the model: the file layout (config.json, one
safetensors file or shards with an index), header checks against the keys and shapes a config implies,
and tensors read one at a time (or one device slice at a time) into a params tree with a finiteness
check. The dense (`checkpoint`) and hybrid (`hybrid_checkpoint`) loaders both build on it, so it sits
below them. Design notes: docs/design/models.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers 'bfloat16' with numpy; safetensors' numpy reader needs it
import numpy as np
from jax.sharding import NamedSharding
from safetensors import SafetensorError, safe_open

from specpilot import sharding as mesh_sharding
from specpilot.models.config import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LM_HEAD_KEY = "lm_head.weight"

# Our per-layer name -> HF name under `...layers.{i}.`, for the attention and MLP parts every target has.
ATTENTION_MLP_KEYS = {
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias", "down_bias": "mlp.down_proj.bias",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded into (or written from) the configured model."""


def listing(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def hf_shape(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    """The stored shape of one of our tensors: HF linear weights are [out, in], ours [in, out]."""
    return tuple(reversed(shape)) if transpose else shape


def read_config(root: Path, config_cls, tap_layers):
    """`config_cls.from_hf_dict` of root's config.json, every problem a `CheckpointError` naming the file."""
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
        return config_cls.from_hf_dict(hf, tap_layers=tap_layers)
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: {e}") from e


def declared_architecture(root: Path) -> str | None:
    """config.json's first architecture, or None where it cannot be read (`read_config` then says why)."""
    try:
        archs = json.loads((root / CONFIG_FILE).read_text()).get("architectures") or [None]
        return archs[0]
    except (OSError, ValueError, AttributeError, TypeError):
        return None


# --------------------------------------------------------------------------------------------------
# Headers


def shard_files(root: Path) -> dict[str, list[str] | None]:
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
        for shard in shards:
            check_inside(root, shard, index_path)
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise CheckpointError(f"index {index_path} names missing shard file(s): {listing(missing)}")
        return shards
    if (root / SINGLE_FILE).is_file():
        return {SINGLE_FILE: None}
    others = sorted(p.name for p in root.glob("*.safetensors"))
    if others:
        raise CheckpointError(f"checkpoint {root} has safetensors files ({listing(others)}) but "
                              f"neither {SINGLE_FILE} nor {INDEX_FILE}")
    raise CheckpointError(f"checkpoint {root} has no {SINGLE_FILE} (and no {INDEX_FILE})")


def check_inside(root: Path, name: str, index_path: Path) -> None:
    """Refuse a shard name that leaves the checkpoint folder: absolute, with `..`, or a link that resolves
    outside it (a Hugging Face hub snapshot's links into its own `../../blobs` are the one exception)."""
    if not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise CheckpointError(f"index {index_path} names shard {name!r} outside the checkpoint folder; "
                              f"a shard must be a file name inside {root}")
    real, allowed = (root / name).resolve(), [root.resolve()]
    if root.resolve().parent.name == "snapshots":
        allowed.append(root.resolve().parent.parent / "blobs")
    if not any(real.is_relative_to(folder) for folder in allowed):
        raise CheckpointError(f"index {index_path} names shard {name!r}, a link to {real} outside the "
                              f"checkpoint folder; copy the file into {root}")


def read_headers(root: Path, shards: dict[str, list[str] | None]):
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
                + (f"listed but absent: {listing(absent)}; " if absent else "")
                + (f"present but not listed: {listing(unlisted)}" if unlisted else ""))
    return found


def key_problems(found: dict, expected: dict, present: set, stored_shape=None) -> list[str]:
    """What is wrong with a checkpoint's tensors against `expected` (HF key -> (our name, shape, layout)):
    missing and unexpected keys, shapes, dtypes. `found`: key -> (file, shape, dtype) from the headers;
    `stored_shape(shape, layout)`: the stored shape of one of ours (default: `hf_shape`)."""
    stored_shape = stored_shape or hf_shape
    missing, unexpected = set(expected) - present, present - set(expected)
    problems = []
    if missing:
        problems.append(f"missing key(s): {listing(missing)}")
    if unexpected:
        problems.append(f"unexpected key(s): {listing(unexpected)}")
    for key in sorted(set(expected) & present):
        _, shape, layout = expected[key]
        want, got = stored_shape(shape, layout), found[key][1]
        if want != got:
            problems.append(f"shape mismatch for {key}: expected {want}, got {got}")
        if found[key][2] not in FLOAT_DTYPES:
            problems.append(f"{key} has dtype {found[key][2]}; expected one of {', '.join(FLOAT_DTYPES)}")
    return problems


def plan(root: Path, cfg, expected: dict, stored_shape=None, ignored_prefixes=()):
    """Everything checkable without reading tensor data, for a config `cfg` whose params are `expected`
    (HF key -> (where, shape, layout)): key sets, shapes, dtypes, and a stored copy of a tied lm_head.
    Returns (key -> (file, shape, dtype), whether a tied `lm_head.weight` is stored)."""
    found = read_headers(root, shard_files(root))
    extra_tied = cfg.tie_word_embeddings and LM_HEAD_KEY in found
    present = {k for k in found if not k.endswith(IGNORED_SUFFIXES) and not k.startswith(ignored_prefixes)}
    if extra_tied:
        present.discard(LM_HEAD_KEY)
    problems = key_problems(found, expected, present, stored_shape)
    if extra_tied:
        got = found[LM_HEAD_KEY][1]
        if got != (cfg.vocab_size, cfg.hidden_size):
            problems.append(f"shape mismatch for lm_head.weight (tied): expected "
                            f"{(cfg.vocab_size, cfg.hidden_size)}, got {got}")
    if problems:
        raise CheckpointError(f"checkpoint {root} does not match its config ({cfg.architecture}, "
                              f"{cfg.num_layers} layers): " + "; ".join(problems))
    return found, extra_tied


# --------------------------------------------------------------------------------------------------
# Tensors


def check_tied_copy(found, embed_key: str) -> None:
    """A tied checkpoint's stored lm_head.weight is accepted only when it is the embedding bit for bit:
    anything else would silently change the model."""
    pair = dict(read_tensors(found, [LM_HEAD_KEY, embed_key]))
    lm, emb = pair[LM_HEAD_KEY], pair[embed_key]
    if lm.dtype != emb.dtype or not np.array_equal(lm.view(np.uint8), emb.view(np.uint8)):
        raise CheckpointError(f"config ties word embeddings but lm_head.weight differs from {embed_key}")


def read_tensors(found, keys):
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
    for key, host in read_tensors(found, expected):
        layout = expected[key][2]
        raw = jnp.asarray(np.ascontiguousarray(to_ours(host, layout)))
        arr = raw if dtype is None else raw.astype(dtype)
        _finite(found, key, raw, arr)
        yield key, arr
