"""Tensor and data parallelism with jax.sharding: a plan's mesh (`make_mesh`), where every param and state
array lives (`param_spec`, `state_specs`: Megatron-style splits that GSPMD completes with collectives),
the layout hints model code gives while a sharded target traces, and the check that a mesh divides what
it splits. Design notes: docs/design/models.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specpilot.state import AttentionState, RecurrentState, TargetState

AXES = ("data", "tensor")
COLUMN = frozenset({"q", "k", "v", "gate", "up", "z", "b", "a", "lm_head"})  # [in, out]: split out
COLUMN_BIASES = frozenset({"q_bias", "k_bias", "v_bias", "gate_bias", "up_bias"})
ROW = frozenset({"o", "down", "out"})  # [in, out]: split in
VOCAB_ROWS = frozenset({"embed"})  # [V, H]: split V


class MeshError(ValueError):
    """A mesh the devices or the model cannot take; the message names what does not divide."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Devices along each parallel axis: `data` (batch rows) x `tensor` (heads, features)."""

    data: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MeshError(f"mesh.{name} must be a positive integer, got {value!r}")

    @property
    def size(self) -> int:
        return self.data * self.tensor

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def describe(self) -> str:
        return f"{self.data}x{self.tensor}"


def make_mesh(shape: MeshShape, devices=None) -> Mesh:
    """A ("data", "tensor") mesh over the first shape.size devices (default: all of jax's)."""
    devices = list(jax.devices() if devices is None else devices)
    if shape.size > len(devices):
        raise MeshError(f"mesh {shape.describe()} (data x tensor) needs {shape.size} devices; jax sees "
                        f"{len(devices)} ({devices[0].platform}). On a CPU, simulate more with "
                        f"simulated_cpu_devices={shape.size} (or XLA_FLAGS="
                        f"--xla_force_host_platform_device_count={shape.size})")
    return Mesh(np.array(devices[:shape.size]).reshape(shape.data, shape.tensor), AXES)


def device_groups(shape: MeshShape, devices=None) -> list[list]:
    """The devices split into disjoint groups of shape.size, in order (a whole group per evaluated
    candidate, so candidates never share a device); devices left over are not used."""
    devices = list(jax.devices() if devices is None else devices)
    if shape.size > len(devices):
        raise MeshError(f"a {shape.describe()} mesh needs {shape.size} devices; there are {len(devices)}")
    n = len(devices) // shape.size
    return [devices[i * shape.size:(i + 1) * shape.size] for i in range(n)]


def mesh_shape(mesh: Mesh) -> MeshShape:
    return MeshShape(data=int(mesh.shape["data"]), tensor=int(mesh.shape["tensor"]))


# --------------------------------------------------------------------------------------------------
# Checks


def _model_splits(cfg) -> dict[str, int]:
    """What a tensor split divides in one model config (dense, hybrid or a drafter's layers)."""
    out = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
           "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
    if hasattr(cfg, "linear_num_value_heads") and any(cfg.is_linear(i) for i in range(cfg.num_layers)):
        out["linear_num_value_heads"] = cfg.linear_num_value_heads
    return out


def check_mesh(shape: MeshShape, cfg, batch_size: int | None = None, drafter_cfg=None,
               where: str = "mesh") -> None:
    """Raise a MeshError naming the first quantity `shape` does not divide: the target's (and drafter's)
    heads, KV heads, MLP width, vocabulary, a hybrid's value heads; the batch over "data"."""
    configs = [("target", cfg)] + ([("drafter", drafter_cfg)] if drafter_cfg is not None else [])
    for who, c in configs:
        for name, value in _model_splits(c).items():
            if value % shape.tensor:
                raise MeshError(f"{where}.tensor={shape.tensor} does not divide the {who}'s {name} ({value})")
    if batch_size is not None and batch_size % shape.data:
        raise MeshError(f"{where}.data={shape.data} does not divide the batch size ({batch_size})")


# --------------------------------------------------------------------------------------------------
# Params


def param_spec(name: str, ndim: int) -> P:
    """The PartitionSpec of the param leaf `name` (its dict key) with `ndim` axes."""
    if name in COLUMN and ndim == 2:
        return P(None, "tensor")
    if name in ROW and ndim == 2:
        return P("tensor", None)
    if name in VOCAB_ROWS and ndim == 2:
        return P("tensor", None)
    if name in COLUMN_BIASES and ndim == 1:
        return P("tensor")
    return P()


def _leaf_name(path) -> str:
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey):
            return str(entry.key)
    return ""


def param_shardings(params, mesh: Mesh):
    """A pytree of NamedShardings matching params (plain arrays only: W12 and kernel layouts are not
    sharded)."""
    def one(path, leaf):
        if not isinstance(leaf, (jax.Array, np.ndarray)):
            raise MeshError(f"param {jax.tree_util.keystr(path)} is a {type(leaf).__name__}; tensor-parallel "
                            "plans take plain bf16/float32 arrays (W12 and kernel layouts are not sharded)")
        return NamedSharding(mesh, param_spec(_leaf_name(path), leaf.ndim))

    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params, mesh: Mesh):
    """params placed on the mesh by `param_spec` (each device receives its own slice)."""
    return jax.device_put(params, param_shardings(params, mesh))


_FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def unfuse_projections(params, cfg) -> dict:
    """A dense model's params with fused `qkv` / `gate_up` (and their biases) split back into q, k, v,
    gate, up: the inverse of `dense.fuse_projections`, for head-aligned column splits."""
    sizes = {"qkv": (cfg.q_size, cfg.kv_size, cfg.kv_size),
             "gate_up": (cfg.intermediate_size, cfg.intermediate_size)}

    def layer(p):
        out = dict(p)
        for fused, parts in _FUSED.items():
            for suffix in ("", "_bias"):
                if fused + suffix in out:
                    w = out.pop(fused + suffix)
                    offsets = np.cumsum((0,) + sizes[fused])
                    for i, n in enumerate(parts):
                        out[n + suffix] = w[..., int(offsets[i]):int(offsets[i + 1])]
        return out

    return {**params, "layers": tuple(layer(p) for p in params["layers"])}


# --------------------------------------------------------------------------------------------------
# State


def _attention_specs(layer: AttentionState) -> AttentionState:
    spec = P("data", "tensor", None, None)  # [B, KVH, S, D]
    return AttentionState(spec, spec)


def _recurrent_specs(layer: RecurrentState) -> RecurrentState:
    return RecurrentState(conv=P("data", None, None), matrix=P("data", "tensor", None, None),
                          conv_snapshots=P("data", None, None, None),
                          matrix_snapshots=P("data", None, "tensor", None, None))


def state_specs(state: TargetState) -> TargetState:
    """PartitionSpecs for every array of a TargetState (attention and recurrent layers)."""
    layers = tuple(_attention_specs(layer) if isinstance(layer, AttentionState) else _recurrent_specs(layer)
                   for layer in state.layers)
    return TargetState(layers=layers, lengths=P("data"))


def constrain_state(state: Any, mesh: Mesh | None) -> Any:
    """`state` with the mesh's shardings (`state_specs`) imposed; other states (a replay drafter's
    reference array) and mesh=None pass through."""
    if mesh is None or not isinstance(state, TargetState):
        return state
    specs = state_specs(state)
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s)), state, specs)


def attach_shardings(tree: Any, mesh: Mesh) -> Any:
    """ShapeDtypeStruct leaves of `tree` given shardings on `mesh`: a TargetState's by `state_specs`, any
    other struct replicated; arrays and structs that have a sharding are kept."""
    def struct(x, spec):
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        return x

    def node(x):
        if isinstance(x, TargetState):
            return jax.tree.map(struct, x, state_specs(x))
        return struct(x, P())

    return jax.tree.map(node, tree, is_leaf=lambda x: isinstance(x, (TargetState, jax.ShapeDtypeStruct)))


def host_array(x) -> np.ndarray:
    """x on the host, also when it spans processes (multi-host meshes: every process gets the whole
    array, gathered from the processes that hold its parts)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def place(x, target_sharding):
    """x moved to `target_sharding`; a process-local array bound for a mesh spanning processes goes
    through the host (each process supplies the parts its devices hold)."""
    if isinstance(x, jax.Array) and x.is_fully_addressable and not target_sharding.is_fully_addressable:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(place(jax.random.key_data(x), target_sharding), impl=impl)
        x = np.asarray(x)
    return jax.device_put(x, target_sharding)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("specpilot_active_mesh", default=None)


@contextlib.contextmanager
def active(mesh: Mesh | None):
    """While tracing a sharded target's forward: the mesh `hint` constrains over (None: no hints)."""
    token = _ACTIVE.set(mesh)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def hint(x: jax.Array, spec: P) -> jax.Array:
    """x constrained to `spec` on the active mesh; x itself when no sharded forward is being traced."""
    mesh = _ACTIVE.get()
    return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
