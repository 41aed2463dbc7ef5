"""The on-disk cache of a model's W12 encodings: the matrices `w12.encode_params` makes, in one safetensors
file under the run's cache folder, keyed by digests of the source matrices' contents and shapes, the
encoder's settings and the format's source, so a second run of the same weights loads them instead of
encoding. Writes are atomic; an entry whose key or content digests do not match is rebuilt, never used.
Design notes: docs/design/kernels.md.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specpilot.formats import w12

FILE_VERSION = 1  # the file's own layout (names, metadata); the encoding's bits are keyed by w12.py's source
SUBDIR = "w12"  # under the run's cache_dir
MAX_BYTES = 40 * 2**30  # least recently used entries go past this (a Qwen3-8B entry is about 11.4 GB)
STALE_TMP_S = 3600  # a temporary file this old is a write that never finished
SEEDS = (0x9E3779B9, 0x7F4A7C15)  # two position keys: a 64-bit content digest per matrix

log = logging.getLogger(__name__)


def _fmix(h: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection of uint32 that spreads every input bit."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@jax.jit
def _content_digest(a: jax.Array) -> jax.Array:
    """uint32 [2] of a bf16 matrix on its device: per seed, the wrapping sum over positions i of
    fmix(bits_i + fmix(i ^ seed)). Changing any value changes its term, so each sum (almost surely)."""
    u = jax.lax.bitcast_convert_type(a, jnp.uint16).reshape(-1).astype(jnp.uint32)
    i = jax.lax.iota(jnp.uint32, u.shape[0])
    return jnp.stack([jnp.sum(_fmix(u + _fmix(i ^ jnp.uint32(s))), dtype=jnp.uint32) for s in SEEDS])


def _format_source() -> str:
    """sha256 of w12.py: any change to the module that defines the bits invalidates every entry."""
    return hashlib.sha256(Path(w12.__file__).read_bytes()).hexdigest()


def cache_key(names: list[str], matrices: list, settings: dict) -> str | None:
    """The entry's key: the source matrices' names, shapes and content digests (computed on their devices,
    one sync), the encoder's settings and the format's source. None where a matrix is not bf16 (the
    encoder refuses it; nothing is cached)."""
    if any(np.dtype(m.dtype) != np.dtype(jnp.bfloat16) or m.ndim not in (1, 2) for m in matrices):
        return None
    digests = jax.device_get([_content_digest(jnp.asarray(m)) for m in matrices])
    desc = {"file": FILE_VERSION, "format": _format_source(), "settings": settings,
            "matrices": [[n, list(m.shape), [int(x) for x in d]] for n, m, d in zip(names, matrices, digests)]}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()


def _tensor_digest(a: np.ndarray) -> str:
    """sha256 of a tensor's dtype, shape and bytes (the header's claims and the data together)."""
    h = hashlib.sha256(f"{a.dtype.str}{list(a.shape)}".encode())
    h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def _digests(tensors: dict[str, np.ndarray]) -> dict[str, str]:
    """Every tensor's digest, hashed in threads (hashlib releases the GIL on large buffers)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return dict(zip(tensors, pool.map(_tensor_digest, tensors.values())))


def save(path: Path, key: str, entries: dict[str, Any]) -> None:
    """Write {name: W12 | kept bf16 matrix} to `path` atomically (a temporary file in the same folder, then
    os.replace). Kept matrices are recorded by name only: a load takes them from the source params."""
    host = jax.device_get({name: {f: getattr(w, f) for f in w12.FIELDS}
                           for name, w in entries.items() if isinstance(w, w12.W12)})
    tensors, meta = {}, {}
    for name, w in entries.items():
        meta[name] = None
        if isinstance(w, w12.W12):
            meta[name] = {"shape": list(w.shape), "group_n": w.group_n, "group_k": w.group_k}
            tensors.update({f"{name}.{f}": np.ascontiguousarray(host[name][f]) for f in w12.FIELDS})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_safetensors(tmp, tensors, {"key": key, "matrices": json.dumps(meta),
                                          "sha256": json.dumps(_digests(tensors))})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_DTYPES = {np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int32): "I32", np.dtype(np.uint16): "U16"}
_NP_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """A safetensors file written tensor by tensor from the arrays' own buffers (`safetensors.numpy.save_file`
    first copies every tensor into a bytes object: 11 GB more host memory for an 8B model): an 8-byte
    little-endian header length, the JSON header padded with spaces to 8 bytes, then the data."""
    header, offset = {"__metadata__": metadata}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in tensors.values():
            f.write(memoryview(a).cast("B"))  # no fsync: a file cut short by a crash fails its digests


def _read_safetensors(path: Path) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """A file `_write_safetensors` wrote: (metadata, {name: the tensor as a read-only view of a memory map}),
    so hashing threads page the file in side by side and nothing is copied before the device. A header
    that does not parse, or tensors out of the file, overlapping, of the wrong size or leaving bytes over,
    raise ValueError."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= size - 8:
            raise ValueError(f"its header length {n} does not fit the file's {size} bytes")
        header = json.loads(f.read(n))
    metadata = header.pop("__metadata__", {})
    data = np.memmap(path, np.uint8, "r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    tensors, end = {}, 0
    for name, t in header.items():  # in the order written: each tensor right after the last
        begin, stop = t["data_offsets"]
        dtype = np.dtype(_NP_DTYPES[t["dtype"]])
        if begin != end or stop > data.size or stop - begin != dtype.itemsize * math.prod(t["shape"]):
            raise ValueError(f"tensor {name} is not where its header says")
        tensors[name], end = data[begin:stop].view(dtype).reshape(t["shape"]), stop
    if end != data.size:
        raise ValueError(f"{data.size - end} bytes follow the last tensor")
    return metadata, tensors


def load(path: Path, key: str, sources: dict[str, Any]) -> dict[str, Any] | None:
    """The entries saved at `path` under `key`, each W12 on its source matrix's device (kept matrices: the
    source itself), or None if there is no entry. An entry with another key, other matrices, a digest
    that does not match or a file that does not parse is removed and None returned (the caller rebuilds)."""
    if not path.exists():
        return None
    try:
        md, tensors = _read_safetensors(path)
        if md.get("key") != key:
            raise ValueError("it was written for other weights or settings")
        meta, digests = json.loads(md["matrices"]), json.loads(md["sha256"])
        if list(meta) != list(sources) or set(digests) != set(tensors):
            raise ValueError("its matrices are not the source's")
        bad = [name for name, d in _digests(tensors).items() if d != digests[name]]
        if bad:
            raise ValueError(f"{len(bad)} tensors do not match their digests (first: {bad[0]})")
        out = {}
        for name, m in meta.items():
            if m is None:
                out[name] = sources[name]
                continue
            src = sources[name]
            # copied out of the file's map first: jax on a CPU keeps a pointer into host arrays it is given
            # (may_alias=False included, jax 0.10), which would outlive the map
            fields = jax.device_put({f: np.array(tensors[f"{name}.{f}"], copy=True) for f in w12.FIELDS},
                                    w12.placement(src) if isinstance(src, jax.Array) else None)
            out[name] = w12.W12(**fields, shape=tuple(m["shape"]), group_n=m["group_n"], group_k=m["group_k"])
    except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt, whatever broke it
        log.warning("W12 cache entry %s is not used and will be rebuilt: %s", path, e)
        path.unlink(missing_ok=True)
        return None
    os.utime(path)  # most recently used: evicted last
    return out


def evict(folder: Path, keep: Path, max_bytes: int | None = None) -> None:
    """Remove the least recently used entries past `max_bytes` (default MAX_BYTES; never `keep`) and
    unfinished temporary files."""
    max_bytes = MAX_BYTES if max_bytes is None else max_bytes
    now = time.time()
    for tmp in folder.glob(".*.tmp"):
        if now - tmp.stat().st_mtime > STALE_TMP_S:
            tmp.unlink(missing_ok=True)
    total = 0
    for p in sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True):
        total += p.stat().st_size
        if total > max_bytes and p != keep:
            p.unlink(missing_ok=True)


def encode_params(params: dict, names: tuple[str, ...] = w12.LINEAR_NAMES, lm_head: bool = True,
                  max_exception_rate: float = 0.01, extra: tuple[str, ...] = (), cache_dir: str | None = None,
                  **kw) -> dict:
    """`w12.encode_params`, with the encodings kept under `cache_dir`/w12 (None: no cache): loaded when an
    entry for these matrices and settings exists and checks out, else encoded and written."""
    if cache_dir is None:
        return w12.encode_params(params, names, lm_head, max_exception_rate, extra, **kw)
    paths = w12.matrix_names(params, names, lm_head, extra)
    matrices: list = []
    w12.map_matrices(lambda x: matrices.append(x) or x, params, names, lm_head, extra)
    key = cache_key(paths, matrices, {"max_exception_rate": max_exception_rate, **kw})
    if key is None:
        return w12.encode_params(params, names, lm_head, max_exception_rate, extra, **kw)
    path = Path(cache_dir).expanduser() / SUBDIR / f"{key[:40]}.safetensors"
    sources = dict(zip(paths, matrices))
    entries = load(path, key, sources)
    if entries is None:
        entries = {name: w12.encode_matrix(x, max_exception_rate, **kw) for name, x in sources.items()}
        try:
            save(path, key, entries)
            evict(path.parent, keep=path)
        except OSError as e:  # a full or read-only disk costs the next run an encode, not this one
            log.warning("W12 cache entry %s not written: %s", path, e)
    done = iter(entries[name] for name in paths)
    return w12.map_matrices(lambda _: next(done), params, names, lm_head, extra)
