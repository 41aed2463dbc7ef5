"""Ahead-of-time compiled executables, kept by call signature, so a timed call never compiles.

Design choices:
- The signature is the function, its static arguments, the arguments' tree structure and every leaf's
  shape and dtype (values never matter), which is exactly what `jit(...).lower(...)` specializes on.
- Least recently used executables are dropped past `max_size`: a sweep over many deployments in one
  process must not grow memory without bound.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax


class CompileCache:
    def __init__(self, max_size: int = 64):
        self.max_size = max_size
        self._exes: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        """Executables held (each one compile): a call that adds none did not compile."""
        return len(self._exes)

    def get(self, fn, static: Any, args: tuple, lower: Callable[[], Any]):
        """The executable of `fn` for `static` and `args` (arrays or ShapeDtypeStructs); `lower()` builds
        the lowering on a miss."""
        sig = (fn, static, jax.tree.structure(args), tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args)))
        if sig in self._exes:
            self._exes.move_to_end(sig)
        else:
            self._exes[sig] = lower().compile()
            if len(self._exes) > self.max_size:
                self._exes.popitem(last=False)
        return self._exes[sig]
