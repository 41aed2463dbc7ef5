"""Ahead-of-time compiled executables, kept by call signature, so a timed call never compiles.
Design notes: docs/design/decoding.md.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable

import jax

from specpilot import sharding


_ALL: list = []  # every CompileCache of the process, for `total_compiles`
_RECORDINGS: list[set] = []  # open `recording()` sets: each collects the (cache, signature) pairs used


def total_compiles() -> int:
    """Executables every compile cache of this process has built so far."""
    return sum(c.compiles for c in _ALL)


@contextlib.contextmanager
def recording():
    """Collect the executables used while open, as (cache id, signature) pairs in the set it yields
    (`keep_only`). Recordings nest: each open one collects."""
    used: set = set()
    _RECORDINGS.append(used)
    try:
        yield used
    finally:  # by identity: two open recordings may hold equal sets
        del _RECORDINGS[next(i for i, r in enumerate(_RECORDINGS) if r is used)]


def keep_only(used: set, caches: list | None = None) -> int:
    """Drop every executable and traced shape not in `used` (pairs from `recording`), in `caches` (default:
    every compile cache of this process): a warm worker drops the programs of the plans it no longer keeps
    (on the CPU their memory mappings outgrew its address-space limit). Returns the executables dropped."""
    dropped = 0
    for c in _ALL if caches is None else caches:
        for table in (c._exes, c._shapes):
            for sig in [s for s in table if (id(c), s) not in used]:
                dropped += table is c._exes
                del table[sig]
    return dropped


def clear_all() -> None:
    """Drop the executables of every compile cache of this process (each holds memory mappings of its own;
    on the CPU a process that keeps thousands of them can run out of the kernel's map count)."""
    for c in _ALL:
        c.clear()


class CompileCache:
    # 512: a warm worker holds a round's plans (each a few programs) and times them in turn; an evicted
    # program would compile again inside a timed run
    def __init__(self, max_size: int = 512):
        self.max_size = max_size
        self.compiles = 0  # executables built so far (a timed call that moves it compiled)
        self._exes: collections.OrderedDict = collections.OrderedDict()
        self._shapes: collections.OrderedDict = collections.OrderedDict()
        _ALL.append(self)

    def out_shapes(self, fn, static: Any, args: tuple):
        """`jax.eval_shape(fn(static, *args))`, traced once per signature (values never matter)."""
        sig = _signature(fn, static, args, jax.tree.leaves(args))
        self._record(sig)
        if sig in self._shapes:
            self._shapes.move_to_end(sig)
        else:
            self._shapes[sig] = jax.eval_shape(functools.partial(fn, static), *args)
            if len(self._shapes) > self.max_size:
                self._shapes.popitem(last=False)
        return self._shapes[sig]

    def _record(self, sig) -> None:
        for used in _RECORDINGS:
            used.add((id(self), sig))

    def __len__(self) -> int:
        """Executables held (each one compile): a call that adds none did not compile."""
        return len(self._exes)

    def clear(self) -> None:
        """Drop every executable and traced shape held (the compile count stays)."""
        self._exes.clear()
        self._shapes.clear()

    def get(self, fn, static: Any, args: tuple, lower: Callable[..., Any]):
        """The executable of `fn` for `static` and `args` (arrays or ShapeDtypeStructs); `lower(*args)`
        builds the lowering on a miss."""
        mesh = mesh_of(static)
        if mesh is not None:
            args = sharding.attach_shardings(args, mesh)
        leaves = jax.tree.leaves(args)
        sig = (*_signature(fn, static, args, leaves),
               None if mesh is None else tuple(str(getattr(x, "sharding", None)) for x in leaves))
        self._record(sig)
        if sig in self._exes:
            self._exes.move_to_end(sig)
        else:
            exe = lower(*args).compile()
            self.compiles += 1
            self._exes[sig] = exe if mesh is None else _Resharding(exe)
            if len(self._exes) > self.max_size:
                self._exes.popitem(last=False)
        return self._exes[sig]


def _signature(fn, static: Any, args: tuple, leaves: list) -> tuple:
    """What a trace of `fn(static, *args)` specializes on: function, statics, tree structure, leaf shapes."""
    return fn, static, jax.tree.structure(args), tuple((x.shape, str(x.dtype)) for x in leaves)


def mesh_of(static: Any):
    """The mesh of the target a static argument holds (itself, a tuple's first item, or `.target`)."""
    for candidate in (static, getattr(static, "target", None),
                      static[0] if isinstance(static, tuple) and static else None):
        mesh = getattr(candidate, "mesh", None)
        if mesh is not None:
            return mesh
    return None


def _none(x) -> bool:
    return x is None


class _Resharding:
    """A compiled executable that first moves each argument to the sharding the executable takes."""

    def __init__(self, exe):
        self.exe = exe
        # None: an argument the executable does not read (pruned), or a None argument
        self.shardings = jax.tree.leaves(exe.input_shardings[0], is_leaf=_none)

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args, is_leaf=_none)
        if len(leaves) != len(self.shardings):
            raise ValueError(f"{len(leaves)} argument leaves for an executable taking {len(self.shardings)}")
        moved = [x if s is None or x is None or getattr(x, "sharding", None) == s else sharding.place(x, s)
                 for x, s in zip(leaves, self.shardings)]
        return self.exe(*jax.tree.unflatten(tree, moved))

    @property
    def output_shardings(self):
        return self.exe.output_shardings
