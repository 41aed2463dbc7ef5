"""Brute-force counts of a jitted function: the jaxpr's dot_general FLOPs and the weight bytes it reads.

A walk over `jax.make_jaxpr`'s equations, into every nested jaxpr (jit, custom_jvp, scan bodies times
their length). A variable is a weight when it is a parameter leaf or a view of one (convert, reshape,
broadcast, transpose, or a jit/custom call's argument that is one). A weight leaf is read whole when any
other equation consumes a view of it; a gather from it reads the rows it outputs (an embedding).
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.extend import core as jcore

VIEWS = {"convert_element_type", "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
         "copy", "copy_p"}


def _nested(eqn):
    """(closed or open jaxpr, multiplicity) of the sub-jaxprs whose invars match eqn.invars one to one."""
    p = eqn.params
    name = eqn.primitive.name
    if name == "scan":
        return [(p["jaxpr"], int(p["length"]))]
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in p and (hasattr(p[key], "eqns") or hasattr(p[key], "jaxpr")):
            return [(p[key], 1)]
    if name in ("while", "cond"):
        raise NotImplementedError(f"{name}: the step under test has no data-dependent loops")
    return []


def _inner(j):
    return j.jaxpr if hasattr(j, "jaxpr") else j


class Count:
    def __init__(self):
        self.weight_dot_flops = 0.0
        self.other_dot_flops = 0.0
        self.read_leaves: set[int] = set()
        self.gathered_bytes = 0.0


def _dot_flops(eqn) -> float:
    lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    rhs_free = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
    return 2.0 * math.prod(lhs) * math.prod(rhs_free)


def _walk(jaxpr, prov: dict, mult: int, out: Count):
    """prov: var -> leaf id (the weight it views)."""
    def leaf(v):
        return None if isinstance(v, jcore.Literal) else prov.get(v)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [leaf(v) for v in eqn.invars]
        if name in VIEWS and ins[0] is not None:
            prov[eqn.outvars[0]] = ins[0]
            continue
        nested = _nested(eqn)
        if nested:
            for sub, k in nested:
                inner = _inner(sub)
                sub_prov = {iv: ins[i] for i, iv in enumerate(inner.invars) if ins[i] is not None}
                _walk(inner, sub_prov, mult * k, out)
                # a call that returns a view of a weight passes it on
                for ov_outer, ov_inner in zip(eqn.outvars, inner.outvars):
                    if not isinstance(ov_inner, jcore.Literal) and ov_inner in sub_prov:
                        prov[ov_outer] = sub_prov[ov_inner]
            continue
        if name == "dot_general":
            if ins[0] is not None or ins[1] is not None:
                out.weight_dot_flops += mult * _dot_flops(eqn)
            else:
                out.other_dot_flops += mult * _dot_flops(eqn)
        if name == "gather" and ins[0] is not None:
            aval = eqn.outvars[0].aval
            out.gathered_bytes += mult * math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
            continue
        for i in ins:
            if i is not None:
                out.read_leaves.add(i)


def count(fn, weights, *args) -> tuple[Count, float]:
    """Walk `fn(weights, *args)`'s jaxpr. weights: a pytree of arrays or ShapeDtypeStructs (the
    parameters); -> (Count, weight bytes read)."""
    closed = jax.make_jaxpr(fn)(weights, *args)
    leaves = jax.tree_util.tree_leaves(weights)
    jaxpr = closed.jaxpr
    prov = {jaxpr.invars[i]: i for i in range(len(leaves))}
    out = Count()
    _walk(jaxpr, prov, 1, out)
    nbytes = sum(math.prod(leaves[i].shape) * np.dtype(leaves[i].dtype).itemsize for i in out.read_leaves)
    return out, nbytes + out.gathered_bytes
