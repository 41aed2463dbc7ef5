"""Row-stationary float32 products for the CPU, the few rows a verification multiplies (`rows_matmul.cc`).

XLA's CPU dot hands 4-16 rows to a library GEMM that repacks the weights on every call, so on two cores
a verification of 4-8 tokens costs 2-2.6x one token's forward. This kernel reads each weight once per
call from a layout made offline (`RowPanels`: column panels of 64, each K x 64 values contiguous) and
uses it for every row. Each output sums over k in one fixed order whatever the row count, so a row's
result does not depend on how many rows share the call (batch-invariant).

The C++ source is compiled on first use with the machine's C++ compiler (`c++`, or $CXX) for the
machine's own vector width, into a cache folder keyed by the source, the jax version and the CPU's
flags; without a compiler, or off x86-64 / a CPU backend, `available()` is False and the dispatch falls
through to the next implementation (XLA). The reference is XLA's float32 dot (`rows_matmul_reference`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

COLS = 64  # columns per panel (rows_matmul.cc: kCols)
TARGET = "specpilot_rows_matmul"
SOURCE = Path(__file__).with_name("rows_matmul.cc")
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "error" (why unavailable) or "lib" (the loaded library, registered)


@dataclasses.dataclass(frozen=True)
class RowPanels:
    """A float32 [K, N] matrix laid out for the kernel: panels [N / 64, K, 64]. A pytree."""

    panels: Any  # float32 [N / COLS, K, COLS]
    shape: tuple[int, int]  # static: (K, N)

    @property
    def dtype(self):
        return jnp.float32

    @property
    def ndim(self) -> int:
        return 2


jax.tree_util.register_dataclass(RowPanels, data_fields=["panels"], meta_fields=["shape"])


def to_panels(w) -> RowPanels:
    """[K, N] float32 -> RowPanels (offline work). N must be a multiple of 64."""
    k, n = w.shape
    if w.dtype != jnp.float32 or n % COLS:
        raise NotImplementedError(f"the CPU rows kernel takes float32 [K, N] weights with N % {COLS} == 0, "
                                  f"got {w.dtype} {tuple(w.shape)}")
    panels = jnp.transpose(jnp.reshape(jnp.asarray(w), (k, n // COLS, COLS)), (1, 0, 2))
    return RowPanels(panels=panels, shape=(int(k), int(n)))


def from_panels(w: RowPanels) -> jax.Array:
    """The [K, N] matrix a RowPanels holds (exact)."""
    k, n = w.shape
    return jnp.reshape(jnp.transpose(w.panels, (1, 0, 2)), (k, n))


def _cache_dir() -> Path:
    root = os.environ.get("SPECPILOT_KERNEL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "specpilot" / "cpu_rows"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    """The compiled library for this source, jax and CPU (compiled once, then found in the cache)."""
    key = hashlib.sha256(SOURCE.read_bytes() + jax.__version__.encode() + _cpu_flags().encode()).hexdigest()[:16]
    out = _cache_dir() / f"rows_matmul-{key}.so"
    if out.is_file():
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise NotImplementedError("the CPU rows kernel needs a C++ compiler (c++, g++ or clang++; or set CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # built aside, then renamed: never half a file
        lib = Path(tmp) / out.name
        cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
               str(SOURCE), "-o", str(lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise NotImplementedError(f"the CPU rows kernel did not compile ({' '.join(cmd)}):\n"
                                      f"{proc.stderr[-2000:]}")
        os.replace(lib, out)
    return out


def available() -> bool:
    """Whether the kernel runs here (x86-64, a CPU backend, a C++ compiler), building it on first call."""
    with _lock:
        if "lib" in _state or "error" in _state:
            return "lib" in _state
        try:
            if platform.machine().lower() not in ("x86_64", "amd64"):
                raise NotImplementedError(f"the CPU rows kernel is built for x86-64, not {platform.machine()}")
            lib = ctypes.cdll.LoadLibrary(str(_build()))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.SpecpilotRowsMatmul), platform="cpu")
            _state["lib"] = lib
        except NotImplementedError as e:
            _state["error"] = str(e)
        except OSError as e:  # an unwritable cache folder, a library that will not load
            _state["error"] = f"the CPU rows kernel could not be built or loaded: {e}"
        return "lib" in _state


def unavailable_reason() -> str | None:
    return None if available() else _state["error"]


def rows_matmul(x: jax.Array, w: RowPanels) -> jax.Array:
    """x [..., K] float32 @ w (RowPanels of a [K, N] matrix) -> float32 [..., N], on the CPU.
    Raises NotImplementedError where the kernel cannot take the call (the dispatch falls through)."""
    if not isinstance(w, RowPanels):
        raise NotImplementedError(f"the CPU rows kernel multiplies RowPanels (dispatch.prepare_weight), got "
                                  f"{type(w).__name__}")
    if x.dtype != jnp.float32:
        raise NotImplementedError(f"the CPU rows kernel takes float32 activations, got {x.dtype}")
    if jax.default_backend() != "cpu" or not available():
        raise NotImplementedError(_state.get("error") or "the CPU rows kernel runs on the CPU backend only")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} does not match the weight's K {k}")
    lead = x.shape[:-1]
    m = int(np.prod(lead)) if lead else 1
    if m == 0:
        return jnp.zeros((*lead, n), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    y = call(jnp.reshape(x, (m, k)), w.panels)
    return jnp.reshape(y, (*lead, n))


def rows_matmul_reference(x: jax.Array, w: RowPanels) -> jax.Array:
    """The same product by XLA's float32 dot."""
    return jnp.einsum("...k,kn->...n", x, from_panels(w), preferred_element_type=jnp.float32)
